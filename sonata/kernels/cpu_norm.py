"""The fused RMSNorm, forward and backward, in numba; `rms_norm_ref` is its oracle,
`sonata.kernels.cpu` its glue."""
from __future__ import annotations

import numpy as np
from numba import njit

from sonata.kernels.cpu_simd import _vec

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
