"""Fused numba CPU kernels for the selective scan: forward and hand-written backward.

Semantics are exactly those of `selective_scan_ref` (sonata/kernels/reference.py):

    dt_t = softplus(delta_t + delta_bias)   (bias and softplus optional)
    a_t  = exp(dt_t * A)                                  # (N,) per channel
    h_t  = a_t * h_{t-1} + dt_t * u_t * B_t               # h_{-1} = 0
    y_t  = C_t . h_t + D * u_t
    out  = y * silu(z)                                    (z optional)

Forward. One numba call, parallel over (batch, channel) with `prange`: each
iteration owns one channel of one sequence, keeps its state h (N floats) in a
small local array and walks the L time steps, computing exp(dt_t * A) on the
fly. Nothing of size (batch, d_inner, L, N) is ever stored: besides `out` and the
last state it saves one state per chunk of CHUNK time steps (the state at the
start of the chunk), shape (batch, d_inner, n_chunks, N).

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
chunk's states (and decays a_t) forward from its saved checkpoint into a
chunk-local buffer of (CHUNK + 1) * N floats per thread, then runs the reverse
scan over the chunk. Recomputing costs one more forward pass of arithmetic and
saves L / CHUNK times the memory (and the memory traffic, which on a CPU is what
the forward would otherwise be bound by).

Determinism. No atomics and no data-dependent summation order. The backward is
parallel over (batch, channel block): a fixed partition of the channels into
blocks that depends on the shapes only (not on the thread count). One iteration
owns all the channels of its block for one sequence, so it can accumulate dB and
dC for the block over its channels in order into its own (L, N) partial, and dA,
dD, ddelta_bias into per-(batch, channel) partials. A second parallel pass sums
the partials in a fixed order. The same inputs therefore give bit-identical
gradients, whatever the number of threads.

Precision. float32 arithmetic for float16 / bfloat16 / float32 inputs (numba has
no bfloat16: the torch glue converts to contiguous float32 numpy arrays), float64
for float64 inputs, so `torch.autograd.gradcheck` runs through the fused backward.
The kernels are compiled for both (lazily, once) and cached on disk (`cache=True`).
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

# Time steps between saved states. The backward's per-thread buffer is
# (CHUNK + 1) * N floats for h plus CHUNK * N for the decays: 8.5 KiB at N = 16.
CHUNK = 64
# Target number of (batch, channel block) work items in the backward; the channel
# partition depends only on shapes so that results do not depend on the threads.
WORK_ITEMS = 64

_jit = dict(cache=True, nogil=True)
# The per-step loops over the N state entries may reassociate their two sums and
# fuse multiply-adds, so that they vectorize. The order is fixed at compile time:
# results stay bit-identical from call to call. No 'nnan'/'ninf': NaNs propagate.
_vec = dict(_jit, fastmath={"reassoc", "contract"})


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


@njit(**_jit)
def _exp_f32(x):
    xc = x
    if not (xc > _EXP_LO):                         # also maps NaN to something finite
        xc = _EXP_LO
    if xc > _EXP_HI:
        xc = _EXP_HI
    k = np.floor(xc * _LOG2E + _HALF)              # in [-126, 128]
    r = xc - k * _LN2_HI
    r = r - k * _LN2_LO
    p = _P0
    p = p * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = (p * r) * r + r + _ONE                     # exp(r)
    if k > _ZERO:                                  # 2**128 has no float32: scale by 2 * 2**(k-1)
        res = (p + p) * _pow2_f32(k - _ONE)
    else:
        res = p * _pow2_f32(k)
    if x < _EXP_LO:
        res = _ZERO
    if x > _EXP_HI:
        res = _INF
    if x != x:
        res = x
    return res


def _exp(x):
    return math.exp(x)


@overload(_exp)
def _exp_overload(x):
    if x == types.float32:
        return lambda x: _exp_f32(x)
    return lambda x: math.exp(x)


# --------------------------------------------------------------------------- scalar helpers

@njit(**_jit)
def _softplus(x):
    # torch.nn.functional.softplus with beta=1, threshold=20
    if x > 20:
        return x
    return math.log1p(math.exp(x))


@njit(**_jit)
def _sigmoid(x, one):
    # `one` is 1 in x's dtype: a bare literal would promote float32 arithmetic to float64
    return one / (one + math.exp(-x))


@njit(**_jit)
def _dsoftplus(x, one):
    # derivative of _softplus: sigmoid(x) below the threshold, 1 above
    if x > 20:
        return one
    return _sigmoid(x, one)


@njit(**_jit)
def _delta_at(raw, bias, softplus):
    x = raw + bias
    if softplus:
        return _softplus(x)
    return x


# --------------------------------------------------------------------------- one time step
# The helpers index the full arrays with scalars rather than taking row views:
# a view made per time step costs a reference-count round trip on the array,
# which threads sharing B and C would fight over.

@njit(**_vec)
def _step(h, A, d, dt, dtu, Bt, Ct, b, t):
    """h <- exp(dt * A[d]) * h + dtu * Bt[b, t] in place; returns Ct[b, t] . h.   h: (N,)"""
    y = h.dtype.type(0)
    for n in range(h.shape[0]):
        h_n = _exp(dt * A[d, n]) * h[n] + dtu * Bt[b, t, n]
        h[n] = h_n
        y += Ct[b, t, n] * h_n
    return y


@njit(**_vec)
def _step_record(hbuf, abuf, i, A, d, dt, dtu, Bt, Ct, b, t):
    """_step from hbuf[i] into hbuf[i + 1], keeping the decays exp(dt * A[d]) in abuf[i].
    hbuf: (chunk + 1, N), abuf: (chunk, N)."""
    y = hbuf.dtype.type(0)
    for n in range(hbuf.shape[1]):
        a_n = _exp(dt * A[d, n])
        abuf[i, n] = a_n
        h_n = a_n * hbuf[i, n] + dtu * Bt[b, t, n]
        hbuf[i + 1, n] = h_n
        y += Ct[b, t, n] * h_n
    return y


@njit(**_vec)
def _step_reverse(g, hbuf, abuf, i, A, d, Bt, Ct, b, t, dy, dt, u_t, dA, dB_blk, dC_blk):
    """One step of the reverse scan at time t (row i of the chunk buffers).

    g (N,) holds dLoss/dh_t less its C_t * dy_t part on entry and dLoss/dh_{t-1} on
    exit. Adds into dA (N,) and the block partials dB_blk, dC_blk (L, N) at row t.
    Returns (sum_n A * q, sum_n B_t * g_t) with q = g_t * a_t * h_{t-1}.
    """
    s_aq = g.dtype.type(0)
    s_bg = g.dtype.type(0)
    dtu = dt * u_t
    for n in range(g.shape[0]):
        g_n = g[n] + Ct[b, t, n] * dy
        dC_blk[t, n] += dy * hbuf[i + 1, n]
        dB_blk[t, n] += dtu * g_n
        s_bg += Bt[b, t, n] * g_n
        q = g_n * abuf[i, n] * hbuf[i, n]
        s_aq += A[d, n] * q
        dA[n] += dt * q
        g[n] = abuf[i, n] * g_n
    return s_aq, s_bg


# --------------------------------------------------------------------------- forward

@njit(parallel=True, **_jit)
def _forward_kernel(u, delta, A, Bt, Ct, D, z, delta_bias, softplus, has_z, chunk,
                    out, last_state, ckpt):
    # u, delta, z: (batch, dim, L)   A: (dim, N)   Bt, Ct: (batch, L, N)   D, delta_bias: (dim,)
    # out: (batch, dim, L)   last_state: (batch, dim, N)   ckpt: (batch, dim, n_chunks, N)
    batch, dim, L = u.shape
    one = u.dtype.type(1)
    for bd in prange(batch * dim):
        b = bd // dim
        d = bd - b * dim
        h = last_state[b, d]                      # the running state, (N,)
        h[:] = 0
        for t in range(L):
            if t % chunk == 0:
                ckpt[b, d, t // chunk] = h
            dt = _delta_at(delta[b, d, t], delta_bias[d], softplus)
            u_t = u[b, d, t]
            y = _step(h, A, d, dt, dt * u_t, Bt, Ct, b, t) + D[d] * u_t
            if has_z:
                z_t = z[b, d, t]
                y = y * (z_t * _sigmoid(z_t, one))
            out[b, d, t] = y


# --------------------------------------------------------------------------- backward

@njit(**_jit)
def _channel_backward(b, d, dout, dlast, u, delta, A, Bt, Ct, D, z, delta_bias, softplus,
                      has_z, chunk, ckpt, hbuf, abuf, dtbuf, ybuf, g, dA,
                      du, ddelta, dz, dB_blk, dC_blk):
    """Reverse scan of one (batch b, channel d) over all chunks, last to first.

    Scratch: hbuf (chunk + 1, N), abuf (chunk, N), dtbuf, ybuf (chunk,), g (N,).
    Writes du, ddelta, dz[b, d] (L,) and dA (N,); adds into the block partials
    dB_blk, dC_blk (L, N); returns this channel's (dD, ddelta_bias) partials.
    """
    L = u.shape[2]
    one = u.dtype.type(1)
    D_d = D[d]
    bias_d = delta_bias[d]
    dA[:] = 0
    g[:] = dlast[b, d]
    dD_acc = u.dtype.type(0)
    ddb_acc = u.dtype.type(0)
    for c in range(ckpt.shape[2] - 1, -1, -1):
        t0 = c * chunk
        T = min(L - t0, chunk)
        # recompute the chunk: states h_{t0-1 .. t0+T-1} (hbuf rows 0..T), decays, y
        hbuf[0] = ckpt[b, d, c]
        for i in range(T):
            t = t0 + i
            dt = _delta_at(delta[b, d, t], bias_d, softplus)
            dtbuf[i] = dt
            u_t = u[b, d, t]
            ybuf[i] = _step_record(hbuf, abuf, i, A, d, dt, dt * u_t, Bt, Ct, b, t) + D_d * u_t
        # reverse scan over the chunk
        for i in range(T - 1, -1, -1):
            t = t0 + i
            u_t = u[b, d, t]
            dt = dtbuf[i]
            dy = dout[b, d, t]
            if has_z:
                z_t = z[b, d, t]
                s = _sigmoid(z_t, one)
                dz[b, d, t] = dy * ybuf[i] * (s * (one + z_t * (one - s)))
                dy = dy * (z_t * s)
            s_aq, s_bg = _step_reverse(g, hbuf, abuf, i, A, d, Bt, Ct, b, t, dy, dt, u_t,
                                       dA, dB_blk, dC_blk)
            du[b, d, t] = D_d * dy + dt * s_bg
            dD_acc += dy * u_t
            ddt = s_aq + u_t * s_bg
            if softplus:
                ddt = ddt * _dsoftplus(delta[b, d, t] + bias_d, one)
            ddelta[b, d, t] = ddt
            ddb_acc += ddt
    return dD_acc, ddb_acc


@njit(parallel=True, **_jit)
def _reduce_partials(dA_part, dD_part, ddb_part, dB_part, dC_part, dA, dD, ddb, dB, dC):
    """Sum the partials in a fixed order.
    dA_part (batch, dim, N) -> dA (dim, N); dD_part, ddb_part (batch, dim) -> (dim,);
    dB_part, dC_part (batch, n_blocks, L, N) -> dB, dC (batch, N, L)."""
    batch, dim, N = dA_part.shape
    n_blocks, L = dB_part.shape[1], dB_part.shape[2]
    for d in prange(dim):
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
    for bn in prange(batch * N):
        b = bn // N
        n = bn - b * N
        for t in range(L):
            acc_B = dB_part[b, 0, t, n]
            acc_C = dC_part[b, 0, t, n]
            for k in range(1, n_blocks):
                acc_B += dB_part[b, k, t, n]
                acc_C += dC_part[b, k, t, n]
            dB[b, n, t] = acc_B
            dC[b, n, t] = acc_C


@njit(parallel=True, **_jit)
def _backward_kernel(dout, dlast, u, delta, A, Bt, Ct, D, z, delta_bias, softplus, has_z,
                     chunk, ckpt, n_blocks,
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
    for item in prange(batch * n_blocks):         # one (sequence, channel block) each
        b = item // n_blocks
        k = item - b * n_blocks
        hbuf = np.empty((chunk + 1, N), dtype=u.dtype)
        abuf = np.empty((chunk, N), dtype=u.dtype)
        dtbuf = np.empty(chunk, dtype=u.dtype)
        ybuf = np.empty(chunk, dtype=u.dtype)
        g = np.empty(N, dtype=u.dtype)
        dB_blk = dB_part[b, k]
        dC_blk = dC_part[b, k]
        dB_blk[:] = 0
        dC_blk[:] = 0
        for d in range(k * dim // n_blocks, (k + 1) * dim // n_blocks):
            dD_part[b, d], ddb_part[b, d] = _channel_backward(
                b, d, dout, dlast, u, delta, A, Bt, Ct, D, z, delta_bias, softplus, has_z,
                chunk, ckpt, hbuf, abuf, dtbuf, ybuf, g, dA_part[b, d],
                du, ddelta, dz, dB_blk, dC_blk)
    _reduce_partials(dA_part, dD_part, ddb_part, dB_part, dC_part, dA, dD, ddb, dB, dC)


# --------------------------------------------------------------------------- torch glue

def _set_threads() -> None:
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def _np(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """A C-contiguous numpy array of `t` in dtype `ct`; no copy when `t` already is one."""
    return t.detach().to(ct).contiguous().numpy()


def _transposed(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """(batch, N, L) -> contiguous (batch, L, N), so the kernels' inner loop over n is contiguous."""
    return t.detach().to(ct).transpose(1, 2).contiguous().numpy()


def _optional(t, ct, shape):
    """Array for an optional input: the tensor's data, or zeros / a dummy when it is None."""
    if t is None:
        return np.zeros(shape, dtype=torch.empty(0, dtype=ct).numpy().dtype)
    return _np(t, ct)


def _n_blocks(batch: int, dim: int) -> int:
    return max(1, min(dim, -(-WORK_ITEMS // max(batch, 1))))


def forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """-> (out (batch, dim, L) in u's dtype, last_state (batch, dim, N) in the compute dtype,
    saved = (checkpoints (batch, dim, n_chunks, N),))"""
    _set_threads()
    ct = compute_dtype(u.dtype)
    batch, dim, L = u.shape
    N = A.shape[1]
    n_chunks = -(-L // CHUNK)
    out = torch.empty((batch, dim, L), dtype=ct)
    last_state = torch.empty((batch, dim, N), dtype=ct)
    ckpt = torch.empty((batch, dim, n_chunks, N), dtype=ct)
    _forward_kernel(_np(u, ct), _np(delta, ct), _np(A, ct), _transposed(B, ct), _transposed(C, ct),
                    _optional(D, ct, (dim,)), _optional(z, ct, (1, 1, 1)),
                    _optional(delta_bias, ct, (dim,)), bool(delta_softplus), z is not None, CHUNK,
                    out.numpy(), last_state.numpy(), ckpt.numpy())
    return out.to(u.dtype), last_state, (ckpt,)


def backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, saved):
    """-> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias), each in its input's dtype
    (None for a None input among D, z, delta_bias)."""
    _set_threads()
    (ckpt,) = saved
    ct = compute_dtype(u.dtype)
    batch, dim, L = u.shape
    N = A.shape[1]
    dout_np = _optional(dout, ct, (batch, dim, L))
    dlast_np = _optional(dlast, ct, (batch, dim, N))
    du = torch.empty((batch, dim, L), dtype=ct)
    ddelta = torch.empty((batch, dim, L), dtype=ct)
    dz = torch.empty((batch, dim, L) if z is not None else (1, 1, 1), dtype=ct)
    dA = torch.empty((dim, N), dtype=ct)
    dB = torch.empty((batch, N, L), dtype=ct)
    dC = torch.empty((batch, N, L), dtype=ct)
    dD = torch.empty((dim,), dtype=ct)
    ddb = torch.empty((dim,), dtype=ct)
    _backward_kernel(dout_np, dlast_np, _np(u, ct), _np(delta, ct), _np(A, ct),
                     _transposed(B, ct), _transposed(C, ct),
                     _optional(D, ct, (dim,)), _optional(z, ct, (1, 1, 1)),
                     _optional(delta_bias, ct, (dim,)), bool(delta_softplus), z is not None,
                     CHUNK, _np(ckpt, ct), _n_blocks(batch, dim),
                     du.numpy(), ddelta.numpy(), dz.numpy(), dA.numpy(), dB.numpy(), dC.numpy(),
                     dD.numpy(), ddb.numpy())
    return (du.to(u.dtype), ddelta.to(delta.dtype), dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype),
            None if D is None else dD.to(D.dtype),
            None if z is None else dz.to(z.dtype),
            None if delta_bias is None else ddb.to(delta_bias.dtype))
