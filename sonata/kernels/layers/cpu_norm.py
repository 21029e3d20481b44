"""sonata/kernels/layers/cpu_norm.py: the fused RMSNorm and Mamba-2's gated, grouped RMSNorm,
forward and backward, in numba; `rms_norm_ref` and `rms_norm_gated_ref` (layers/reference.py)
are their oracles, layers/cpu.py their glue."""
from __future__ import annotations

import numpy as np
from numba import njit

from sonata.kernels.cpu_simd import INLINE_FLAGS, fast_sigmoid, VEC_FLAGS

# --------------------------------------------------------------------------- RMSNorm

# RMSNorm over the last dimension of the residual stream, rows = batch * L:
#   r = 1 / sqrt(mean(x^2) + eps),  out = x * r * w
#   dx = r * (g w) - x * r^3 * mean(g w x),  dw = sum_rows g * x * r
# Single-threaded (a few hundred KiB: a parallel pass would cost more to start than it saves),
# rows in order, so dw sums in a fixed order: deterministic.

@njit(**VEC_FLAGS)
def rms_norm_forward_kernel(x, w, eps, out, rstd):
    rows, d = x.shape
    for i in range(rows):
        ss = x.dtype.type(0)
        for j in range(d):
            ss += x[i, j] * x[i, j]
        r = x.dtype.type(1) / np.sqrt(ss / d + eps)
        rstd[i] = r
        for j in range(d):
            out[i, j] = x[i, j] * r * w[j]


@njit(**VEC_FLAGS)
def rms_norm_backward_kernel(dout, x, w, rstd, dx, dw):
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


# --------------------------------------------------------------------------- gated, grouped RMSNorm

# Mamba-2's output norm (rms_norm_gated_ref is the oracle), rows = batch * L, the last dimension
# cut into groups of gs channels, s = silu(z) (1 when there is no z):
#   gate first (norm_before_gate False, the block's order):  v = x s,  out = v r w
#   norm first (norm_before_gate True):                      v = x,    out = v r w s
#   r = 1 / sqrt(mean over the group of v^2 + eps)
# The backward, with gn = dout w (times s when the norm comes first):
#   dv = r gn - v r^3 mean_group(gn v),   dw = sum_rows dout v r (times s when norm first)
#   gate first: dx = dv s,  dz = dv x silu'(z);   norm first: dx = dv,  dz = dout v r w silu'(z)
# with silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z))). Inputs in any strides (z a slice of
# in_proj's output, read in place); single-threaded, rows in order: dw sums in a fixed order, deterministic.

@njit(**INLINE_FLAGS)
def _load_row(a, i, d, row):
    """row[:] = a[i, :d]: rows of any stride (z is a slice of in_proj's output) copied into
    contiguous scratch, so that the loops over channels vectorize."""
    for j in range(d):
        row[j] = a[i, j]


@njit(**INLINE_FLAGS)
def _gate_row(zr, d, one, s, sig):
    """s = silu(z), sig = sigmoid(z) over a row's d channels."""
    for j in range(d):
        sg = fast_sigmoid(zr[j], one)
        sig[j] = sg
        s[j] = zr[j] * sg


@njit(**VEC_FLAGS)
def rms_norm_gated_forward_kernel(x, z, w, eps, gs, has_z, before, out, rstd):
    # x, z: (rows, d) any strides   out: (rows, d) C-contiguous   w: (d,)   rstd: (rows, d // gs)
    rows, d = x.shape
    one = x.dtype.type(1)
    eps_, inv_gs = x.dtype.type(eps), one / x.dtype.type(gs)
    v = np.empty(d, dtype=x.dtype)
    zr = np.empty(d, dtype=x.dtype)
    s = np.ones(d, dtype=x.dtype)
    sig = np.empty(d, dtype=x.dtype)
    wr = np.empty(d, dtype=x.dtype)
    for j in range(d):
        wr[j] = w[j]
    gate_first = has_z and not before
    for i in range(rows):
        _load_row(x, i, d, v)
        if has_z:
            _load_row(z, i, d, zr)
            _gate_row(zr, d, one, s, sig)
        if gate_first:
            for j in range(d):
                v[j] = v[j] * s[j]
        o = out[i]
        for g in range(d // gs):
            j0 = g * gs
            ss = x.dtype.type(0)
            for j in range(gs):
                ss += v[j0 + j] * v[j0 + j]
            r = one / np.sqrt(ss * inv_gs + eps_)
            rstd[i, g] = r
            if has_z and before:
                for j in range(gs):
                    o[j0 + j] = v[j0 + j] * r * wr[j0 + j] * s[j0 + j]
            else:
                for j in range(gs):
                    o[j0 + j] = v[j0 + j] * r * wr[j0 + j]


@njit(**VEC_FLAGS)
def rms_norm_gated_backward_kernel(dout, x, z, w, rstd, gs, has_z, before, dx, dz, dw):
    # dout, x, z: (rows, d) any strides   dx, dz: (rows, d) C-contiguous   w, dw: (d,)
    # rstd: (rows, d // gs)
    rows, d = x.shape
    one = x.dtype.type(1)
    inv_gs = one / x.dtype.type(gs)
    xr = np.empty(d, dtype=x.dtype)
    zr = np.empty(d, dtype=x.dtype)
    gr = np.empty(d, dtype=x.dtype)
    v = np.empty(d, dtype=x.dtype)
    s = np.ones(d, dtype=x.dtype)
    sig = np.empty(d, dtype=x.dtype)
    gn = np.empty(d, dtype=x.dtype)
    dv = np.empty(d, dtype=x.dtype)
    wr = np.empty(d, dtype=x.dtype)
    acc = np.zeros(d, dtype=x.dtype)
    for j in range(d):
        wr[j] = w[j]
    gate_first = has_z and not before
    for i in range(rows):
        _load_row(x, i, d, xr)
        _load_row(dout, i, d, gr)
        if has_z:
            _load_row(z, i, d, zr)
            _gate_row(zr, d, one, s, sig)
        if gate_first:
            for j in range(d):
                v[j] = xr[j] * s[j]
                gn[j] = gr[j] * wr[j]
        elif has_z:                                        # norm first
            for j in range(d):
                v[j] = xr[j]
                gn[j] = gr[j] * wr[j] * s[j]
        else:
            for j in range(d):
                v[j] = xr[j]
                gn[j] = gr[j] * wr[j]
        dzi = dz[i]
        for g in range(d // gs):
            j0 = g * gs
            r = rstd[i, g]
            dot = x.dtype.type(0)
            for j in range(gs):
                dot += gn[j0 + j] * v[j0 + j]
            c = r * r * r * dot * inv_gs
            if has_z and before:
                for j in range(gs):
                    dv[j0 + j] = r * gn[j0 + j] - v[j0 + j] * c
                    n = gr[j0 + j] * v[j0 + j] * r                  # dout times the normed v
                    acc[j0 + j] += n * s[j0 + j]
                    dzi[j0 + j] = n * wr[j0 + j] * sig[j0 + j] * (one + zr[j0 + j] * (one - sig[j0 + j]))
            else:
                for j in range(gs):
                    dv[j0 + j] = r * gn[j0 + j] - v[j0 + j] * c
                    acc[j0 + j] += gr[j0 + j] * v[j0 + j] * r
        dxi = dx[i]
        if gate_first:
            for j in range(d):
                dxi[j] = dv[j] * s[j]
                dzi[j] = dv[j] * xr[j] * sig[j] * (one + zr[j] * (one - sig[j]))
        else:
            for j in range(d):
                dxi[j] = dv[j]
    for j in range(d):
        dw[j] = acc[j]
