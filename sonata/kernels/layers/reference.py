"""sonata/kernels/layers/reference.py: the fused layer ops in plain PyTorch, their oracles.

conv_silu_ref (the depthwise causal conv + SiLU, Mamba-1's and Mamba-2's), rms_norm_ref,
rms_norm_gated_ref (Mamba-2's gated, grouped RMSNorm) and cross_entropy_ref (the training loss).
Autograd flows through each; the fused numba kernels (`cpu.py`) are tested against them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sonata.kernels.dispatch import compute_dtype


def conv_silu_ref(x, weight, bias=None):
    """The model's depthwise causal convolution and SiLU, in the activations' layout:
    x (batch, L, dim) -> silu(conv1d(x over time, kernel K, causal) + bias), (batch, L, dim).
    weight (dim, 1, K) or (dim, K); bias (dim,). out[b, t] = silu(bias + sum_k weight[:, k] *
    x[b, t - K + 1 + k]) with x = 0 before the start. Autograd flows through it."""
    dim, K = weight.shape[0], weight.shape[-1]
    L = x.shape[1]
    pre = F.conv1d(x.transpose(1, 2), weight.reshape(dim, 1, K), bias, padding=K - 1, groups=dim)
    return F.silu(pre[..., :L]).transpose(1, 2)


def rms_norm_ref(x, weight, eps):
    """RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * weight. Autograd flows."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm_gated_ref(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True,
                      bias=None):
    """Mamba-2's gated RMSNorm (mamba_ssm's `rmsnorm_fn`), over groups of `group_size` channels
    of the last dimension (None: one group): with z and norm_before_gate, norm(x) * silu(z);
    with z and not norm_before_gate (the Mamba-2 block's order), norm(x * silu(z)); norm(v) =
    v * rsqrt(mean over the group of v^2 + eps) * weight (+ bias). Arithmetic in float32 (or
    float64), the result in x's dtype. Autograd flows."""
    dtype = x.dtype
    v = x.to(compute_dtype(dtype))
    gate = None if z is None else F.silu(z.to(v.dtype))
    if gate is not None and not norm_before_gate:
        v = v * gate
    d = v.shape[-1]
    g = group_size or d
    if d % g:
        raise ValueError(f"rms_norm_gated: group_size {g} must divide the {d} channels")
    vg = v.reshape(*v.shape[:-1], d // g, g)
    v = (vg * torch.rsqrt(vg.pow(2).mean(-1, keepdim=True) + eps)).reshape(v.shape) * weight.to(v.dtype)
    if bias is not None:
        v = v + bias.to(v.dtype)
    if gate is not None and norm_before_gate:
        v = v * gate
    return v.to(dtype)


def cross_entropy_ref(logits, target):
    """The language-model loss: mean cross-entropy of logits (rows, V) against target (rows,),
    PyTorch's. Autograd flows. (PyTorch skips targets of -100; the fused cpu loss has no ignored
    index and refuses them, as every target outside [0, V): sonata's targets are token ids.)"""
    return F.cross_entropy(logits, target)
