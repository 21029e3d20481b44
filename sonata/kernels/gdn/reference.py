"""The gated delta rule (Gated DeltaNet; Yang, Kautz and Hatamizadeh, ICLR 2025) in plain
PyTorch: the oracle, the chunked training form and the one-token step.

Shapes and meaning are fla's `chunk_gated_delta_rule` (and Qwen3-Next's layer):

    q, k (b, l, hk, dk)   v (b, l, h, dv)   g, beta (b, l, h)   state S (b, h, dk, dv)
    (h a multiple of hk: value head i reads key head i // (h // hk), as Mamba-2's heads read
    their group of B and C)
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T      the delta rule, gated
    o_t = scale S_t^T q_t                                                     scale: dk^-0.5 if None

g is a log decay (<= 0 in the layer: -exp(A_log) softplus(a + dt_bias)), beta in (0, 1) the
write strength. The caller normalises q and k (the layer L2-normalises them; the kernel takes
them as they come). `initial_state` is S before the first step (zeros when None); the final
state is S after the last, in the arithmetic dtype (float32, or float64 for float64 inputs).

`gdn_recurrent_ref` is the recurrence step by step, in float64 when given float64: the test
oracle. `gdn_chunked_ref` is the chunked (WY) form used for training: within a chunk of C
tokens the C delta-rule writes are one triangular solve (the UT transform: the writes' pseudo
values U solve (I + A) U = beta V - beta exp(gamma) K S0, A strictly lower triangular with
A_ij = beta_i exp(gamma_i - gamma_j) k_i . k_j, gamma the in-chunk cumulative log decay),
so the chunk's outputs and its end state are matrix multiplies; a short loop carries the
state from chunk to chunk. Autograd flows through both (torch's solve_triangular has its
backward). A length that is not a multiple of C is padded with g = 0, beta = 0, k = 0 (decay 1,
no write), which changes neither the outputs kept nor the final state.

`gdn_step_ref` is one token with the state updated in place (decoding), in torch ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sonata.kernels.dispatch import compute_dtype


def expand_heads(t, nheads: int):
    """q or k (b, l, hk, dk) -> (b, l, h, dk): each value head reads its key head."""
    hk = t.shape[2]
    if nheads % hk:
        raise ValueError(f"gdn: {nheads} value heads cannot share {hk} key heads")
    return t if hk == nheads else t.repeat_interleave(nheads // hk, dim=2)


def default_scale(q) -> float:
    return q.shape[-1] ** -0.5


def l2norm(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last dimension: fla's and transformers' q, k norm."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _inputs(q, k, v, g, beta):
    ct = compute_dtype(v.dtype)
    h = v.shape[2]
    return (ct, expand_heads(q.to(ct), h), expand_heads(k.to(ct), h), v.to(ct), g.to(ct), beta.to(ct))


def gdn_recurrent_ref(q, k, v, g, beta, scale=None, initial_state=None, return_final_state=False,
                      chunk_size=None):
    """The recurrence step by step (chunk_size accepted and ignored). -> o (b, l, h, dv) in v's
    dtype [, the final state (b, h, dk, dv) in the arithmetic dtype]."""
    ct, qc, kc, vc, gc, bc = _inputs(q, k, v, g, beta)
    b, L, h, dv = v.shape
    dk = q.shape[-1]
    scale = default_scale(q) if scale is None else scale
    S = initial_state.to(ct) if initial_state is not None else vc.new_zeros(b, h, dk, dv)
    outs = []
    for t in range(L):
        S = torch.exp(gc[:, t])[..., None, None] * S                          # (b, h, dk, dv)
        pred = torch.einsum("bhkv,bhk->bhv", S, kc[:, t])                    # what S reads at k_t
        u = bc[:, t, :, None] * (vc[:, t] - pred)                             # the correction
        S = S + kc[:, t, :, :, None] * u[:, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, qc[:, t]))
    o = torch.stack(outs, dim=1) if L else vc.new_zeros(b, 0, h, dv)
    o = o.to(v.dtype)
    return (o, S) if return_final_state else o


def gdn_chunked_ref(q, k, v, g, beta, scale=None, initial_state=None, return_final_state=False,
                    chunk_size=64):
    """The chunked WY form (module docstring); the same arguments and results as
    `gdn_recurrent_ref`."""
    ct, qc, kc, vc, gc, bc = _inputs(q, k, v, g, beta)
    b, L, h, dv = v.shape
    dk = q.shape[-1]
    scale = default_scale(q) if scale is None else scale
    S = initial_state.to(ct) if initial_state is not None else vc.new_zeros(b, h, dk, dv)
    if L == 0:
        o = v.new_zeros(b, 0, h, dv)
        return (o, S) if return_final_state else o
    C = int(chunk_size)
    pad = (-L) % C

    def chunks(t):                         # (b, l, h, ...) -> (b, h, n, C, ...), zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        t = t.reshape(b, -1, C, *t.shape[2:])                                 # (b, n, C, h, ...)
        return t.movedim(3, 1)

    qq, kq, vq = chunks(qc * scale), chunks(kc), chunks(vc)                  # (b, h, n, C, d)
    gq, bq = chunks(gc), chunks(bc)                                           # (b, h, n, C)
    gam = torch.cumsum(gq, dim=-1)                                            # in-chunk log decay
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    # decay from token j to token i of a chunk (j <= i), zero above the diagonal; masked before
    # the exp so that no positive difference overflows
    decay = torch.exp((gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")))
    kk = kq @ kq.transpose(-1, -2)                                            # (b, h, n, C, C)
    A = (bq[..., :, None] * kk * decay).tril(-1)                              # strictly lower
    eye = torch.eye(C, dtype=ct, device=v.device)
    T = A + eye
    # the UT transform: U = W - Kd S0 with W = (I + A)^-1 beta V, Kd = (I + A)^-1 beta exp(gam) K
    W = torch.linalg.solve_triangular(T, bq[..., None] * vq, upper=False, unitriangular=True)
    Kd = torch.linalg.solve_triangular(T, (bq * torch.exp(gam))[..., None] * kq, upper=False,
                                       unitriangular=True)
    attn = (qq @ kq.transpose(-1, -2)) * decay                                # (b, h, n, C, C), j <= i
    q_in = qq * torch.exp(gam)[..., None]                                     # reads S0, decayed to i
    k_out = kq * torch.exp(gam[..., -1:] - gam)[..., None]                    # writes, decayed to the end
    end = torch.exp(gam[..., -1])                                             # (b, h, n)
    outs = []
    for c in range(gq.shape[2]):
        U = W[:, :, c] - Kd[:, :, c] @ S                                      # (b, h, C, dv)
        outs.append(q_in[:, :, c] @ S + attn[:, :, c] @ U)
        S = end[:, :, c, None, None] * S + k_out[:, :, c].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(b, h, -1, dv)[:, :, :L].transpose(1, 2)
    o = o.to(v.dtype)
    return (o, S) if return_final_state else o


def check_step(state, q, k, v, g, beta):
    """ValueError naming the first argument of a step whose shape does not fit the state."""
    if state.dim() != 4:
        raise ValueError(f"gdn step: state must be (batch, heads, dk, dv), got {tuple(state.shape)}")
    b, h, dk, dv = state.shape
    for name, t, want in (("v", v, (b, h, dv)), ("g", g, (b, h)), ("beta", beta, (b, h))):
        if tuple(t.shape) != want:
            raise ValueError(f"gdn step: {name} must be {want} for state {tuple(state.shape)}, got {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3 or t.shape[0] != b or t.shape[2] != dk or h % t.shape[1]:
            raise ValueError(f"gdn step: {name} must be (batch, key heads, dk) = ({b}, hk, {dk}) with {h} "
                             f"heads a multiple of hk, got {tuple(t.shape)}")


def gdn_step_ref(state, q, k, v, g, beta, scale=None):
    """One token: q, k (b, hk, dk), v (b, h, dv), g, beta (b, h) -> o (b, h, dv) in v's dtype;
    `state` (b, h, dk, dv) is updated in place (arithmetic in its dtype, at least float32)."""
    check_step(state, q, k, v, g, beta)
    ct = torch.float64 if state.dtype == torch.float64 else torch.float32
    h = state.shape[1]
    scale = default_scale(q) if scale is None else scale
    qc, kc = (t.to(ct).repeat_interleave(h // t.shape[1], dim=1) for t in (q, k))
    S = state.to(ct) * torch.exp(g.to(ct))[..., None, None]
    u = beta.to(ct)[..., None] * (v.to(ct) - torch.einsum("bhkv,bhk->bhv", S, kc))
    S = S + kc[..., None] * u[:, :, None, :]
    state.copy_(S)
    return (scale * torch.einsum("bhkv,bhk->bhv", S, qc)).to(v.dtype)


__all__ = ["check_step", "default_scale", "expand_heads", "gdn_chunked_ref", "gdn_recurrent_ref", "gdn_step_ref",
           "l2norm"]
