"""The state-space dual (SSD, Mamba-2) in plain PyTorch: the oracle and the readable forms.

Mamba-2's layer is a selective scan whose state transition is one scalar per head and per
step. With mamba_ssm's shapes and meaning (`mamba_chunk_scan_combined`):

    x (b, l, h, p)   dt (b, l, h)   A (h,)   B, C (b, l, g, n)   (h a multiple of g: head i
    reads group i // (h // g))
    dt  <- dt + dt_bias;  softplus(dt) if dt_softplus;  clamp(dt, *dt_limit) if a limit is set
    S_t  = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T              # state S (b, h, p, n)
    y_t  = S_t C_t + D x_t                                   # D (h,) or (h, p)
    out  = y * silu(z)                                       (z (b, l, h, p), optional)

`initial_states` (b, h, p, n) is S before the first step (zeros when None); the final
state is S after the last. `seq_idx` (b, l) integers marks packed sequences: where it
changes between t-1 and t the state is reset to zero before step t, so nothing of one
sequence reaches the next (the initial state reaches only the first).

`ssd_recurrent_ref` is the sequential recurrence, in float64 when given float64: the test
oracle. `ssd_chunked_ref` is the paper's chunked form (matrix multiplies inside chunks of
`chunk_size`, a short recurrence over the chunks' states), written for reading; both take
the same arguments and autograd flows through both.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sonata.kernels.dispatch import compute_dtype


def prepare_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """The step sizes the recurrence uses: bias, softplus (mamba_ssm's: identity above 20),
    then the clamp to dt_limit when it is not (0, inf)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def expand_groups(M, nheads: int):
    """B or C (b, l, g, n) -> (b, l, h, n): each head reads its group's row."""
    g = M.shape[2]
    if nheads % g:
        raise ValueError(f"ssd: {nheads} heads cannot share {g} groups of B and C")
    return M.repeat_interleave(nheads // g, dim=2)


def boundaries(seq_idx, L: int, device) -> torch.Tensor | None:
    """(b, l) booleans, True at t where a new packed sequence starts (t > 0 only); None when
    seq_idx is None."""
    if seq_idx is None:
        return None
    starts = torch.zeros(seq_idx.shape, dtype=torch.bool, device=device)
    if L > 1:
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return starts


def _finish(y, x, D, z):
    if D is not None:
        Dx = D.to(y.dtype)
        y = y + x * (Dx[None, None, :, None] if Dx.dim() == 1 else Dx[None, None])
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def _inputs(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit):
    ct = compute_dtype(x.dtype)
    h = x.shape[2]
    x, dt, A = x.to(ct), dt.to(ct), A.to(ct)
    dt = prepare_dt(dt, None if dt_bias is None else dt_bias.to(ct), dt_softplus, dt_limit)
    return ct, x, dt, A, expand_groups(B.to(ct), h), expand_groups(C.to(ct), h)


def ssd_recurrent_ref(x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None,
                      initial_states=None, seq_idx=None, dt_softplus=False,
                      dt_limit=(0.0, math.inf), return_final_states=False):
    """The recurrence step by step (chunk_size is accepted and ignored). Returns out
    (b, l, h, p) in x's dtype, and the final state (b, h, p, n) in the arithmetic dtype."""
    out_dtype = x.dtype
    ct, xc, dtc, Ac, Bh, Ch = _inputs(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    b, L, h, p = x.shape
    n = B.shape[-1]
    S = (initial_states.to(ct) if initial_states is not None
         else xc.new_zeros(b, h, p, n))
    starts = boundaries(seq_idx, L, x.device)
    ys = []
    for t in range(L):
        decay = torch.exp(dtc[:, t] * Ac)                                   # (b, h)
        if starts is not None:
            decay = torch.where(starts[:, t, None], torch.zeros_like(decay), decay)
        S = decay[..., None, None] * S + (dtc[:, t, :, None] * xc[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
    y = torch.stack(ys, dim=1) if L else xc.new_zeros(b, 0, h, p)
    out = _finish(y, xc, D, z).to(out_dtype)
    return (out, S) if return_final_states else out


def segsum(a):
    """a (..., T) -> (..., T, T): entry [i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the
    diagonal; exp of it is the causal decay matrix from step j to step i. Summed segment by
    segment (not as a difference of cumulative sums), so it stays exact for long chunks."""
    T = a.shape[-1]
    rep = a[..., None, :].expand(*a.shape[:-1], T, T).transpose(-1, -2)    # [i, j] = a[i]
    strict = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    out = torch.cumsum(rep.masked_fill(~strict, 0.0), dim=-2)
    return out.masked_fill(~strict.logical_or(torch.eye(T, dtype=torch.bool, device=a.device)), -math.inf)


def ssd_chunked_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                    initial_states=None, seq_idx=None, dt_softplus=False,
                    dt_limit=(0.0, math.inf), return_final_states=False):
    """The chunked form (Mamba-2 paper, section 6): within a chunk of Q steps the output is
    the masked quadratic form (C B^T o decay) x; each chunk's state is B^T (decay o x); the
    chunk states pass through a recurrence of one decay per chunk; each chunk reads the state
    it starts from through C. A length that is not a multiple of Q is padded with dt = 0
    (decay 1, input 0), which changes nothing. A reset (seq_idx) zeroes every decay that
    crosses the step where a sequence starts (a mask, never -inf in a sum)."""
    out_dtype = x.dtype
    ct, xc, dtc, Ac, Bh, Ch = _inputs(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    b, L, h, p = x.shape
    n = B.shape[-1]
    Q = int(chunk_size)
    pad = (-L) % Q
    a = dtc * Ac                                                            # (b, l, h) log decays
    starts = boundaries(seq_idx, L, x.device)
    xdt = xc * dtc[..., None]

    def chunks(t):                        # (b, l, ...) -> (b, c, Q, ...), zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, -1, Q, *t.shape[2:])

    xq, Bq, Cq = chunks(xdt), chunks(Bh), chunks(Ch)                        # (b, c, Q, h, .)
    aq = chunks(a).permute(0, 3, 1, 2)                                      # (b, h, c, Q)
    a_cum = torch.cumsum(aq, dim=-1)                                        # (b, h, c, Q)
    # resets: r counts the sequence starts in the chunk up to each step; a decay from step
    # j to step i crosses a start exactly when r_i != r_j (all ones without seq_idx)
    if starts is None:
        same = lambda ri, rj: 1.0                                           # noqa: E731
        r = None
    else:
        r = torch.cumsum(chunks(starts.to(ct)), dim=-1)[:, None]            # (b, 1, c, Q)
        same = lambda ri, rj: (ri == rj).to(ct)                             # noqa: E731
    # 1. inside each chunk: the masked quadratic (attention-like) form
    Ldec = torch.exp(segsum(aq))                                            # (b, h, c, Q, Q)
    if r is not None:
        Ldec = Ldec * same(r[..., :, None], r[..., None, :])
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cq, Bq, Ldec, xq)
    # 2. each chunk's state from its own inputs, decayed to the chunk's end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                             # (b, h, c, Q)
    if r is not None:
        to_end = to_end * same(r[..., -1:], r)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bq, to_end, xq)        # (b, c, h, p, n)
    # 3. the recurrence over chunks: the state each chunk starts from
    S0 = (initial_states.to(ct) if initial_states is not None
          else xc.new_zeros(b, h, p, n))
    chunk_decay = torch.exp(a_cum[..., -1])                                 # (b, h, c)
    if r is not None:
        chunk_decay = chunk_decay * same(r[..., -1], 0.0)
    S, starts_of = S0, []
    for c in range(states.shape[1]):
        starts_of.append(S)
        S = chunk_decay[:, :, c, None, None] * S + states[:, c]
    prev = torch.stack(starts_of, dim=1)                                    # (b, c, h, p, n)
    # 4. each position reads the chunk's starting state through C, decayed to it
    from_start = torch.exp(a_cum)                                           # (b, h, c, Q)
    if r is not None:
        from_start = from_start * same(r, 0.0)
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cq, prev, from_start)
    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :L]
    out = _finish(y, xc, D, z).to(out_dtype)
    return (out, S) if return_final_states else out
