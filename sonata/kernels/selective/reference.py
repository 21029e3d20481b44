"""sonata/kernels/selective/reference.py: the Mamba-1 selective scan in plain PyTorch: obviously
right, slow, the oracle (`selective_scan_ref`), the delta projection (`project_delta`) and the
one-token step (`step`).

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

from sonata.kernels.dispatch import compute_dtype


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
