"""The selective scan in plain PyTorch: obviously right, slow, the oracle.

Every fused backend is tested against this function run in float64. It follows
the semantics of `selective_scan_ref` in state-spaces/mamba:

    delta  <- softplus(delta + delta_bias)          (bias and softplus optional)
    h_t     = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t     # (b, d, n)
    y_t     = sum_n C_t[n] * h_t[n] + D * u_t
    out     = y * silu(z)                                            (z optional)

Shapes: u, delta, z (batch, d_inner, L); A (d_inner, N); B, C (batch, N, L);
D, delta_bias (d_inner,). Arithmetic is float32 for half inputs and the input
dtype otherwise; the output has the dtype of `u`. Autograd flows through it.
This is also the one place the recurrence is written for the model's O(1)
per-token generation: see `step`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype for inputs of `dtype`: at least float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def project_delta(dt, weight):
    """The model's delta from dt_proj's low-rank input: dt (batch, L, R), weight (d_inner, R) ->
    (batch, d_inner, L), a transposed view (bias and softplus are the scan's). What
    `selective_scan(..., delta_proj=weight)` means; the cpu kernels form it inside the scan."""
    return (dt @ weight.t()).transpose(1, 2)


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                       delta_softplus=False, return_last_state=False, initial_state=None):
    out_dtype = u.dtype
    ct = compute_dtype(u.dtype)
    u, delta, A, B, C = (t.to(ct) for t in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(ct)[None, :, None]
    if delta_softplus:
        delta = F.softplus(delta)
    batch, d_inner, L = u.shape
    deltaA = torch.exp(delta.unsqueeze(-1) * A[None, :, None, :])          # (b, d, L, n)
    deltaBu = (delta * u).unsqueeze(-1) * B.transpose(1, 2)[:, None]     # (b, d, L, n)
    h = (initial_state.to(ct) if initial_state is not None
         else u.new_zeros(batch, d_inner, A.shape[1]))                    # (b, d, n)
    ys = []
    # unbind: per-step views whose backward does not allocate a full-size gradient each step
    for dA_t, dBu_t, C_t in zip(deltaA.unbind(2), deltaBu.unbind(2), C.unbind(2)):
        h = dA_t * h + dBu_t
        ys.append(torch.einsum("bdn,bn->bd", h, C_t))
    y = torch.stack(ys, dim=-1) if L > 0 else u.new_zeros(batch, d_inner, 0)  # (b, d, L)
    if D is not None:
        y = y + u * D.to(ct)[None, :, None]
    if z is not None:
        y = y * F.silu(z.to(ct))
    out = y.to(out_dtype)
    return (out, h) if return_last_state else out


def step(h, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """One time step of the recurrence, for generation.

    h (b, d, n) state; u, delta, z (b, d); B, C (b, n). Returns (y (b, d), new h).
    """
    if delta_bias is not None:
        delta = delta + delta_bias
    if delta_softplus:
        delta = F.softplus(delta)
    h = torch.exp(delta.unsqueeze(-1) * A) * h + (delta * u).unsqueeze(-1) * B.unsqueeze(1)
    y = torch.einsum("bdn,bn->bd", h, C)
    if D is not None:
        y = y + u * D
    if z is not None:
        y = y * F.silu(z)
    return y, h


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
