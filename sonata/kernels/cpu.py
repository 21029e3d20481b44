"""Fused numba CPU kernels for the selective scan: forward and hand-written backward.

Semantics are exactly those of `selective_scan_ref` (sonata/kernels/reference.py):

    dt_t = softplus(delta_t + delta_bias)   (bias and softplus optional)
    a_t  = exp(dt_t * A)                                  # (N,) per channel
    h_t  = a_t * h_{t-1} + dt_t * u_t * B_t               # h_{-1} = 0
    y_t  = C_t . h_t + D * u_t
    out  = y * silu(z)                                    (z optional)

Forward. One numba call, parallel over (batch, channel) work items: each
item owns one channel of one sequence, keeps its state h (N floats, in its
row of last_state) and walks the L time steps, computing exp(dt_t * A) on the
fly; the loop over the N state entries is vectorized. Nothing of size
(batch, d_inner, L, N) is ever stored: besides `out` and the last state it saves
one state per chunk of CHUNK time steps (the state at the start of the chunk),
shape (batch, d_inner, n_chunks, N).

Backward. The adjoint g_t = dLoss/dh_t obeys the reverse scan

    g_t = C_t * dy_t + a_{t+1} * g_{t+1}          (g_{L-1} gets dlast added)

i.e. the same recurrence run backwards with the decay shifted by one step. From
g_t and the states h_{t-1}, h_t every gradient is local in time:

    dC_t   += dy_t * h_t                    (summed over channels)
    dB_t   += g_t * dt_t * u_t              (summed over channels)
    q_t     = g_t * a_t * h_{t-1}
    dA     += dt_t * q_t                    (summed over batch and time)
    ddt_t   = sum_n A * q_t + u_t * sum_n B_t * g_t
    du_t    = D * dy_t + dt_t * sum_n B_t * g_t
    ddelta  = ddt * sigmoid(delta + delta_bias)      (if softplus; else ddt)

where dy = dout * silu(z). The reverse scan needs h_{t-1} and h_t at every step.
Storing them all would be the (batch, d_inner, L, N) tensor this kernel exists to
avoid, so the backward goes over the chunks from last to first, recomputes the
chunk's states and decays a_t forward from its saved checkpoint into chunk-local
buffers (a few CHUNK x N arrays per thread), runs the reverse scan over the chunk
into another such buffer (G) and then the local-in-time gradients. Recomputing
costs one more forward pass of arithmetic and saves L / CHUNK times the memory
(and the memory traffic, which on a CPU would otherwise bound both passes).

Work distribution. Each parallel pass runs one `prange` iteration per thread, and
the threads take work items from a shared atomic counter (`_take`) until none are
left, instead of getting a fixed share each: on a machine where another process
holds one of the cores, the thread that runs does the work instead of the pass
waiting for the share of the thread that does not. Which thread computes an item
never changes what the item computes or where it writes.

Determinism. No atomics in the arithmetic (the counter above only hands out work
items) and no data-dependent summation order. The backward is parallel over
(batch, channel block): a fixed partition of the channels into blocks that
depends on the shapes only (not on the thread count). One item owns all the
channels of its block for one sequence, so it can accumulate dB and
dC for the block over its channels in order into its own (L, N) partial, and dA,
dD, ddelta_bias into per-(batch, channel) partials. A second parallel pass sums
the partials in a fixed order. The same inputs therefore give bit-identical
gradients, whatever the number of threads.

Precision. float32 arithmetic for float16 / bfloat16 / float32 inputs (numba has
no bfloat16: the torch glue converts to contiguous float32 numpy arrays), float64
for float64 inputs, so `torch.autograd.gradcheck` runs through the fused backward.
In float32, exp and softplus are vectorizable polynomial versions (< 1 ulp, see
below) instead of libm calls. The kernels are compiled for both dtypes (lazily,
on first use) and cached on disk (`cache=True`, NUMBA_CACHE_DIR is honoured).
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from sonata.kernels.reference import compute_dtype

# Time steps between saved states. The backward's per-thread scratch is about
# 3 * CHUNK * N floats (states, decays, adjoints): 12 KiB at N = 16.
CHUNK = 64
# Target number of (batch, channel block) work items in the backward. The channel
# partition depends only on the shapes, so results do not depend on the threads;
# the dB / dC partials are (batch, n_blocks, L, N) with n_blocks <= ceil(64 / batch).
WORK_ITEMS = 64

# error_model="numpy": float division by zero gives inf/nan instead of a Python
# exception, whose check would also block vectorization.
_jit = dict(cache=True, nogil=True, error_model="numpy")
# The kernels' loops over the N state entries may reassociate their sums and fuse
# multiply-adds, so that they vectorize (AVX2 / AVX-512). The order is fixed at
# compile time: results stay bit-identical from call to call. No 'nnan'/'ninf':
# NaNs and infinities propagate as in the reference.
_vec = dict(_jit, fastmath={"reassoc", "contract"})
# Helpers are inlined into the kernels by numba (a call per time step would pass
# every array argument's fields on the stack, and block vectorization); they then
# compile with the kernel's fastmath flags.
_inline = dict(inline="always")


# --------------------------------------------------------------------------- exp

# float32 exp that LLVM can vectorize (libm's expf is a scalar call; numba has no
# SVML here): Cody-Waite range reduction x = k ln2 + r, |r| <= ln2/2, a degree-7
# polynomial (Cephes expf), scaling by 2**k built from the exponent bits.
# Max error < 1 ulp over the normal range; results below 2**-126 (x < -87.34),
# which libm returns as subnormals, are flushed to 0. float64 uses math.exp.
_F = np.float32
_LOG2E, _LN2_HI, _LN2_LO = _F(1.44269504088896341), _F(0.693359375), _F(-2.12194440e-4)
_P0, _P1, _P2 = _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3)
_P3, _P4, _P5 = _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1)
_EXP_LO, _EXP_HI = _F(-87.336), _F(88.73)
_ZERO, _HALF, _ONE, _INF = _F(0.0), _F(0.5), _F(1.0), _F(np.inf)


@intrinsic
def _pow2_f32(typingctx, k):
    """2**k as float32 for an integral float32 k in [-126, 127], from the exponent bits."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127)),
                           ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return sig, codegen


@njit(**_jit)   # inlined by LLVM, keeping its own (strict) float semantics
def _exp_f32(x):
    x_lo = x if x > _EXP_LO else _EXP_LO          # NaN -> _EXP_LO, fixed up at the end
    xc = x_lo if x_lo < _EXP_HI else _EXP_HI
    k = np.floor(xc * _LOG2E + _HALF)             # in [-126, 128]
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    e_r = (p * r) * r + r + _ONE                  # exp(r)
    # 2**128 is no float32: scale by 2 * 2**(k-1) when k > 0
    res = (e_r + e_r) * _pow2_f32(k - _ONE) if k > _ZERO else e_r * _pow2_f32(k)
    return _ZERO if x < _EXP_LO else (_INF if x > _EXP_HI else (res if x == x else x))


def _exp(x):
    return math.exp(x)


@overload(_exp, **_inline)
def _exp_overload(x):
    if x == types.float32:
        return lambda x: _exp_f32(x)
    return lambda x: math.exp(x)


# --------------------------------------------------------------------------- work queue

@intrinsic
def _take(typingctx, counter):
    """Atomically counter[0] += 1, returning the old value: the next work item to take.
    counter is a 1-d int64 array. Only hands out work items: no result depends on it."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None
    sig = types.int64(counter)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return sig, codegen


# --------------------------------------------------------------------------- softplus, sigmoid

# softplus(x) = max(x, 0) + log1p(w), w = exp(-|x|) in (0, 1], with
# log1p(w) = 2 atanh(s) = 2 (s + s^3/3 + ... + s^15/15), s = w / (2 + w) <= 1/3
# (truncation error < 2e-9 relative): vectorizable, unlike libm's log1pf, and
# computed inside the kernel so that the result does not depend on how torch
# would split an elementwise op over its threads. x > 20 returns x (torch's threshold).
_TWO, _TWENTY = _F(2.0), _F(20.0)
_Q15, _Q13, _Q11, _Q9 = _F(1 / 15), _F(1 / 13), _F(1 / 11), _F(1 / 9)
_Q7, _Q5, _Q3 = _F(1 / 7), _F(1 / 5), _F(1 / 3)


@njit(**_inline)
def _softplus_f32(x):
    w = _exp_f32(-abs(x))
    s = w / (_TWO + w)
    s2 = s * s
    p = ((((((_Q15 * s2 + _Q13) * s2 + _Q11) * s2 + _Q9) * s2 + _Q7) * s2 + _Q5) * s2
         + _Q3) * s2 + _ONE
    res = max(x, _ZERO) + (s + s) * p
    return x if (x > _TWENTY or x != x) else res


def _softplus(x):
    return x if x > 20 else math.log1p(math.exp(x))


@overload(_softplus, **_inline)
def _softplus_overload(x):
    if x == types.float32:
        return lambda x: _softplus_f32(x)
    return lambda x: x if x > 20 else math.log1p(math.exp(x))


@njit(**_inline)
def _sigmoid(x, one):
    # `one` is 1 in x's dtype: a bare literal would promote float32 arithmetic to float64
    return one / (one + _exp(-x))


@njit(**_inline)
def _chunk_inputs(delta_c, bias, softplus, z_c, has_z, T, dtbuf, szbuf, dspbuf, want_dsp):
    """Per-step scalars of one channel over a chunk, vectorized over time:
    dtbuf[i] = softplus(delta_c[i] + bias) (or delta_c[i] + bias); szbuf[i] = sigmoid(z_c[i])
    if has_z; dspbuf[i] = softplus'(delta_c[i] + bias) if want_dsp and softplus."""
    one = delta_c.dtype.type(1)
    if softplus:
        for i in range(T):
            dtbuf[i] = _softplus(delta_c[i] + bias)
        if want_dsp:
            for i in range(T):
                x = delta_c[i] + bias
                dspbuf[i] = one if x > 20 else _sigmoid(x, one)
    else:
        for i in range(T):
            dtbuf[i] = delta_c[i] + bias
    if has_z:
        for i in range(T):
            szbuf[i] = _sigmoid(z_c[i], one)


# --------------------------------------------------------------------------- forward
# Kernels take views of one (sequence, channel) row and one chunk of time once per
# chunk, and index them with loop counters: a view per time step would cost a
# reference-count round trip, and indices known to be non-negative let LLVM drop
# numba's negative-index wraparound and vectorize.

@njit(parallel=True, **_vec)
def _forward_kernel(u, delta, A, Bt, Ct, D, z, delta_bias, softplus, has_z, chunk, n_workers,
                    out, last_state, ckpt):
    # u, delta, z: (batch, dim, L)   A: (dim, N)   Bt, Ct: (batch, L, N)   D, delta_bias: (dim,)
    # out: (batch, dim, L)   last_state: (batch, dim, N)   ckpt: (batch, dim, n_chunks, N)
    batch, dim, L = u.shape
    N = A.shape[1]
    n_items = batch * dim                       # one (sequence, channel) each
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        dtbuf = np.empty(chunk, dtype=u.dtype)
        szbuf = np.empty(chunk, dtype=u.dtype)
        bd = _take(queue)
        while bd < n_items:
            b = bd // dim
            d = bd - b * dim
            A_d = A[d]
            D_d = D[d]
            h = last_state[b, d]                      # the running state, (N,)
            h[:] = 0
            for c in range(ckpt.shape[2]):
                ckpt[b, d, c] = h
                t0 = c * chunk
                t1 = min(L, t0 + chunk)
                T = t1 - t0
                u_c, out_c = u[b, d, t0:t1], out[b, d, t0:t1]
                B_c, C_c = Bt[b, t0:t1], Ct[b, t0:t1]                       # (T, N)
                z_c = z[b, d, t0:t1] if has_z else z[0, 0, 0:0]
                _chunk_inputs(delta[b, d, t0:t1], delta_bias[d], softplus, z_c, has_z, T,
                              dtbuf, szbuf, dtbuf, False)
                for i in range(T):
                    dtu = dtbuf[i] * u_c[i]
                    y = h.dtype.type(0)
                    for n in range(N):
                        h_n = _exp(dtbuf[i] * A_d[n]) * h[n] + dtu * B_c[i, n]
                        h[n] = h_n
                        y += C_c[i, n] * h_n
                    out_c[i] = y + D_d * u_c[i]
                if has_z:
                    for i in range(T):
                        out_c[i] = out_c[i] * (z_c[i] * szbuf[i])
            bd = _take(queue)


# --------------------------------------------------------------------------- backward
# Per chunk, the backward runs a few simple loops over (time step, state entry)
# rather than one loop doing everything per step: LLVM guards a vectorized loop
# with a run-time overlap check for every pair of arrays it writes and touches,
# and with N = 16 those checks, paid once per time step, would cost more than the
# arithmetic. Each inner loop below writes one or two arrays.

@njit(**_inline)
def _recompute_chunk(hbuf, abuf, ybuf, A_d, dtbuf, u_c, D_d, B_c, C_c, T):
    """States from the checkpoint in hbuf[0]: hbuf[i + 1] = h_{t0+i}, abuf[i] = a_{t0+i} =
    exp(dt A), ybuf[i] = C . h + D u (before the gate).   hbuf: (chunk+1, N), abuf: (chunk, N)"""
    N = A_d.shape[0]
    for i in range(T):
        dt = dtbuf[i]
        for n in range(N):
            abuf[i, n] = _exp(dt * A_d[n])
    for i in range(T):
        dtu = dtbuf[i] * u_c[i]
        y = hbuf.dtype.type(0)
        for n in range(N):
            h_n = abuf[i, n] * hbuf[i, n] + dtu * B_c[i, n]
            hbuf[i + 1, n] = h_n
            y += C_c[i, n] * h_n
        ybuf[i] = y + D_d * u_c[i]


@njit(**_inline)
def _adjoint_chunk(G, g, abuf, C_c, dybuf, T):
    """The reverse scan over one chunk: G[i] = dLoss/dh_{t0+i}, for i = T-1 .. 0,
    G[i] = C_i dy_i + a_{i+1} G[i + 1], starting from the carry g that later chunks
    (and dlast) sent to h_{t0+T-1}. Leaves in g the carry a_0 G[0] for the previous
    chunk.   G, abuf, C_c: (chunk, N); g: (N,); dybuf: (chunk,)"""
    N = g.shape[0]
    for n in range(N):
        G[T - 1, n] = C_c[T - 1, n] * dybuf[T - 1] + g[n]
    for i in range(T - 2, -1, -1):
        dy = dybuf[i]
        for n in range(N):
            G[i, n] = C_c[i, n] * dy + abuf[i + 1, n] * G[i + 1, n]
    for n in range(N):
        g[n] = abuf[0, n] * G[0, n]


@njit(**_vec)
def _channel_backward(b, d, dout, dlast, u, delta, A, Bt, Ct, D, z, delta_bias, softplus,
                      has_z, chunk, ckpt, hbuf, abuf, G, vbuf, g, dA,
                      du, ddelta, dz, dB_blk, dC_blk):
    """Backward of one (batch b, channel d) over all chunks, last to first.

    Scratch: hbuf (chunk + 1, N), abuf, G (chunk, N), vbuf (5, chunk), g (N,).
    Writes du, ddelta, dz[b, d] (L,) and dA (N,); adds into the block partials
    dB_blk, dC_blk (L, N); returns the (dD, ddelta_bias) partials of this channel.
    """
    L = u.shape[2]
    N = A.shape[1]
    one = u.dtype.type(1)
    A_d = A[d]
    D_d = D[d]
    dtbuf, szbuf, dspbuf, ybuf, dybuf = vbuf[0], vbuf[1], vbuf[2], vbuf[3], vbuf[4]
    dA[:] = 0
    g[:] = dlast[b, d]
    dD_acc = u.dtype.type(0)
    ddb_acc = u.dtype.type(0)
    for c in range(ckpt.shape[2] - 1, -1, -1):
        t0 = c * chunk
        t1 = min(L, t0 + chunk)
        T = t1 - t0
        u_c, dout_c = u[b, d, t0:t1], dout[b, d, t0:t1]
        du_c, ddelta_c = du[b, d, t0:t1], ddelta[b, d, t0:t1]
        z_c = z[b, d, t0:t1] if has_z else z[0, 0, 0:0]
        dz_c = dz[b, d, t0:t1] if has_z else dz[0, 0, 0:0]
        B_c, C_c = Bt[b, t0:t1], Ct[b, t0:t1]
        dB_c, dC_c = dB_blk[t0:t1], dC_blk[t0:t1]
        _chunk_inputs(delta[b, d, t0:t1], delta_bias[d], softplus, z_c, has_z, T,
                      dtbuf, szbuf, dspbuf, True)
        hbuf[0] = ckpt[b, d, c]
        _recompute_chunk(hbuf, abuf, ybuf, A_d, dtbuf, u_c, D_d, B_c, C_c, T)
        # through the gate: dy = dout * silu(z), dz = dout * y * silu'(z)
        if has_z:
            for i in range(T):
                s = szbuf[i]
                dz_c[i] = dout_c[i] * ybuf[i] * (s * (one + z_c[i] * (one - s)))
                dybuf[i] = dout_c[i] * (z_c[i] * s)
        else:
            for i in range(T):
                dybuf[i] = dout_c[i]
        _adjoint_chunk(G, g, abuf, C_c, dybuf, T)
        # dB_t += dt_t u_t G_t and dC_t += dy_t h_t, summed over the block's channels
        for i in range(T):
            dtu = dtbuf[i] * u_c[i]
            for n in range(N):
                dB_c[i, n] += dtu * G[i, n]
        for i in range(T):
            dy = dybuf[i]
            for n in range(N):
                dC_c[i, n] += dy * hbuf[i + 1, n]
        # with q = G a h_prev:  dA += dt q,  ddt = sum_n A q + u sum_n B G
        for i in range(T):
            dt = dtbuf[i]
            s_bg = u.dtype.type(0)
            s_aq = u.dtype.type(0)
            for n in range(N):
                g_n = G[i, n]
                s_bg += B_c[i, n] * g_n
                q = g_n * abuf[i, n] * hbuf[i, n]
                s_aq += A_d[n] * q
                dA[n] += dt * q
            dy = dybuf[i]
            du_c[i] = D_d * dy + dt * s_bg
            dD_acc += dy * u_c[i]
            ddt = s_aq + u_c[i] * s_bg
            if softplus:
                ddt = ddt * dspbuf[i]
            ddelta_c[i] = ddt
            ddb_acc += ddt
    return dD_acc, ddb_acc


@njit(parallel=True, **_jit)
def _reduce_partials(dA_part, dD_part, ddb_part, dB_part, dC_part, n_workers,
                     dA, dD, ddb, dB, dC):
    """Sum the partials in a fixed order.
    dA_part (batch, dim, N) -> dA (dim, N); dD_part, ddb_part (batch, dim) -> (dim,);
    dB_part, dC_part (batch, n_blocks, L, N) -> dB, dC (batch, N, L)."""
    batch, dim, N = dA_part.shape
    n_blocks, L = dB_part.shape[1], dB_part.shape[2]
    n_items = dim + batch * N            # a channel of dA, dD, ddb; or a (b, n) row of dB, dC
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        item = _take(queue)
        while item < n_items:
            if item < dim:
                d = item
                for n in range(N):
                    acc = dA_part[0, d, n]
                    for b in range(1, batch):
                        acc += dA_part[b, d, n]
                    dA[d, n] = acc
                acc_D = dD_part[0, d]
                acc_b = ddb_part[0, d]
                for b in range(1, batch):
                    acc_D += dD_part[b, d]
                    acc_b += ddb_part[b, d]
                dD[d] = acc_D
                ddb[d] = acc_b
            else:
                b = (item - dim) // N
                n = item - dim - b * N
                for t in range(L):
                    acc_B = dB_part[b, 0, t, n]
                    acc_C = dC_part[b, 0, t, n]
                    for k in range(1, n_blocks):
                        acc_B += dB_part[b, k, t, n]
                        acc_C += dC_part[b, k, t, n]
                    dB[b, n, t] = acc_B
                    dC[b, n, t] = acc_C
            item = _take(queue)


@njit(parallel=True, **_jit)
def _backward_kernel(dout, dlast, u, delta, A, Bt, Ct, D, z, delta_bias, softplus, has_z,
                     chunk, ckpt, n_blocks, n_workers,
                     du, ddelta, dz, dA, dB, dC, dD, ddb):
    # dout, u, delta, z, du, ddelta, dz: (batch, dim, L)   dlast: (batch, dim, N)
    # A, dA: (dim, N)   Bt, Ct: (batch, L, N)   dB, dC: (batch, N, L)
    # D, delta_bias, dD, ddb: (dim,)   ckpt: (batch, dim, n_chunks, N)
    batch, dim, L = u.shape
    N = A.shape[1]
    dA_part = np.empty((batch, dim, N), dtype=u.dtype)
    dD_part = np.empty((batch, dim), dtype=u.dtype)
    ddb_part = np.empty((batch, dim), dtype=u.dtype)
    dB_part = np.empty((batch, n_blocks, L, N), dtype=u.dtype)
    dC_part = np.empty((batch, n_blocks, L, N), dtype=u.dtype)
    n_items = batch * n_blocks                  # one (sequence, channel block) each
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        hbuf = np.empty((chunk + 1, N), dtype=u.dtype)
        abuf = np.empty((chunk, N), dtype=u.dtype)
        G = np.empty((chunk, N), dtype=u.dtype)
        vbuf = np.empty((5, chunk), dtype=u.dtype)
        g = np.empty(N, dtype=u.dtype)
        item = _take(queue)
        while item < n_items:
            b = item // n_blocks
            k = item - b * n_blocks
            dB_blk, dC_blk = dB_part[b, k], dC_part[b, k]
            dB_blk[:] = 0
            dC_blk[:] = 0
            for d in range(k * dim // n_blocks, (k + 1) * dim // n_blocks):
                dD_part[b, d], ddb_part[b, d] = _channel_backward(
                    b, d, dout, dlast, u, delta, A, Bt, Ct, D, z, delta_bias, softplus, has_z,
                    chunk, ckpt, hbuf, abuf, G, vbuf, g, dA_part[b, d], du, ddelta, dz,
                    dB_blk, dC_blk)
            item = _take(queue)
    _reduce_partials(dA_part, dD_part, ddb_part, dB_part, dC_part, n_workers,
                     dA, dD, ddb, dB, dC)


# --------------------------------------------------------------------------- torch glue

def _set_threads() -> int:
    """Use torch's thread count (at most numba's): -> the number of workers."""
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


def _np(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """A C-contiguous numpy array of `t` in dtype `ct`; no copy when `t` already is one."""
    return t.detach().to(ct).contiguous().numpy()


def _transposed(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """(batch, N, L) -> contiguous (batch, L, N): the kernels' inner loop over n is contiguous."""
    return t.detach().to(ct).transpose(1, 2).contiguous().numpy()


def _optional(t, ct, shape):
    """Array for an optional input: the tensor's data, or zeros / a dummy when it is None."""
    if t is None:
        return np.zeros(shape, dtype=np.float64 if ct == torch.float64 else np.float32)
    return _np(t, ct)


def _n_blocks(batch: int, dim: int) -> int:
    return max(1, min(dim, -(-WORK_ITEMS // max(batch, 1))))


def forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """-> (out (batch, dim, L) in u's dtype, last_state (batch, dim, N) in the compute dtype,
    saved = (checkpoints (batch, dim, n_chunks, N), chunk length as a 0-d tensor))"""
    n_workers = _set_threads()
    ct = compute_dtype(u.dtype)
    batch, dim, L = u.shape
    N = A.shape[1]
    chunk = CHUNK
    n_chunks = -(-L // chunk)
    out = torch.empty((batch, dim, L), dtype=ct)
    last_state = torch.empty((batch, dim, N), dtype=ct)
    ckpt = torch.empty((batch, dim, n_chunks, N), dtype=ct)
    _forward_kernel(_np(u, ct), _np(delta, ct), _np(A, ct), _transposed(B, ct),
                    _transposed(C, ct), _optional(D, ct, (dim,)), _optional(z, ct, (1, 1, 1)),
                    _optional(delta_bias, ct, (dim,)), bool(delta_softplus), z is not None, chunk,
                    n_workers, out.numpy(), last_state.numpy(), ckpt.numpy())
    return out.to(u.dtype), last_state, (ckpt, torch.tensor(chunk))


def backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, saved):
    """-> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias), each in its input's dtype
    (None for a None input among D, z, delta_bias)."""
    n_workers = _set_threads()
    ckpt, chunk = saved
    ct = compute_dtype(u.dtype)
    batch, dim, L = u.shape
    N = A.shape[1]
    du = torch.empty((batch, dim, L), dtype=ct)
    ddelta = torch.empty((batch, dim, L), dtype=ct)
    dz = torch.empty((batch, dim, L) if z is not None else (1, 1, 1), dtype=ct)
    dA = torch.empty((dim, N), dtype=ct)
    dB = torch.empty((batch, N, L), dtype=ct)
    dC = torch.empty((batch, N, L), dtype=ct)
    dD = torch.empty((dim,), dtype=ct)
    ddb = torch.empty((dim,), dtype=ct)
    _backward_kernel(_optional(dout, ct, (batch, dim, L)), _optional(dlast, ct, (batch, dim, N)),
                     _np(u, ct), _np(delta, ct), _np(A, ct), _transposed(B, ct),
                     _transposed(C, ct), _optional(D, ct, (dim,)), _optional(z, ct, (1, 1, 1)),
                     _optional(delta_bias, ct, (dim,)), bool(delta_softplus), z is not None,
                     int(chunk), _np(ckpt, ct), _n_blocks(batch, dim), n_workers,
                     du.numpy(), ddelta.numpy(), dz.numpy(), dA.numpy(), dB.numpy(), dC.numpy(),
                     dD.numpy(), ddb.numpy())
    return (du.to(u.dtype), ddelta.to(delta.dtype), dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype),
            None if D is None else dD.to(D.dtype),
            None if z is None else dz.to(z.dtype),
            None if delta_bias is None else ddb.to(delta_bias.dtype))
