"""sonata/kernels/mamba3/chunked.py: the Mamba-3 scan in chunks of matrix products (any rank R),
in plain PyTorch, autograd through it. The semantics are reference.py's.

The trapezoid's two terms fold into one weight per input: the pair (k_s, v_s) enters the state
with gamma_s at step s and again with beta_{s+1} = (1 - trap_{s+1}) dt_{s+1} alpha_{s+1} at step
s+1, and alpha_{s+1} is the decay from s to s+1. So the state after step t is

    S_t = e^{c_t} S'_0 + sum_{s<t} e^{c_t - c_s} w_s sum_r v_s,r k_s,r^T + gamma_t sum_r v_t,r k_t,r^T
    w_s = gamma_s + (1 - trap_{s+1}) dt_{s+1}   (w_{L-1} = gamma_{L-1}: the next token is not known)
    S'_0 = S_0 + (1 - trap_0) dt_0 sum_r v_prev,r k_prev,r^T,    c_t = sum_{u<=t} dt_u A_u

Within a chunk of T tokens the outputs are one masked product over the (T R) x (T R) query-key
scores (like mamba_ssm's chunk reference); between chunks one state per head is carried, the
carry at a chunk's end holding w (not gamma) at its last token, which is what the next chunk's
first token adds. The rotation is applied to q and k first, at the accumulated angle (float64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sonata.kernels.mamba3.reference import empty_state, ranked, rotate


def mamba3_chunked(q, k, x, dt, A, trap, angle, D=None, mimo_x=None, pairing="adjacent", state=None,
                   chunk_size=64):
    """reference.mamba3_ref's result in chunks of `chunk_size` score rows (chunk_size // R
    tokens, at least 1) -> y (b, L, R, h, p), the final state."""
    b, L, R, h, n = q.shape
    p = x.shape[-1]
    Theta0, S0, kp, xp = state if state is not None else empty_state(b, R, h, p, n, angle.shape[-1], x.device,
                                                                      x.dtype)
    Theta = Theta0[:, None] + torch.cumsum(angle.to(torch.float64), dim=1)         # (b, L, h, m)
    th = Theta[:, :, None]
    qr, kr = rotate(q, th, pairing), rotate(k, th, pairing)                       # (b, L, R, h, n)
    v = ranked(x, mimo_x)                                                          # (b, L, R, h, p)
    if trap is None:
        trap = torch.ones_like(dt)
    gamma = trap * dt
    shifted = F.pad(((1 - trap) * dt)[:, 1:], (0, 0, 0, 1))                      # (b, L, h)
    w = gamma + shifted
    carry = S0 + ((1 - trap[:, 0]) * dt[:, 0])[..., None, None] * torch.einsum("brhn,brhp->bhpn", kp,
                                                                                ranked(xp, mimo_x))
    adt = dt * A
    # a chunk of T tokens is a (T R) x (T R) product: R tokens' worth of rows per token, so the
    # chunk holds chunk_size / R tokens (chunk_size rows, as mamba_ssm's MIMO chunks do); the
    # work within a chunk grows with T R^2 per token, the carry between chunks with R alone
    T = max(1, min(chunk_size // R, L))
    nc = -(-L // T)
    pad = nc * T - L

    def chunks(t):                                                                 # (b, L, ...) -> (b, nc, T, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t
        return t.reshape(b, nc, T, *t.shape[2:])

    def heads_first(t):                         # (b, L, R, h, e) -> (b, nc, h, T R, e), rows (t, r)
        t = chunks(t)
        return t.permute(0, 1, 4, 2, 3, 5).reshape(b, nc, h, T * R, t.shape[-1])

    qh, kh, vh = heads_first(qr), heads_first(kr), heads_first(v)
    adt_c, w_c, g_c = (chunks(t).transpose(2, 3) for t in (adt, w, gamma))      # (b, nc, h, T)
    cs = torch.cumsum(adt_c, dim=-1)
    seg = cs[..., :, None] - cs[..., None, :]                                    # (b, nc, h, t, s)
    idx = torch.arange(T, device=x.device)
    below = idx[:, None] > idx[None, :]
    Lm = torch.exp(seg.masked_fill(~below, float("-inf"))) * w_c[..., None, :] + torch.diag_embed(g_c)
    scores = (qh @ kh.transpose(-1, -2)).view(b, nc, h, T, R, T, R) * Lm[:, :, :, :, None, :, None]
    y = scores.view(b, nc, h, T * R, T * R) @ vh                                 # within each chunk

    def per_row(t):                             # (b, nc, h, T) -> (b, nc, h, T R, 1)
        return t.repeat_interleave(R, dim=-1)[..., None]

    # each chunk's own contribution to the state at its end, then the carried states
    own = vh.transpose(-1, -2) @ (kh * per_row(torch.exp(cs[..., -1:] - cs) * w_c))   # (b, nc, h, p, n)
    whole = torch.exp(cs[..., -1])                                               # (b, nc, h)
    starts = []
    for c in range(nc):
        starts.append(carry)
        carry = whole[:, c, :, None, None] * carry + own[:, c]
    Sin = torch.stack(starts, 1)                                                 # (b, nc, h, p, n)
    y = y + (qh @ Sin.transpose(-1, -2)) * per_row(torch.exp(cs))
    y = y.view(b, nc, h, T, R, p).permute(0, 1, 3, 4, 2, 5).reshape(b, nc * T, R, h, p)[:, :L]
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * v
    return y, (Theta[:, -1], carry, kr[:, -1], x[:, -1])


__all__ = ["mamba3_chunked"]
