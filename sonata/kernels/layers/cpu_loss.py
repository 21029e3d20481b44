"""sonata/kernels/layers/cpu_loss.py: the fused cross-entropy loss, forward and backward, in
numba; `cross_entropy_ref` (layers/reference.py) is its oracle, layers/cpu.py its glue."""
from __future__ import annotations

import numpy as np
from numba import prange

from sonata.kernels.cpu_simd import parallel_kernel, WC, VEC_FLAGS, fast_exp, take_item

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


@parallel_kernel(**VEC_FLAGS)
def cross_entropy_forward_kernel(logits, target, n_workers, loss_rows, ex, c):
    n, V = logits.shape
    n_items = -(-n // CE_ROWS)
    queue = np.zeros(1, np.int64)
    zero, one = logits.dtype.type(0), logits.dtype.type(1)
    for _ in prange(n_workers):
        lanes = np.empty(WC, logits.dtype)
        item = take_item(queue)
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
                    ej = fast_exp(x[j] - m)
                    e[j] = ej
                    s += ej
                loss_rows[i] = np.log(s) + m - x[target[i]]
                c[i] = one / (n * s)
            item = take_item(queue)


@parallel_kernel(**VEC_FLAGS)
def cross_entropy_backward_kernel(ex, c, target, g, n_workers, dx):
    n, V = ex.shape
    n_items = -(-n // CE_ROWS)
    queue = np.zeros(1, np.int64)
    g_row = g / n
    for _ in prange(n_workers):
        item = take_item(queue)
        while item < n_items:
            for i in range(item * CE_ROWS, min(n, (item + 1) * CE_ROWS)):
                f = c[i] * g
                for j in range(V):
                    dx[i, j] = ex[i, j] * f
                dx[i, target[i]] -= g_row
            item = take_item(queue)
