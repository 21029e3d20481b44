"""sonata/kernels/selective/cpu_kernels.py: the fused numba CPU kernels of the Mamba-1 selective
scan: forward and hand-written backward. (The torch glue that calls them is selective/cpu.py; the
shared maths sonata/kernels/cpu_simd.py.)

Semantics are exactly those of `selective_scan_ref` (selective/reference.py): the
recurrence h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t, y_t = C_t . h_t + D u_t, gated by
silu(z), written out with its backward in docs/kernels.md.

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

Determinism. No atomics in the arithmetic (the work queue, `cpu_simd.take_item`, only hands out work
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
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from sonata.kernels.cpu_simd import parallel_kernel, W, JIT_FLAGS, VEC_FLAGS, INLINE_FLAGS, fast_exp, fast_softplus, fast_sigmoid, take_item

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

@njit(**JIT_FLAGS)
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


@njit(**JIT_FLAGS)
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


@njit(**INLINE_FLAGS)
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
                dt = fast_softplus(x) if w < nw else zero
                dtb[i, w] = dt
                dtub[i, w] = dt * ub[i, w]
                if want_dsp:
                    dspb[i, w] = one if x > twenty else fast_sigmoid(x, one)
    else:
        for i in range(T):
            for w in range(W):
                dt = dtb[i, w] + bias[w]
                dtb[i, w] = dt
                dtub[i, w] = dt * ub[i, w]
                if want_dsp:
                    dspb[i, w] = one


@njit(**INLINE_FLAGS)
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

@parallel_kernel(**VEC_FLAGS)
def scan_forward_kernel(u, u_tm, delta, dtw, A, Bt, Ct, D, z, delta_bias, softplus, has_z, h0, has_h0,
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
        item = take_item(queue)
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
                            h_n = fast_exp(dtb[i, w] * Ab[n, w]) * h[n, w] + dtub[i, w] * B_n
                            h[n, w] = h_n
                            y[w] += C_n * h_n
                if has_z:
                    _load_block(z, False, b, d0, nw, t0, T, zb)
                    for i in range(T):
                        for w in range(W):
                            z_i = zb[i, w]
                            yb[i, w] = (yb[i, w] + Db[w] * ub[i, w]) * (z_i * fast_sigmoid(z_i, one))
                else:
                    for i in range(T):
                        for w in range(W):
                            yb[i, w] = yb[i, w] + Db[w] * ub[i, w]
                _store_block(yb, out, True, b, d0, nw, t0, T)
            for w in range(nw):
                for n in range(N):
                    last_state[b, d0 + w, n] = h[n, w]
            item = take_item(queue)


# --------------------------------------------------------------------------- backward

@parallel_kernel(**JIT_FLAGS)
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
        item = take_item(queue)
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
            item = take_item(queue)


@parallel_kernel(**VEC_FLAGS)
def scan_backward_kernel(dout, dout_tm, dlast, u, u_tm, delta, dtw, A, Bt, Ct, D, z, delta_bias,
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
        item = take_item(queue)
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
                                a = fast_exp(dtb[i, w] * Ab[n, w])
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
                                s = fast_sigmoid(z_i, one)
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
            item = take_item(queue)
    _reduce_partials(dA_part, dD_part, ddb_part, dW_part, dB_part, dC_part, dX_part, chunk,
                     n_workers, dA, dD, ddb, dW, dB, dC, dX)
