"""Fused numba CPU kernels for the selective scan: forward and hand-written backward.
(Below the scan, the same module holds the fused kernels around it: the depthwise
convolution + SiLU, RMSNorm and the cross-entropy loss, each with its own comment.)

Semantics are exactly those of `selective_scan_ref` (sonata/kernels/reference.py):

    dt_t = softplus(delta_t + delta_bias)   (bias and softplus optional)
    a_t  = exp(dt_t * A)                                  # (N,) per channel
    h_t  = a_t * h_{t-1} + dt_t * u_t * B_t               # h_{-1} = initial state, or 0
    y_t  = C_t . h_t + D * u_t
    out  = y * silu(z)                                    (z optional)

Layout: channels in lanes. B_t and C_t are shared by all channels of a sequence,
so the kernels work on blocks of W consecutive channels of one sequence (W = 16 with AVX2,
32 with AVX-512: two vector registers, see `W` below) and
keep the state of a block as h[n, w] (N x W): per time step and state entry n,

    h[n, :] = exp(dt_t[:] * A[:, n]) * h[n, :] + (dt_t u_t)[:] * B_t[n]
    y_t[:] += C_t[n] * h[n, :]

is one W-wide vector operation (B_t[n], C_t[n] broadcast), and the sums over n
(y here; s_bg, s_aq below) accumulate lane by lane: no horizontal reductions in
the time loop. exp(dt A) is computed on the fly, W lanes at a time. The block's
inputs u, delta, z, dout ((batch, dim, L), u and dout also time-major (batch, L, dim), the
model's layout, see `_load_block`) are copied chunk by chunk into small
lane-contiguous (chunk, W) buffers, softplus / sigmoid / the gate are computed
there, and results are copied back; a block that runs past the last channel
(dim not a multiple of W) has zeros in the extra lanes (dt = u = dy = 0, so its
state and adjoint stay 0) and its extra lanes are never written out.

Forward. One numba call, parallel over (batch, block) work items: each item walks
the L time steps of its W channels. Nothing of size (batch, d_inner, L, N) is ever
stored: besides `out` and the last state it saves one state per chunk of CHUNK
time steps (the state at the start of the chunk), shape (batch, d_inner, n_chunks, N).

Backward. The adjoint g_t = dLoss/dh_t runs the recurrence backwards (g_t = C_t dy_t +
a_{t+1} g_{t+1}) and every gradient is local in time from g_t, h_{t-1} and h_t: the
derivation and the formulas are written once, in docs/kernels.md ("The scan and its
backward, derived"). The reverse scan needs h_{t-1} and h_t at every step.
Storing them all would be the (batch, d_inner, L, N) tensor this kernel exists to
avoid, so the backward goes over the chunks from last to first, recomputes the
chunk's states and decays a_t forward from its saved checkpoint into chunk-local
buffers ((CHUNK + 1) x N x W floats each, per thread), then runs the reverse scan
over the chunk with all the local-in-time gradients in the same step. dA, du,
ddelta, dD and ddelta_bias accumulate lane-wise; dB_t[n] and dC_t[n] are sums over
the channels, i.e. over the lanes: one reduction per (t, n) and block. Recomputing
costs one more forward pass of arithmetic and saves L / CHUNK times the memory
(and the memory traffic, which on a CPU would otherwise bound both passes).

The delta projection (optional, `delta_proj`). In the model delta is dt_proj's output,
delta_t[d] = sum_r W[d, r] x_t[r] with a small rank R (6 in the seed model). Given the
low-rank input x ((batch, L, R)) and W ((dim, R)) instead of delta, the kernels form each
block's delta lanes as R multiply-adds per step (in the order of r), in the forward and in
the backward's recompute, and send ddelta on instead of storing it: dW[d, r] += ddt_t[d]
x_t[r] lane-wise (per-(batch, channel) partials, summed over the batch in order like dA), and
dx_t[r] = sum_d W[d, r] ddt_t[d], a lane reduction per (t, r) and block into per-(batch,
group) partials summed like dB and dC. No (batch, dim, L) delta is ever stored or transposed,
and the matmuls of the projection (three per layer and step, with K or N = R: slow shapes)
are gone. Measured at the seed model's size: dt_proj's three matmuls and two transposed
copies per layer gone from the step's profile, the step 2-3% faster.

Work distribution. Each parallel pass runs one `prange` iteration per thread, and
the threads take work items from a shared atomic counter (`_take`) until none are
left, instead of getting a fixed share each: on a machine where another process
holds one of the cores, the thread that runs does the work instead of the pass
waiting for the share of the thread that does not. Which thread computes an item
never changes what the item computes or where it writes.

Determinism. No atomics in the arithmetic (the counter above only hands out work
items) and no data-dependent summation order. The backward is parallel over
(batch, group of blocks): a fixed partition of the channel blocks into groups that
depends on the shapes only (not on the thread count). One item owns all the
channels of its group for one sequence, so it can accumulate dB and dC over its
blocks in order into its own (L, N) partial, and dA, dD, ddelta_bias into
per-(batch, channel) partials. A second parallel pass sums the partials in a fixed
order. The lane reductions have a fixed (compile-time) order too. The same inputs
therefore give bit-identical gradients, whatever the number of threads.
What is exact, and what is not: with one build of the kernels (one lane width W on one
host), outputs and gradients are bit-identical on repeat, for any thread count and for
either input layout (contiguous, or the model's time-major views and B / C as slices of a
wider tensor: layouts change only the copies into the lane buffers). Each thread's scratch
(numba hoists the np.empty calls out of the prange body, once per thread, not shared) is
written before it is read for every work item. Across lane widths (16 or 32:
SONATA_CPU_LANES, or an AVX2 against an AVX-512 host) the lane reductions of dB, dC and the
delta projection's dX sum in another order, and codegen may fuse other multiply-adds: equal
to float32 rounding, checked against the float64 reference, not bit for bit.

Precision. float32 arithmetic for float16 / bfloat16 / float32 inputs (numba has
no bfloat16: the torch glue converts to contiguous float32 numpy arrays), float64
for float64 inputs, so `torch.autograd.gradcheck` runs through the fused backward.
In float32, exp and softplus are vectorizable polynomial versions (< 1 ulp, see
below) instead of libm calls. The kernels are compiled for both dtypes (lazily,
on first use) and cached on disk (`cache=True`, NUMBA_CACHE_DIR is honoured), the cache
keyed by every source of this folder (`numba_cache`: an edit here reaches decode_cpu's kernels).
"""
from __future__ import annotations

import math
import os
import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from llvmlite.binding import get_host_cpu_features
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from sonata.kernels import numba_cache
from sonata.kernels.reference import compute_dtype

numba_cache.install()      # before any @njit(cache=True): the cache is keyed by all kernel sources

# Time steps between saved states. The backward's per-thread scratch is about
# 2 * CHUNK * N * W floats (states and decays of a block): 256 KiB at N = 16 and W = 16,
# 512 KiB at W = 32 (AVX-512 hosts; the one measured has 1 MiB of L2 per core), in L2.
# Longer chunks spread the per-chunk costs (copies in and out of the lane buffers).
CHUNK = 128

LANES_OVERRIDE = os.environ.get("SONATA_CPU_LANES", "")


def _vector_bits() -> int:
    """Width of the vector registers numba compiles for: 512 with AVX-512, else 256 (AVX2;
    narrower machines just run the same loops in more pieces). The host's, unless numba is
    told to compile for another CPU (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        features = numba.config.CPU_FEATURES or ""
    else:
        features = get_host_cpu_features().flatten()
    return 512 if "+avx512f" in features.split(",") else 256


def _lanes_setting(default: int) -> int:
    """SONATA_CPU_LANES (16 or 32) overrides the scan's lanes, e.g. to test or measure the
    other width on one machine. The kernels then compile in the process and skip the disk
    cache (numba's cache does not key on a module constant: it would hand back the kernels of
    the machine's default width, or keep these for later processes)."""
    value = LANES_OVERRIDE
    if value == "":
        return default
    if value not in ("16", "32"):     # an ImportError: the dispatcher names it as a fallback's reason
        raise ImportError(f"SONATA_CPU_LANES={value!r}: use 16 or 32 (or leave it unset)")
    return int(value)


# Channels per block of the scan kernels: the lanes of their vector loops, two vector
# registers of float32 (16 with AVX2, 32 with AVX-512). Per (time step, state) the kernels
# also broadcast B and C, run the loop and, in the backward, reduce dB and dC over the lanes;
# two registers per row spread that over twice the channels of one. Measured on an AVX-512
# host, 32 lanes against 16: the training step 1.05-1.08x at micro-batch 8 and 1.05x at 32
# (64 lanes: 1.00x). A work item is one block of W channels of one sequence; the partition
# depends only on the shapes (and W), so results do not depend on the threads.
W = _lanes_setting(32 if _vector_bits() == 512 else 16)
# The lanes of the conv and loss kernels: 16 on every machine (the conv measured slower
# with 32).
WC = 16
# Target number of (batch, group of channel blocks) work items in the backward; the dB / dC
# partials are (batch, n_groups, L, N) with n_groups <= ceil(WORK_ITEMS / batch).
WORK_ITEMS = 64

# error_model="numpy": float division by zero gives inf/nan instead of a Python
# exception, whose check would also block vectorization.
_jit = dict(cache=LANES_OVERRIDE == "", nogil=True, error_model="numpy")
# The kernels' loops over the W lanes may reassociate their sums (the lane reductions
# of dB, dC) and fuse multiply-adds, so that they vectorize (AVX2 / AVX-512). The order
# is fixed at compile time: results stay bit-identical from call to call. No 'nnan'/'ninf':
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
# Max error 1.003 ulp over the normal range (tested). Results below 2**-125.4 (x < -86.9), which
# libm returns as tiny normals or subnormals (< 1.9e-38), are flushed to 0; x > 88.72
# overflows to inf as in libm; NaN stays NaN. float64 uses math.exp.
# The clamps let NaN through (comparisons with NaN are false) and keep k in [-125, 128],
# so 2 * 2**(k-1) is one scaling for every k: no branch on the sign of k and no select for
# inf or NaN in the vector code (tests/test_kernels_cpu.py checks it against float64 exp).
_F = np.float32
_LOG2E, _LN2_HI, _LN2_LO = _F(1.44269504088896341), _F(0.693359375), _F(-2.12194440e-4)
_P0, _P1, _P2 = _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3)
_P3, _P4, _P5 = _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1)
_EXP_LO, _EXP_HI = _F(-86.9), _F(89.0)
_ZERO, _HALF, _ONE = _F(0.0), _F(0.5), _F(1.0)


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


# Its own fastmath flags, stated: a callee without them inherits its caller's, and in the
# kernels' 'reassoc' LLVM rewrote (e_r + e_r) * 2**(k-1) as e_r * 2**k, which overflows to inf
# for 88.37 < x <= 88.72. 'contract' (fused multiply-adds) only; inlined by LLVM with these.
@njit(**dict(_jit, fastmath={"contract"}))
def _exp_f32(x):
    xc = _EXP_LO if x < _EXP_LO else x            # NaN passes both clamps
    xc = _EXP_HI if xc > _EXP_HI else xc
    k = np.floor(xc * _LOG2E + _HALF)             # in [-125, 128]
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    e_r = (p * r) * r + r + _ONE                  # exp(r)
    res = (e_r + e_r) * _pow2_f32(k - _ONE)       # 2**128 is no float32; inf past 88.72
    return _ZERO if x < _EXP_LO else res


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
# (truncation error < 2e-9 relative; < 3 ulp in all after float32 rounding, tested):
# vectorizable, unlike libm's log1pf, and computed inside the kernel so that the result
# does not depend on how torch would split an elementwise op over its threads. x > 20
# returns x (torch's threshold).
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


# Moving a block between the (batch, dim, L) tensors and the lane-contiguous (T, W) chunk
# buffers is a transposition. It runs as a plain copy in its own (not inlined) function,
# once per chunk: inlined into a kernel, with arithmetic in the same loop, LLVM vectorized
# it with AVX-512 gathers / scatters, which measured slower. The arithmetic runs on the
# buffers, in loops over the W lanes. An activation reaches the kernels as a C-contiguous
# array, channel-major (batch, dim, L) or time-major (batch, L, dim) (`tm`: the model's own
# layout, read in place, no copy by the glue); u, dout (either), out and du (time-major) move
# between the model's projections and the scan with no transposed copy. A time-major row of a
# full block is W contiguous values: its loop runs over the constant W (over the run-time
# channel count, such loops measured 3.6-4.3x slower; an earlier attempt at time-major
# arrays, written that way, had measured the scan 1.2-1.9x slower than copying).

@njit(**_jit)
def _load_block(x, tm, b, d0, nw, t0, T, buf):
    """buf[i, w] = x[b, d0 + w, t0 + i], or x[b, t0 + i, d0 + w] when `tm` (x time-major:
    (batch, L, dim)); 0 in the lanes w >= nw (past the last channel)."""
    if tm and nw == W:              # rows of W channels: the constant count vectorizes
        for i in range(T):
            for w in range(W):
                buf[i, w] = x[b, t0 + i, d0 + w]
        return
    if tm:
        for i in range(T):
            for w in range(nw):
                buf[i, w] = x[b, t0 + i, d0 + w]
    else:
        for w in range(nw):
            for i in range(T):
                buf[i, w] = x[b, d0 + w, t0 + i]
    for i in range(T):
        for w in range(nw, W):
            buf[i, w] = 0


@njit(**_jit)
def _store_block(buf, x, tm, b, d0, nw, t0, T):
    """x[b, d0 + w, t0 + i] (x[b, t0 + i, d0 + w] when `tm`) = buf[i, w] for the lanes w < nw."""
    if tm and nw == W:
        for i in range(T):
            for w in range(W):
                x[b, t0 + i, d0 + w] = buf[i, w]
    elif tm:
        for i in range(T):
            for w in range(nw):
                x[b, t0 + i, d0 + w] = buf[i, w]
    else:
        for w in range(nw):
            for i in range(T):
                x[b, d0 + w, t0 + i] = buf[i, w]


@njit(**_inline)
def _block_dt(delta, Wb, u, u_tm, delta_bias, softplus, b, d0, nw, t0, T, dtb, ub, dtub, dspb, want_dsp):
    """Per-step lanes of a block over a chunk: dtb = softplus(delta + bias) (or delta + bias),
    ub = u, dtub = dt * u, dspb = softplus'(delta + bias) if want_dsp and softplus.
    With a delta projection (Wb (R, W) with R > 0: the block's rows of dt_proj's weight),
    `delta` is the (batch, L, R) low-rank input and delta = sum_r Wb[r] * delta[b, t, r],
    summed in the order of r; without (R = 0), `delta` is (batch, dim, L).
    dt, u, dt u are 0 in the lanes past the last channel."""
    zero = dtb.dtype.type(0)
    one = dtb.dtype.type(1)
    twenty = dtb.dtype.type(20)
    R = Wb.shape[0]
    if R > 0:
        for i in range(T):
            row = dtb[i]
            for w in range(W):
                row[w] = zero
            for r in range(R):
                x_r = delta[b, t0 + i, r]
                for w in range(W):
                    row[w] += Wb[r, w] * x_r
    else:
        _load_block(delta, False, b, d0, nw, t0, T, dtb)
    _load_block(u, u_tm, b, d0, nw, t0, T, ub)
    bias = dspb[T]                    # a spare row: the block's delta_bias lanes
    for w in range(W):
        bias[w] = delta_bias[d0 + w] if w < nw else zero
    if softplus:
        for i in range(T):
            for w in range(W):
                x = dtb[i, w] + bias[w]
                dt = _softplus(x) if w < nw else zero
                dtb[i, w] = dt
                dtub[i, w] = dt * ub[i, w]
                if want_dsp:
                    dspb[i, w] = one if x > twenty else _sigmoid(x, one)
    else:
        for i in range(T):
            for w in range(W):
                dt = dtb[i, w] + bias[w]
                dtb[i, w] = dt
                dtub[i, w] = dt * ub[i, w]
                if want_dsp:
                    dspb[i, w] = one


@njit(**_inline)
def _block_params(A, D, dtw, d0, nw, Ab, Db, Wb):
    """Ab[n, w] = A[d0 + w, n], Db[w] = D[d0 + w], Wb[r, w] = dtw[d0 + w, r]; 0 past the last
    channel."""
    zero = Ab.dtype.type(0)
    for w in range(W):
        Db[w] = D[d0 + w] if w < nw else zero
    for n in range(Ab.shape[0]):
        for w in range(W):
            Ab[n, w] = A[d0 + w, n] if w < nw else zero
    for r in range(Wb.shape[0]):
        for w in range(W):
            Wb[r, w] = dtw[d0 + w, r] if w < nw else zero


# --------------------------------------------------------------------------- forward

@njit(parallel=True, **_vec)
def _forward_kernel(u, u_tm, delta, dtw, A, Bt, Ct, D, z, delta_bias, softplus, has_z, h0, has_h0,
                    chunk, n_workers, out, last_state, ckpt):
    # u: (batch, dim, L), or time-major (batch, L, dim) when u_tm   z: (batch, dim, L)
    # delta: (batch, dim, L), or (batch, L, R) with dtw (dim, R), R > 0 (the delta projection;
    # dtw (dim, 0) without)   A: (dim, N)   Bt, Ct: (batch, L, N)   D, delta_bias: (dim,)
    # h0: (batch, dim, N), the state before the first step when has_h0 (else zeros)
    # out: time-major (batch, L, dim)   last_state: (batch, dim, N)   ckpt: (batch, dim, n_chunks, N)
    batch, L, N = Bt.shape
    dim = A.shape[0]
    n_blocks = -(-dim // W)
    n_items = batch * n_blocks                  # one (sequence, block of W channels) each
    one = u.dtype.type(1)
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        h = np.empty((N, W), dtype=u.dtype)              # the running state, h[n, w]
        Ab = np.empty((N, W), dtype=u.dtype)
        Db = np.empty(W, dtype=u.dtype)
        Wb = np.empty((dtw.shape[1], W), dtype=u.dtype)
        lanes = np.empty((6, chunk + 1, W), dtype=u.dtype)
        dtb, ub, dtub, yb, zb, spare = lanes[0], lanes[1], lanes[2], lanes[3], lanes[4], lanes[5]
        item = _take(queue)
        while item < n_items:
            b = item // n_blocks
            k = item - b * n_blocks
            d0 = k * W
            nw = min(W, dim - d0)
            _block_params(A, D, dtw, d0, nw, Ab, Db, Wb)
            h[:] = 0
            if has_h0:
                for n in range(N):
                    for w in range(nw):
                        h[n, w] = h0[b, d0 + w, n]
            for c in range(ckpt.shape[2]):
                for w in range(nw):
                    for n in range(N):
                        ckpt[b, d0 + w, c, n] = h[n, w]
                t0 = c * chunk
                t1 = min(L, t0 + chunk)
                T = t1 - t0
                _block_dt(delta, Wb, u, u_tm, delta_bias, softplus, b, d0, nw, t0, T, dtb, ub, dtub,
                          spare, False)
                for i in range(T):
                    y = yb[i]
                    for w in range(W):
                        y[w] = 0
                    for n in range(N):
                        B_n = Bt[b, t0 + i, n]
                        C_n = Ct[b, t0 + i, n]
                        for w in range(W):
                            h_n = _exp(dtb[i, w] * Ab[n, w]) * h[n, w] + dtub[i, w] * B_n
                            h[n, w] = h_n
                            y[w] += C_n * h_n
                if has_z:
                    _load_block(z, False, b, d0, nw, t0, T, zb)
                    for i in range(T):
                        for w in range(W):
                            z_i = zb[i, w]
                            yb[i, w] = (yb[i, w] + Db[w] * ub[i, w]) * (z_i * _sigmoid(z_i, one))
                else:
                    for i in range(T):
                        for w in range(W):
                            yb[i, w] = yb[i, w] + Db[w] * ub[i, w]
                _store_block(yb, out, True, b, d0, nw, t0, T)
            for w in range(nw):
                for n in range(N):
                    last_state[b, d0 + w, n] = h[n, w]
            item = _take(queue)


# --------------------------------------------------------------------------- backward

@njit(parallel=True, **_jit)
def _reduce_partials(dA_part, dD_part, ddb_part, dW_part, dB_part, dC_part, dX_part, chunk,
                     n_workers, dA, dD, ddb, dW, dB, dC, dX):
    """Sum the partials in a fixed order.
    dA_part (batch, dim, N) -> dA (dim, N); dD_part, ddb_part (batch, dim) -> (dim,);
    dW_part (batch, dim, R) -> dW (dim, R); dB_part, dC_part (batch, n_groups, L, N) -> dB,
    dC (batch, N, L); dX_part (batch, n_groups, L, R) -> dX (batch, L, R). R may be 0."""
    batch, dim, N = dA_part.shape
    R = dW_part.shape[2]
    n_groups, L = dB_part.shape[1], dB_part.shape[2]
    n_tiles = -(-L // chunk)
    n_items = dim + batch * n_tiles      # a channel of dA, dD, ddb; or a time tile of dB, dC
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        acc = np.empty((2, N), dtype=dB.dtype)
        acc_B, acc_C = acc[0], acc[1]
        item = _take(queue)
        while item < n_items:
            if item < dim:
                d = item
                for n in range(N):
                    a = dA_part[0, d, n]
                    for b in range(1, batch):
                        a += dA_part[b, d, n]
                    dA[d, n] = a
                for r in range(R):
                    a = dW_part[0, d, r]
                    for b in range(1, batch):
                        a += dW_part[b, d, r]
                    dW[d, r] = a
                a_D = dD_part[0, d]
                a_b = ddb_part[0, d]
                for b in range(1, batch):
                    a_D += dD_part[b, d]
                    a_b += ddb_part[b, d]
                dD[d] = a_D
                ddb[d] = a_b
            else:
                b = (item - dim) // n_tiles
                t0 = (item - dim - b * n_tiles) * chunk
                for t in range(t0, min(L, t0 + chunk)):
                    for n in range(N):
                        acc_B[n] = dB_part[b, 0, t, n]
                        acc_C[n] = dC_part[b, 0, t, n]
                    for k in range(1, n_groups):
                        for n in range(N):
                            acc_B[n] += dB_part[b, k, t, n]
                            acc_C[n] += dC_part[b, k, t, n]
                    for n in range(N):
                        dB[b, n, t] = acc_B[n]
                        dC[b, n, t] = acc_C[n]
                    for r in range(R):
                        a = dX_part[b, 0, t, r]
                        for k in range(1, n_groups):
                            a += dX_part[b, k, t, r]
                        dX[b, t, r] = a
            item = _take(queue)


@njit(parallel=True, **_vec)
def _backward_kernel(dout, dout_tm, dlast, u, u_tm, delta, dtw, A, Bt, Ct, D, z, delta_bias,
                     softplus, has_z, chunk, ckpt, n_groups, n_workers,
                     du, ddelta, dz, dA, dB, dC, dD, ddb, dW, dX, dh0, want_dh0):
    # dout, u: (batch, dim, L), or time-major (batch, L, dim) when dout_tm / u_tm
    # z, dz: (batch, dim, L)   du: time-major (batch, L, dim)   dlast: (batch, dim, N)
    # delta, ddelta: (batch, dim, L); or with the delta projection (dtw (dim, R), R > 0) delta is
    # (batch, L, R), its gradient goes to dX (batch, L, R) and dtw's to dW (dim, R), and
    # ddelta is not written (with R = 0, dX and dW are not written)
    # A, dA: (dim, N)   Bt, Ct: (batch, L, N)   dB, dC: (batch, N, L)
    # D, delta_bias, dD, ddb: (dim,)   ckpt: (batch, dim, n_chunks, N); its first chunk's state
    # is the initial state   dh0: (batch, dim, N), the initial state's gradient, when want_dh0
    batch, L, N = Bt.shape
    dim = A.shape[0]
    R = dtw.shape[1]
    n_blocks = -(-dim // W)
    one = u.dtype.type(1)
    zero = u.dtype.type(0)
    dA_part = np.empty((batch, dim, N), dtype=u.dtype)
    dW_part = np.empty((batch, dim, R), dtype=u.dtype)
    dX_part = np.empty((batch, n_groups, L, R), dtype=u.dtype)
    dD_part = np.empty((batch, dim), dtype=u.dtype)
    ddb_part = np.empty((batch, dim), dtype=u.dtype)
    dB_part = np.empty((batch, n_groups, L, N), dtype=u.dtype)
    dC_part = np.empty((batch, n_groups, L, N), dtype=u.dtype)
    n_items = batch * n_groups                  # one (sequence, group of blocks) each
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        Ab = np.empty((N, W), dtype=u.dtype)
        g = np.empty((N, W), dtype=u.dtype)              # adjoint carry a_{t+1} G_{t+1}
        dAb = np.empty((N, W), dtype=u.dtype)
        Wb = np.empty((R, W), dtype=u.dtype)
        dWb = np.empty((R, W), dtype=u.dtype)
        hb = np.empty((chunk + 1, N, W), dtype=u.dtype)   # hb[i + 1] = h_{t0+i}
        ab = np.empty((chunk, N, W), dtype=u.dtype)       # ab[i] = a_{t0+i}
        lanes = np.empty((9, chunk + 1, W), dtype=u.dtype)
        dtb, ub, dtub, dspb, yb = lanes[0], lanes[1], lanes[2], lanes[3], lanes[4]
        dyb, zb, dub, ddtb = lanes[5], lanes[6], lanes[7], lanes[8]
        # lane accumulators. Codegen is touchy here: s_bg / s_aq as separate arrays, or
        # the y update below made conditional on has_z, measured the backward ~2x slower.
        acc = np.empty((5, W), dtype=u.dtype)
        Db, s_bg, s_aq, dD_acc, ddb_acc = acc[0], acc[1], acc[2], acc[3], acc[4]
        item = _take(queue)
        while item < n_items:
            b = item // n_groups
            k = item - b * n_groups
            dB_blk, dC_blk, dX_blk = dB_part[b, k], dC_part[b, k], dX_part[b, k]
            dB_blk[:] = 0
            dC_blk[:] = 0
            dX_blk[:] = 0
            for blk in range(k * n_blocks // n_groups, (k + 1) * n_blocks // n_groups):
                d0 = blk * W
                nw = min(W, dim - d0)
                _block_params(A, D, dtw, d0, nw, Ab, Db, Wb)
                for w in range(W):
                    dD_acc[w] = 0
                    ddb_acc[w] = 0
                for n in range(N):
                    for w in range(W):
                        g[n, w] = dlast[b, d0 + w, n] if w < nw else zero
                        dAb[n, w] = 0
                dWb[:] = 0
                for c in range(ckpt.shape[2] - 1, -1, -1):
                    t0 = c * chunk
                    t1 = min(L, t0 + chunk)
                    T = t1 - t0
                    _block_dt(delta, Wb, u, u_tm, delta_bias, softplus, b, d0, nw, t0, T, dtb, ub, dtub,
                              dspb, True)
                    # states and decays from the checkpoint: hb[i + 1] = h_{t0+i}, ab[i] = a_{t0+i}
                    h0 = hb[0]
                    for n in range(N):
                        for w in range(W):
                            h0[n, w] = ckpt[b, d0 + w, c, n] if w < nw else zero
                    for i in range(T):
                        y = yb[i]
                        for w in range(W):
                            y[w] = 0
                        h_prev, h_next, a_i = hb[i], hb[i + 1], ab[i]
                        for n in range(N):
                            B_n = Bt[b, t0 + i, n]
                            C_n = Ct[b, t0 + i, n]
                            for w in range(W):
                                a = _exp(dtb[i, w] * Ab[n, w])
                                a_i[n, w] = a
                                h_n = a * h_prev[n, w] + dtub[i, w] * B_n
                                h_next[n, w] = h_n
                                y[w] += C_n * h_n
                    # through the gate: dy = dout * silu(z), dz = dout * y * silu'(z)
                    _load_block(dout, dout_tm, b, d0, nw, t0, T, dyb)
                    if has_z:
                        _load_block(z, False, b, d0, nw, t0, T, zb)
                        for i in range(T):
                            for w in range(W):
                                y_i = yb[i, w] + Db[w] * ub[i, w]
                                z_i = zb[i, w]
                                s = _sigmoid(z_i, one)
                                dout_i = dyb[i, w]
                                yb[i, w] = dout_i * y_i * (s * (one + z_i * (one - s)))   # dz
                                dyb[i, w] = dout_i * (z_i * s)
                        _store_block(yb, dz, False, b, d0, nw, t0, T)
                    # the reverse scan G_t = C_t dy_t + a_{t+1} G_{t+1} with the local gradients
                    for i in range(T - 1, -1, -1):
                        for w in range(W):
                            s_bg[w] = 0
                            s_aq[w] = 0
                        h_prev, h_i, a_i = hb[i], hb[i + 1], ab[i]
                        for n in range(N):
                            B_n = Bt[b, t0 + i, n]
                            C_n = Ct[b, t0 + i, n]
                            sB = zero
                            sC = zero
                            for w in range(W):
                                G = C_n * dyb[i, w] + g[n, w]
                                a = a_i[n, w]
                                q = G * a * h_prev[n, w]
                                s_bg[w] += B_n * G
                                s_aq[w] += Ab[n, w] * q
                                dAb[n, w] += dtb[i, w] * q
                                sB += dtub[i, w] * G
                                sC += dyb[i, w] * h_i[n, w]
                                g[n, w] = a * G
                            dB_blk[t0 + i, n] += sB
                            dC_blk[t0 + i, n] += sC
                        for w in range(W):
                            dy = dyb[i, w]
                            dt = dtb[i, w]
                            dub[i, w] = Db[w] * dy + dt * s_bg[w]
                            dD_acc[w] += dy * ub[i, w]
                            ddt = (s_aq[w] + ub[i, w] * s_bg[w]) * dspb[i, w]
                            ddtb[i, w] = ddt
                            ddb_acc[w] += ddt
                    _store_block(dub, du, True, b, d0, nw, t0, T)
                    if R > 0:     # through the delta projection: dW lane-wise, dX over the lanes
                        for i in range(T):
                            for r in range(R):
                                x_r = delta[b, t0 + i, r]
                                sX = zero
                                for w in range(W):
                                    ddt = ddtb[i, w]
                                    dWb[r, w] += ddt * x_r
                                    sX += Wb[r, w] * ddt
                                dX_blk[t0 + i, r] += sX
                    else:
                        _store_block(ddtb, ddelta, False, b, d0, nw, t0, T)
                if want_dh0:         # g is a_0 G_0 = dLoss/dh_{-1} after the first step
                    for w in range(nw):
                        for n in range(N):
                            dh0[b, d0 + w, n] = g[n, w]
                for w in range(nw):
                    for r in range(R):
                        dW_part[b, d0 + w, r] = dWb[r, w]
                    for n in range(N):
                        dA_part[b, d0 + w, n] = dAb[n, w]
                    dD_part[b, d0 + w] = dD_acc[w]
                    ddb_part[b, d0 + w] = ddb_acc[w]
            item = _take(queue)
    _reduce_partials(dA_part, dD_part, ddb_part, dW_part, dB_part, dC_part, dX_part, chunk,
                     n_workers, dA, dD, ddb, dW, dB, dC, dX)



# --------------------------------------------------------------------------- depthwise conv + SiLU

# The mixer's causal depthwise convolution and SiLU (conv_silu_ref is the oracle):
#   c[b, d, t] = bias[d] + sum_k w[d, k] x[b, t - K + 1 + k, d]   (x = 0 before t = 0)
#   u = silu(c), written channel-major (batch, dim, L): the layout the scan reads.
# x arrives in the model's (batch, L, dim) layout (a slice of in_proj's output, read in place).
# A work item (one sequence, a block of WC channels) copies its channels into rows of a buffer
# with K - 1 zeros in front, so that every loop over time reads contiguous memory and
# vectorizes: one expression and one store per step (K = 4, the usual kernel, has its taps
# written out; other K loop over the taps). The backward recomputes c (cheaper than saving
# it) and, with dc = dout * silu'(c) (K - 1 zeros after it),
#   dx[t] = sum_k w[k] dc[t + K - 1 - k],  dw[k] = sum_t dc[t] x[t - K + 1 + k],  db = sum_t dc[t]
# dw, db as per-sequence partials summed over the batch in order: deterministic, like the scan.
# The same work items move the gate z (the other half of in_proj's output) into the scan's
# layout, and in the backward write dz back beside dx: the gradient of the whole projection
# output comes out of one kernel (no torch.cat of the halves, no transposed copies of z).

@njit(**_inline)
def _conv_item(item, n_blocks, x, K, xb):
    """Work item -> (sequence b, first channel d0, channels nw) of its block of WC channels,
    with the block's input rows loaded into xb (xb[v, K - 1 + t] = x[b, t, d0 + v], with K - 1
    zeros in front)."""
    b = item // n_blocks
    d0 = (item - b * n_blocks) * WC
    nw = min(WC, x.shape[2] - d0)
    zero = xb.dtype.type(0)
    for v in range(nw):
        for i in range(K - 1):
            xb[v, i] = zero
    _to_rows(x, b, d0, nw, K - 1, xb)
    return b, d0, nw


# The transpositions between the model's (batch, L, dim) layout and a block's channel rows.
# The loop over the block's channels has WC iterations, written as the constant WC when the
# block is full: with the run-time count nw, LLVM vectorized the loop of a parallel kernel
# into code that measured 3.6-4.3x slower than the same loop over a constant WC.

@njit(**_inline)
def _to_rows(x, b, d0, nw, off, rows):
    """rows[v, off + t] = x[b, t, d0 + v] for v < nw."""
    if nw == WC:
        for t in range(x.shape[1]):
            for v in range(WC):
                rows[v, off + t] = x[b, t, d0 + v]
    else:
        for t in range(x.shape[1]):
            for v in range(nw):
                rows[v, off + t] = x[b, t, d0 + v]


@njit(**_inline)
def _from_rows(rows, x, b, d0, nw):
    """x[b, t, d0 + v] = rows[v, t] for v < nw."""
    if nw == WC:
        for t in range(x.shape[1]):
            for v in range(WC):
                x[b, t, d0 + v] = rows[v, t]
    else:
        for t in range(x.shape[1]):
            for v in range(nw):
                x[b, t, d0 + v] = rows[v, t]


@njit(**_inline)
def _conv_pre(xr, w, d, bias_d, K, t):
    """c at step t of a channel: bias + sum_k w[d, k] xr[t + k] (xr with K - 1 zeros in front)."""
    if K == 4:
        return bias_d + w[d, 0] * xr[t] + w[d, 1] * xr[t + 1] + w[d, 2] * xr[t + 2] + w[d, 3] * xr[t + 3]
    c = bias_d
    for k in range(K):
        c += w[d, k] * xr[t + k]
    return c


@njit(parallel=True, **_vec)
def _conv_silu_forward_kernel(x, z, w, bias, n_workers, out, zout):
    # x, z: (batch, L, dim) any strides   w: (dim, K)   bias: (dim,)   out: (batch, L, dim)
    # zout: (batch, dim, L)
    batch, L, dim = x.shape
    K = w.shape[1]
    n_blocks = -(-dim // WC)
    one = x.dtype.type(1)
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        xb = np.empty((WC, L + K - 1), dtype=x.dtype)
        ub = np.empty((WC, L), dtype=x.dtype)
        item = _take(queue)
        while item < batch * n_blocks:
            b, d0, nw = _conv_item(item, n_blocks, x, K, xb)
            for v in range(nw):
                d = d0 + v
                xr, ur, bias_d = xb[v], ub[v], bias[d]
                for t in range(L):
                    ur[t] = _conv_pre(xr, w, d, bias_d, K, t)
                for t in range(L):
                    ur[t] = ur[t] * _sigmoid(ur[t], one)
            _from_rows(ub, out, b, d0, nw)
            _to_rows(z, b, d0, nw, 0, zout[b, d0:d0 + nw])
            item = _take(queue)


@njit(parallel=True, **_vec)
def _conv_silu_backward_kernel(dout, dout_tm, dz, x, w, bias, n_workers, dx, dzx, dw_part, db_part):
    # dout: (batch, dim, L), or (batch, L, dim) when dout_tm   dz: (batch, dim, L)
    # x, dx, dzx: (batch, L, dim) any strides
    # dw_part: (batch, dim, K)   db_part: (batch, dim)
    batch, L, dim = x.shape
    K = w.shape[1]
    n_blocks = -(-dim // WC)
    one = x.dtype.type(1)
    zero = x.dtype.type(0)
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        xb = np.empty((WC, L + K - 1), dtype=x.dtype)
        gb = np.empty((WC, L + K - 1), dtype=x.dtype)     # dc, K - 1 zeros after it
        dxb = np.empty((WC, L), dtype=x.dtype)
        drows = np.empty((WC, L), dtype=x.dtype)
        item = _take(queue)
        while item < batch * n_blocks:
            b, d0, nw = _conv_item(item, n_blocks, x, K, xb)
            if dout_tm:
                _to_rows(dout, b, d0, nw, 0, drows)
            for v in range(nw):
                d = d0 + v
                dr = drows[v] if dout_tm else dout[b, d]
                xr, gr, dxr, bias_d = xb[v], gb[v], dxb[v], bias[d]
                for t in range(L):          # c, then dc: two loops vectorize, one did not
                    gr[t] = _conv_pre(xr, w, d, bias_d, K, t)
                for t in range(L):
                    c = gr[t]
                    sg = _sigmoid(c, one)
                    gr[t] = dr[t] * (sg * (one + c * (one - sg)))
                for t in range(L, L + K - 1):
                    gr[t] = zero
                s_db = zero
                for t in range(L):
                    s_db += gr[t]
                db_part[b, d] = s_db
                for k in range(K):
                    s_dw = zero
                    for t in range(L):
                        s_dw += gr[t] * xr[t + k]
                    dw_part[b, d, k] = s_dw
                if K == 4:
                    w0, w1, w2, w3 = w[d, 0], w[d, 1], w[d, 2], w[d, 3]
                    for t in range(L):
                        dxr[t] = w3 * gr[t] + w2 * gr[t + 1] + w1 * gr[t + 2] + w0 * gr[t + 3]
                else:
                    for t in range(L):
                        s_dx = zero
                        for k in range(K):
                            s_dx += w[d, k] * gr[t + K - 1 - k]
                        dxr[t] = s_dx
            _from_rows(dxb, dx, b, d0, nw)
            _from_rows(dz[b, d0:d0 + nw], dzx, b, d0, nw)
            item = _take(queue)


@njit(**_jit)
def _sum_batch(part, total):
    """total[j] = part[0, j] + part[1, j] + ... in batch order."""
    for j in range(total.shape[0]):
        a = part[0, j]
        for b in range(1, part.shape[0]):
            a += part[b, j]
        total[j] = a


# --------------------------------------------------------------------------- RMSNorm

# RMSNorm over the last dimension of the residual stream, rows = batch * L:
#   r = 1 / sqrt(mean(x^2) + eps),  out = x * r * w
#   dx = r * (g w) - x * r^3 * mean(g w x),  dw = sum_rows g * x * r
# Single-threaded (a few hundred KiB: a parallel pass would cost more to start than it saves),
# rows in order, so dw sums in a fixed order: deterministic.

@njit(**_vec)
def _rms_norm_forward_kernel(x, w, eps, out, rstd):
    rows, d = x.shape
    for i in range(rows):
        ss = x.dtype.type(0)
        for j in range(d):
            ss += x[i, j] * x[i, j]
        r = x.dtype.type(1) / np.sqrt(ss / d + eps)
        rstd[i] = r
        for j in range(d):
            out[i, j] = x[i, j] * r * w[j]


@njit(**_vec)
def _rms_norm_backward_kernel(dout, x, w, rstd, dx, dw):
    rows, d = x.shape
    dw[:] = 0
    for i in range(rows):
        r = rstd[i]
        dot = x.dtype.type(0)
        for j in range(d):
            dot += dout[i, j] * w[j] * x[i, j]
        c = r * r * r * dot / d
        for j in range(d):
            dx[i, j] = r * dout[i, j] * w[j] - x[i, j] * c
            dw[j] += dout[i, j] * x[i, j] * r


# --------------------------------------------------------------------------- cross-entropy

# The language-model loss over rows of logits (rows = batch * L, V = vocabulary), mean over rows:
#   loss_i = log(s_i) + m_i - x_i,t_i,   s_i = sum_j exp(x_ij - m_i),   m_i = max_j x_ij
#   dloss/dx_ij = g (exp(x_ij - m_i) / (rows s_i) - [j == t_i] / rows)   (g: upstream gradient)
# The forward keeps the exponentials (rows, V) and c_i = 1 / (rows s_i); the backward is one
# pass, exp * (c_i g), minus g / rows at the target. No log-softmax, zero fill or scatter of
# (rows, V) runs (PyTorch's loss runs each of those and the log-softmax's backward). Parallel over blocks of rows from the work queue; each row is computed by
# one thread in a fixed order, and the glue sums the row losses in order: the same for any
# number of threads. The row maximum runs lane-wise over WC lanes (a max reduction into one
# running value does not vectorize). NaN logits give NaN (the maximum skips them, the
# exponentials do not).
CE_ROWS = 16


@njit(parallel=True, **_vec)
def _cross_entropy_forward_kernel(logits, target, n_workers, loss_rows, ex, c):
    n, V = logits.shape
    n_items = -(-n // CE_ROWS)
    queue = np.zeros(1, np.int64)
    zero, one = logits.dtype.type(0), logits.dtype.type(1)
    for _ in prange(n_workers):
        lanes = np.empty(WC, logits.dtype)
        item = _take(queue)
        while item < n_items:
            for i in range(item * CE_ROWS, min(n, (item + 1) * CE_ROWS)):
                x, e = logits[i], ex[i]
                for w in range(WC):
                    lanes[w] = x[0]
                for j0 in range(0, V - WC + 1, WC):
                    for w in range(WC):
                        v = x[j0 + w]
                        lanes[w] = v if v > lanes[w] else lanes[w]
                m = lanes[0]
                for j in range(V - V % WC, V):
                    m = x[j] if x[j] > m else m
                for w in range(1, WC):
                    m = lanes[w] if lanes[w] > m else m
                s = zero
                for j in range(V):
                    ej = _exp(x[j] - m)
                    e[j] = ej
                    s += ej
                loss_rows[i] = np.log(s) + m - x[target[i]]
                c[i] = one / (n * s)
            item = _take(queue)


@njit(parallel=True, **_vec)
def _cross_entropy_backward_kernel(ex, c, target, g, n_workers, dx):
    n, V = ex.shape
    n_items = -(-n // CE_ROWS)
    queue = np.zeros(1, np.int64)
    g_row = g / n
    for _ in prange(n_workers):
        item = _take(queue)
        while item < n_items:
            for i in range(item * CE_ROWS, min(n, (item + 1) * CE_ROWS)):
                f = c[i] * g
                for j in range(V):
                    dx[i, j] = ex[i, j] * f
                dx[i, target[i]] -= g_row
            item = _take(queue)


# --------------------------------------------------------------------------- torch glue

# The glue below runs once per kernel call, about 20 calls per training step: each torch call
# in it costs 1-2.5 us, so it takes the cheap path (no .to(), .contiguous() or transpose through
# torch) when the tensor already is what the kernels read. A set of the six kernel calls (scan,
# conv, RMSNorm, forward and backward) at the smallest size, where only the glue costs, went from
# 972 to 689 us with it (paired, 40 rounds): about 0.6 ms per training step.
_threads = threading.local()


def _set_threads() -> int:
    """Use torch's thread count (at most numba's): -> the number of workers. numba's setting is
    per calling thread; it is only set again when torch's count changed for this thread."""
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if getattr(_threads, "n", None) != n:
        numba.set_num_threads(n)
        _threads.n = n
    return n


def _np(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """A numpy view of `t` in dtype `ct`: no copy when `t` already has that dtype, whatever its
    strides (torch strides are never negative; numba takes any others)."""
    return (t if t.dtype == ct else t.to(ct)).detach().numpy()


def _activation(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """A (batch, dim, L) activation as the kernels read it: C-contiguous, dtype `ct` (a copy
    when the model stores it otherwise, e.g. as a (batch, L, dim) tensor transposed)."""
    if t.dtype != ct or not t.is_contiguous():
        t = t.to(ct).contiguous()
    return t.detach().numpy()


def _either_layout(t: torch.Tensor, ct: torch.dtype) -> tuple[np.ndarray, bool]:
    """A (batch, dim, L) activation as the kernels read it -> (array, time_major): the
    C-contiguous (batch, L, dim) array behind a transposed view (the model's layout, read in
    place), else `_activation`'s C-contiguous (batch, dim, L) array."""
    t = _as(t, ct)                    # .to() keeps a transposed layout
    if not t.is_contiguous() and t.transpose(1, 2).is_contiguous():
        return t.detach().transpose(1, 2).numpy(), True
    return _activation(t, ct), False


def _transposed(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """(batch, N, L) -> (batch, L, N) view: the kernels read B_t[n], C_t[n] for all n at each
    time step. A copy only when its dtype differs, or when n is not its innermost stride."""
    a = _np(t, ct).transpose(0, 2, 1)
    return a if a.strides[2] == a.itemsize else np.ascontiguousarray(a)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` (itself when it already is: .to() costs a torch call even then)."""
    return t if t.dtype == dtype else t.to(dtype)


_chunk_lengths: dict[int, torch.Tensor] = {}


def _chunk_length(chunk: int) -> torch.Tensor:
    """The chunk length as a 0-d tensor (saved for the backward), made once per value, and
    never as an inference tensor: made first under torch.inference_mode (generation), it
    could not be saved for a backward later in the same process."""
    t = _chunk_lengths.get(chunk)
    if t is None:
        with torch.inference_mode(False):
            t = _chunk_lengths[chunk] = torch.tensor(chunk)
    return t


def _empty_like_layout(t: torch.Tensor, shape, ct: torch.dtype) -> torch.Tensor:
    """An empty (batch, X, L) tensor stored like `t`: as a (batch, L, X) tensor transposed when
    t's time steps are its outer stride, contiguous otherwise (dB, dC come out like B, C)."""
    if t is not None and t.dim() == 3 and t.stride(1) < t.stride(2):
        return torch.empty((shape[0], shape[2], shape[1]), dtype=ct).transpose(1, 2)
    return torch.empty(shape, dtype=ct)


def _optional(t, ct, shape, convert=_np):
    """Array for an optional input: `convert(t, ct)` (`_np`, or `_activation` for a (batch, dim,
    L) activation), or zeros / a dummy of `shape` when it is None."""
    if t is None:
        return np.zeros(shape, dtype=np.float64 if ct == torch.float64 else np.float32)
    return convert(t, ct)


def _n_groups(batch: int, dim: int) -> int:
    """Groups of W-channel blocks per sequence in the backward (shapes only, see WORK_ITEMS)."""
    return max(1, min(-(-dim // W), -(-WORK_ITEMS // max(batch, 1))))


def _delta_args(delta, delta_proj, ct):
    """(delta array, dt_proj weight array) for the kernels: delta as a (batch, dim, L) activation
    and a (1, 0) weight; or, with a delta projection, the low-rank (batch, L, R) input and the
    (dim, R) weight, both C-contiguous (like the plain case's arrays: the kernels compile once
    for both)."""
    if delta_proj is None:
        return _activation(delta, ct), np.zeros((1, 0), dtype=np.float64 if ct == torch.float64 else np.float32)
    return _activation(delta, ct), _activation(delta_proj, ct)   # C-contiguous: small copies


def forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj=None, initial_state=None):
    """-> (out (batch, dim, L) in u's dtype, last_state (batch, dim, N) in the compute dtype,
    saved = (checkpoints (batch, dim, n_chunks, N), chunk length as a 0-d tensor)). u may come
    as a (batch, dim, L) tensor or as a transposed view of a (batch, L, dim) one (read in place);
    out is a transposed view of a C-contiguous (batch, L, dim) tensor: the projection after
    the scan reads it without a copy.
    With `delta_proj` (dim, R), `delta` is the (batch, L, R) input of the delta projection and
    the kernels use delta = (delta @ delta_proj.T).transpose(1, 2), computed block by block.
    `initial_state` (batch, dim, N): the state before the first step (zeros when None); the
    first checkpoint is that state, so the backward needs nothing more to recompute from it."""
    n_workers = _set_threads()
    ct = compute_dtype(u.dtype)
    batch, dim, L = u.shape
    N = A.shape[1]
    chunk = CHUNK
    n_chunks = -(-L // chunk)
    out = torch.empty((batch, L, dim), dtype=ct)
    last_state = torch.empty((batch, dim, N), dtype=ct)
    ckpt = torch.empty((batch, dim, n_chunks, N), dtype=ct)
    _forward_kernel(*_either_layout(u, ct), *_delta_args(delta, delta_proj, ct), _np(A, ct), _transposed(B, ct),
                    _transposed(C, ct), _optional(D, ct, (dim,)), _optional(z, ct, (1, 1, 1), _activation),
                    _optional(delta_bias, ct, (dim,)), bool(delta_softplus), z is not None,
                    _optional(initial_state, ct, (1, 1, 1), _activation), initial_state is not None, chunk,
                    n_workers, out.numpy(), last_state.numpy(), ckpt.numpy())
    return _as(out, u.dtype).transpose(1, 2), last_state, (ckpt, _chunk_length(chunk))


def backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, saved, delta_proj=None,
             initial_state=None):
    """-> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias), each in its input's dtype
    (None for a None input among D, z, delta_bias); with `delta_proj`, ddelta is the gradient
    of the (batch, L, R) input and d delta_proj follows as a ninth gradient; with
    `initial_state`, its gradient follows last (the state the forward started from is the
    first saved checkpoint: the tensor itself is not read here). dout and u are
    read in either layout (see `forward`); du comes back as out does, a transposed view of a
    C-contiguous (batch, L, dim) tensor."""
    n_workers = _set_threads()
    ckpt, chunk = saved
    ct = compute_dtype(u.dtype)
    batch, dim, L = u.shape
    N = A.shape[1]
    R = 0 if delta_proj is None else delta_proj.shape[1]
    du = torch.empty((batch, L, dim), dtype=ct)
    ddelta = torch.empty((batch, dim, L) if R == 0 else (batch, L, R), dtype=ct)
    dW = torch.empty((dim, R), dtype=ct)
    dz = torch.empty((batch, dim, L) if z is not None else (1, 1, 1), dtype=ct)
    dA = torch.empty((dim, N), dtype=ct)
    dB = _empty_like_layout(B, (batch, N, L), ct)
    dC = _empty_like_layout(C, (batch, N, L), ct)
    dD = torch.empty((dim,), dtype=ct)
    ddb = torch.empty((dim,), dtype=ct)
    dh0 = torch.empty((batch, dim, N) if initial_state is not None else (1, 1, 1), dtype=ct)
    dout_args = (_optional(None, ct, (batch, dim, L)), False) if dout is None else _either_layout(dout, ct)
    _backward_kernel(*dout_args, _optional(dlast, ct, (batch, dim, N)),
                     *_either_layout(u, ct), *_delta_args(delta, delta_proj, ct), _np(A, ct), _transposed(B, ct),
                     _transposed(C, ct), _optional(D, ct, (dim,)), _optional(z, ct, (1, 1, 1), _activation),
                     _optional(delta_bias, ct, (dim,)), bool(delta_softplus), z is not None,
                     int(chunk), _np(ckpt, ct), _n_groups(batch, dim), n_workers,
                     du.numpy(), ddelta.numpy(), dz.numpy(), dA.numpy(), dB.numpy(), dC.numpy(),
                     dD.numpy(), ddb.numpy(), dW.numpy(), ddelta.numpy() if R else dW.numpy()[None],
                     dh0.numpy(), initial_state is not None)
    grads = (_as(du, u.dtype).transpose(1, 2), _as(ddelta, delta.dtype), _as(dA, A.dtype), _as(dB, B.dtype), _as(dC, C.dtype),
             None if D is None else _as(dD, D.dtype),
             None if z is None else _as(dz, z.dtype),
             None if delta_bias is None else _as(ddb, delta_bias.dtype))
    if delta_proj is not None:
        grads += (_as(dW, delta_proj.dtype),)
    return grads if initial_state is None else grads + (_as(dh0, initial_state.dtype),)


def conv_silu_forward(xz, weight, bias):
    """xz (batch, L, 2 dim), any strides (in_proj's output) -> (u, z), each (batch, dim, L) in
    xz's dtype: u = silu(depthwise causal conv of xz[..., :dim] + bias), a transposed view of a
    C-contiguous (batch, L, dim) tensor (x_proj and the scan read it in place); z =
    xz[..., dim:] moved into a C-contiguous (batch, dim, L) tensor. weight (dim, 1, K) or
    (dim, K); bias (dim,) or None."""
    n_workers = _set_threads()
    ct = compute_dtype(xz.dtype)
    batch, L, dim = xz.shape[0], xz.shape[1], weight.shape[0]
    out = torch.empty((batch, L, dim), dtype=ct)
    zout = torch.empty((batch, dim, L), dtype=ct)
    _conv_silu_forward_kernel(_np(xz[..., :dim], ct), _np(xz[..., dim:], ct),
                              _np(weight.reshape(dim, -1), ct), _optional(bias, ct, (dim,)), n_workers,
                              out.numpy(), zout.numpy())
    return _as(out, xz.dtype).transpose(1, 2), _as(zout, xz.dtype)


def conv_silu_backward(du, dz, xz, weight, bias):
    """du, dz (batch, dim, L) (du in either layout, see `forward`) -> (dxz (batch, L, 2 dim) in xz's dtype, dweight like weight, dbias
    like bias or None)."""
    n_workers = _set_threads()
    ct = compute_dtype(xz.dtype)
    batch, L, dim = xz.shape[0], xz.shape[1], weight.shape[0]
    K = weight.shape[-1]
    dxz = torch.empty((batch, L, 2 * dim), dtype=ct)
    dw_part = torch.empty((batch, dim * K), dtype=ct)
    db_part = torch.empty((batch, dim), dtype=ct)
    _conv_silu_backward_kernel(*_either_layout(du, ct), _activation(dz, ct), _np(xz[..., :dim], ct),
                               _np(weight.reshape(dim, K), ct), _optional(bias, ct, (dim,)), n_workers,
                               dxz[..., :dim].numpy(), dxz[..., dim:].numpy(),
                               dw_part.numpy().reshape(batch, dim, K), db_part.numpy())
    dw = torch.empty(dim * K, dtype=ct)
    _sum_batch(dw_part.numpy(), dw.numpy())
    db = None
    if bias is not None:
        db = torch.empty(dim, dtype=ct)
        _sum_batch(db_part.numpy(), db.numpy())
        db = _as(db, bias.dtype)
    return _as(dxz, xz.dtype), _as(dw.reshape(weight.shape), weight.dtype), db


def rms_norm_forward(x, weight, eps):
    """x (..., d) -> (out like x, rstd (rows,) in the compute dtype, saved for the backward)."""
    ct = compute_dtype(x.dtype)
    x2 = _np(x.reshape(-1, x.shape[-1]), ct)
    out = torch.empty(x2.shape, dtype=ct)
    rstd = torch.empty(x2.shape[0], dtype=ct)
    _rms_norm_forward_kernel(x2, _np(weight, ct), float(eps), out.numpy(), rstd.numpy())
    return _as(out.reshape(x.shape), x.dtype), rstd


def rms_norm_backward(dout, x, weight, rstd):
    """-> (dx like x, dweight like weight)."""
    ct = compute_dtype(x.dtype)
    d = x.shape[-1]
    dx = torch.empty((rstd.shape[0], d), dtype=ct)
    dw = torch.empty(d, dtype=ct)
    _rms_norm_backward_kernel(_np(dout.reshape(-1, d), ct), _np(x.reshape(-1, d), ct),
                              _np(weight, ct), rstd.numpy(), dx.numpy(), dw.numpy())
    return _as(dx.reshape(x.shape), x.dtype), _as(dw, weight.dtype)


def cross_entropy_forward(logits, target):
    """logits (rows, V), target (rows,) integers in [0, V) -> (mean cross-entropy as a 0-d tensor
    in the logits' dtype, saved = (exponentials (rows, V), c (rows,), target) for the backward).
    float32 arithmetic for half logits; the row losses are summed in float64, in row order."""
    ct = compute_dtype(logits.dtype)
    n, V = logits.shape
    target = _as(target, torch.int64)
    t = target.detach().numpy()
    if n and (t.min() < 0 or t.max() >= V):
        raise IndexError(f"cross-entropy target out of range: targets must lie in [0, {V})")
    ex = torch.empty((n, V), dtype=ct)
    c = torch.empty(n, dtype=ct)
    loss_rows = np.empty(n, dtype=np.float64 if ct == torch.float64 else np.float32)
    _cross_entropy_forward_kernel(_np(logits, ct), t, _set_threads(), loss_rows, ex.numpy(), c.numpy())
    loss = loss_rows.sum(dtype=np.float64) / n if n else math.nan
    return torch.tensor(loss, dtype=logits.dtype), (ex, c, target)


def cross_entropy_backward(dloss, saved, dtype):
    """The upstream gradient dloss (0-d) -> dlogits (rows, V) in `dtype`."""
    ex, c, target = saved
    dx = torch.empty(ex.shape, dtype=ex.dtype)
    _cross_entropy_backward_kernel(ex.numpy(), c.numpy(), target.numpy(), ex.numpy().dtype.type(float(dloss)),
                                   _set_threads(), dx.numpy())
    return _as(dx, dtype)
