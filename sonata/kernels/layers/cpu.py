"""sonata/kernels/layers/cpu.py: the fused layer ops' `cpu` backend, the torch glue in front of
their numba kernels:

    cpu_conv.py   the depthwise causal conv + SiLU and the gate's move into the scan's layout
                  (or the conv alone: Mamba-2's over x, B, C)
    cpu_norm.py   RMSNorm, and Mamba-2's gated, grouped RMSNorm
    cpu_loss.py   the cross-entropy loss

It turns torch tensors into the arrays the kernels read (sonata/kernels/cpu_arrays.py), allocates
their outputs and partials, and is what `sonata.kernels.layers` loads as the backend:
conv_silu_forward / _backward, causal_conv_silu_forward / _backward, rms_norm_forward / _backward,
rms_norm_gated_forward / _backward, cross_entropy_forward / _backward (the ops of
layers/ops.py call them). numba compiles each kernel on first use and caches it on disk, keyed by
every source of sonata/kernels (`numba_cache`).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from sonata.kernels.cpu_arrays import activation_array, as_dtype, either_layout, np_view, optional_array
from sonata.kernels.cpu_simd import for_workers, workers
from sonata.kernels.dispatch import compute_dtype
from sonata.kernels.layers.cpu_conv import conv_silu_backward_kernel, conv_silu_forward_kernel, sum_batch
from sonata.kernels.layers.cpu_loss import cross_entropy_backward_kernel, cross_entropy_forward_kernel
from sonata.kernels.layers.cpu_norm import (rms_norm_backward_kernel, rms_norm_forward_kernel,
                                            rms_norm_gated_backward_kernel, rms_norm_gated_forward_kernel)


def conv_silu_forward(xz, weight, bias):
    """xz (batch, L, 2 dim), any strides (in_proj's output) -> (u, z), each (batch, dim, L) in
    xz's dtype: u = silu(depthwise causal conv of xz[..., :dim] + bias), a transposed view of a
    C-contiguous (batch, L, dim) tensor (x_proj and the scan read it in place); z =
    xz[..., dim:] moved into a C-contiguous (batch, dim, L) tensor. weight (dim, 1, K) or
    (dim, K); bias (dim,) or None."""
    n_workers = workers()
    ct = compute_dtype(xz.dtype)
    batch, L, dim = xz.shape[0], xz.shape[1], weight.shape[0]
    out = torch.empty((batch, L, dim), dtype=ct)
    zout = torch.empty((batch, dim, L), dtype=ct)
    for_workers(conv_silu_forward_kernel, n_workers)(np_view(xz[..., :dim], ct), np_view(xz[..., dim:], ct),
                              np_view(weight.reshape(dim, -1), ct), optional_array(bias, ct, (dim,)), n_workers,
                              True, out.numpy(), zout.numpy())
    return as_dtype(out, xz.dtype).transpose(1, 2), as_dtype(zout, xz.dtype)


def conv_silu_backward(du, dz, xz, weight, bias):
    """du, dz (batch, dim, L) (du in either layout, see `forward`) -> (dxz (batch, L, 2 dim) in xz's dtype, dweight like weight, dbias
    like bias or None)."""
    n_workers = workers()
    ct = compute_dtype(xz.dtype)
    batch, L, dim = xz.shape[0], xz.shape[1], weight.shape[0]
    K = weight.shape[-1]
    dxz = torch.empty((batch, L, 2 * dim), dtype=ct)
    dw_part = torch.empty((batch, dim * K), dtype=ct)
    db_part = torch.empty((batch, dim), dtype=ct)
    for_workers(conv_silu_backward_kernel, n_workers)(*either_layout(du, ct), activation_array(dz, ct), np_view(xz[..., :dim], ct),
                               np_view(weight.reshape(dim, K), ct), optional_array(bias, ct, (dim,)), n_workers,
                               True, dxz[..., :dim].numpy(), dxz[..., dim:].numpy(),
                               dw_part.numpy().reshape(batch, dim, K), db_part.numpy())
    return (as_dtype(dxz, xz.dtype), *_conv_param_grads(dw_part, db_part, weight, bias, ct))


def causal_conv_silu_forward(x, weight, bias, out_dtype=None):
    """x (batch, L, dim), any strides (Mamba-2's xBC slice of in_proj's output) -> silu(depthwise
    causal conv of x + bias), a C-contiguous (batch, L, dim) tensor in out_dtype (None: x's).
    The convolution of `conv_silu_forward` without the gate (any width)."""
    n_workers = workers()
    ct = compute_dtype(x.dtype)
    batch, L, dim = x.shape
    out = torch.empty((batch, L, dim), dtype=ct)
    xa = np_view(x, ct)
    for_workers(conv_silu_forward_kernel, n_workers)(xa, xa, np_view(weight.reshape(dim, -1), ct), optional_array(bias, ct, (dim,)),
                              n_workers, False, out.numpy(), np.empty((1, 1, 1), dtype=xa.dtype))
    return as_dtype(out, out_dtype or x.dtype)


def causal_conv_silu_backward(dout, x, weight, bias):
    """dout (batch, L, dim) -> (dx (batch, L, dim) in x's dtype, dweight like weight, dbias like
    bias or None)."""
    n_workers = workers()
    ct = compute_dtype(x.dtype)
    batch, L, dim = x.shape
    K = weight.shape[-1]
    dx = torch.empty((batch, L, dim), dtype=ct)
    dw_part = torch.empty((batch, dim * K), dtype=ct)
    db_part = torch.empty((batch, dim), dtype=ct)
    dxa = dx.numpy()
    no_gate = np.empty((1, 1, 1), dtype=dxa.dtype)
    for_workers(conv_silu_backward_kernel, n_workers)(*either_layout(dout.transpose(1, 2), ct), no_gate,
                               np_view(x, ct), np_view(weight.reshape(dim, K), ct), optional_array(bias, ct, (dim,)),
                               n_workers, False, dxa, dxa, dw_part.numpy().reshape(batch, dim, K),
                               db_part.numpy())
    return (as_dtype(dx, x.dtype), *_conv_param_grads(dw_part, db_part, weight, bias, ct))


def _conv_param_grads(dw_part, db_part, weight, bias, ct):
    """The conv's weight and bias gradients from the kernels' per-sequence parts (summed here)."""
    dim, K = weight.shape[0], weight.shape[-1]
    dw = torch.empty(dim * K, dtype=ct)
    sum_batch(dw_part.numpy(), dw.numpy())
    db = None
    if bias is not None:
        db = torch.empty(dim, dtype=ct)
        sum_batch(db_part.numpy(), db.numpy())
        db = as_dtype(db, bias.dtype)
    return as_dtype(dw.reshape(weight.shape), weight.dtype), db


def rms_norm_gated_forward(x, weight, z, eps, group_size, norm_before_gate):
    """x (..., d), z like x or None, any strides -> (out like x, rstd (rows, d // group_size) in
    the compute dtype, saved for the backward). The semantics of `rms_norm_gated_ref` (no bias)."""
    ct = compute_dtype(x.dtype)
    d = x.shape[-1]
    x2 = np_view(x.reshape(-1, d), ct)
    z2 = x2 if z is None else np_view(z.reshape(-1, d), ct)
    out = torch.empty(x2.shape, dtype=ct)
    rstd = torch.empty((x2.shape[0], d // group_size), dtype=ct)
    rms_norm_gated_forward_kernel(x2, z2, np_view(weight, ct), float(eps), int(group_size), z is not None,
                                   bool(norm_before_gate), out.numpy(), rstd.numpy())
    return as_dtype(out.reshape(x.shape), x.dtype), rstd


def rms_norm_gated_backward(dout, x, weight, z, rstd, group_size, norm_before_gate):
    """-> (dx like x, dweight like weight, dz like z or None)."""
    ct = compute_dtype(x.dtype)
    d = x.shape[-1]
    x2 = np_view(x.reshape(-1, d), ct)
    z2 = x2 if z is None else np_view(z.reshape(-1, d), ct)
    dx = torch.empty(x2.shape, dtype=ct)
    dz = torch.empty(x2.shape, dtype=ct) if z is not None else dx
    dw = torch.empty(d, dtype=ct)
    rms_norm_gated_backward_kernel(np_view(dout.reshape(-1, d), ct), x2, z2, np_view(weight, ct), rstd.numpy(),
                                    int(group_size), z is not None, bool(norm_before_gate),
                                    dx.numpy(), dz.numpy(), dw.numpy())
    return (as_dtype(dx.reshape(x.shape), x.dtype), as_dtype(dw, weight.dtype),
            None if z is None else as_dtype(dz.reshape(z.shape), z.dtype))


def rms_norm_forward(x, weight, eps):
    """x (..., d) -> (out like x, rstd (rows,) in the compute dtype, saved for the backward)."""
    ct = compute_dtype(x.dtype)
    x2 = np_view(x.reshape(-1, x.shape[-1]), ct)
    out = torch.empty(x2.shape, dtype=ct)
    rstd = torch.empty(x2.shape[0], dtype=ct)
    rms_norm_forward_kernel(x2, np_view(weight, ct), float(eps), out.numpy(), rstd.numpy())
    return as_dtype(out.reshape(x.shape), x.dtype), rstd


def rms_norm_backward(dout, x, weight, rstd):
    """-> (dx like x, dweight like weight)."""
    ct = compute_dtype(x.dtype)
    d = x.shape[-1]
    dx = torch.empty((rstd.shape[0], d), dtype=ct)
    dw = torch.empty(d, dtype=ct)
    rms_norm_backward_kernel(np_view(dout.reshape(-1, d), ct), np_view(x.reshape(-1, d), ct),
                              np_view(weight, ct), rstd.numpy(), dx.numpy(), dw.numpy())
    return as_dtype(dx.reshape(x.shape), x.dtype), as_dtype(dw, weight.dtype)


def cross_entropy_forward(logits, target):
    """logits (rows, V), target (rows,) integers in [0, V) -> (mean cross-entropy as a 0-d tensor
    in the logits' dtype, saved = (exponentials (rows, V), c (rows,), target) for the backward).
    float32 arithmetic for half logits; the row losses are summed in float64, in row order."""
    ct = compute_dtype(logits.dtype)
    n, V = logits.shape
    target = as_dtype(target, torch.int64)
    t = target.detach().numpy()
    if n and (t.min() < 0 or t.max() >= V):
        raise IndexError(f"cross-entropy target out of range: targets must lie in [0, {V})")
    ex = torch.empty((n, V), dtype=ct)
    c = torch.empty(n, dtype=ct)
    loss_rows = np.empty(n, dtype=np.float64 if ct == torch.float64 else np.float32)
    n_workers = workers()
    for_workers(cross_entropy_forward_kernel, n_workers)(np_view(logits, ct), t, n_workers, loss_rows, ex.numpy(), c.numpy())
    loss = loss_rows.sum(dtype=np.float64) / n if n else math.nan
    return torch.tensor(loss, dtype=logits.dtype), (ex, c, target)


def cross_entropy_backward(dloss, saved, dtype):
    """The upstream gradient dloss (0-d) -> dlogits (rows, V) in `dtype`."""
    ex, c, target = saved
    dx = torch.empty(ex.shape, dtype=ex.dtype)
    n_workers = workers()
    for_workers(cross_entropy_backward_kernel, n_workers)(
        ex.numpy(), c.numpy(), target.numpy(), ex.numpy().dtype.type(float(dloss)), n_workers, dx.numpy())
    return as_dtype(dx, dtype)
