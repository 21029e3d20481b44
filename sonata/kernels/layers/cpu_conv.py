"""sonata/kernels/layers/cpu_conv.py: the fused depthwise causal convolution + SiLU (and the gate
moved into the scan's layout), forward and backward, in numba; `conv_silu_ref`
(layers/reference.py) is its oracle, layers/cpu.py its glue."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from sonata.kernels.cpu_simd import parallel_kernel, WC, JIT_FLAGS, VEC_FLAGS, INLINE_FLAGS, fast_sigmoid, take_item

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
# Without move_z the kernels are the convolution alone, over any number of channels (Mamba-2's
# conv over x, B and C, wider than its gate).

@njit(**INLINE_FLAGS)
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

@njit(**INLINE_FLAGS)
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


@njit(**INLINE_FLAGS)
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


@njit(**INLINE_FLAGS)
def _conv_pre(xr, w, d, bias_d, K, t):
    """c at step t of a channel: bias + sum_k w[d, k] xr[t + k] (xr with K - 1 zeros in front)."""
    if K == 4:
        return bias_d + w[d, 0] * xr[t] + w[d, 1] * xr[t + 1] + w[d, 2] * xr[t + 2] + w[d, 3] * xr[t + 3]
    c = bias_d
    for k in range(K):
        c += w[d, k] * xr[t + k]
    return c


@parallel_kernel(**VEC_FLAGS)
def conv_silu_forward_kernel(x, z, w, bias, n_workers, move_z, out, zout):
    # x, z: (batch, L, dim) any strides   w: (dim, K)   bias: (dim,)   out: (batch, L, dim)
    # zout: (batch, dim, L); neither z nor zout is read without move_z (Mamba-2: no gate here)
    batch, L, dim = x.shape
    K = w.shape[1]
    n_blocks = -(-dim // WC)
    one = x.dtype.type(1)
    queue = np.zeros(1, dtype=np.int64)
    for _w in prange(n_workers):
        xb = np.empty((WC, L + K - 1), dtype=x.dtype)
        ub = np.empty((WC, L), dtype=x.dtype)
        item = take_item(queue)
        while item < batch * n_blocks:
            b, d0, nw = _conv_item(item, n_blocks, x, K, xb)
            for v in range(nw):
                d = d0 + v
                xr, ur, bias_d = xb[v], ub[v], bias[d]
                for t in range(L):
                    ur[t] = _conv_pre(xr, w, d, bias_d, K, t)
                for t in range(L):
                    ur[t] = ur[t] * fast_sigmoid(ur[t], one)
            _from_rows(ub, out, b, d0, nw)
            if move_z:
                _to_rows(z, b, d0, nw, 0, zout[b, d0:d0 + nw])
            item = take_item(queue)


@parallel_kernel(**VEC_FLAGS)
def conv_silu_backward_kernel(dout, dout_tm, dz, x, w, bias, n_workers, move_z, dx, dzx, dw_part, db_part):
    # dout: (batch, dim, L), or (batch, L, dim) when dout_tm   dz: (batch, dim, L) (read, and
    # dzx written, only with move_z)
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
        item = take_item(queue)
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
                    sg = fast_sigmoid(c, one)
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
            if move_z:
                _from_rows(dz[b, d0:d0 + nw], dzx, b, d0, nw)
            item = take_item(queue)


@njit(**JIT_FLAGS)
def sum_batch(part, total):
    """total[j] = part[0, j] + part[1, j] + ... in batch order."""
    for j in range(total.shape[0]):
        a = part[0, j]
        for b in range(1, part.shape[0]):
            a += part[b, j]
        total[j] = a
