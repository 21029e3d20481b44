"""Triton SSD kernels, part 1: the shared device helpers and the four forward kernels.

The algorithm, the grid, the layouts and the precision rules are explained once, in the
docstring of sonata/kernels/ssd/triton.py (which launches these kernels). In short, per
batch b, chunk c of Q steps and head h, with a_t = dt_t A_h the log-decays:

    dt_kernel           dt_t (bias, softplus, clamp; 0 past L) and the chunk decay G_c
    chunk_state_kernel  the chunk's own state  sum_j exp(a_{j+1} + .. + a_end) dt_j x_j B_j^T
    state_pass_kernel   S_{c+1} = G_c S_c + state_c from the initial state: each chunk's start
    chunk_scan_kernel   y_i = sum_{j<=i} (C_i.B_j) exp(a_{j+1} + .. + a_i) dt_j x_j
                               + exp(a_0 + .. + a_i) S_c C_i + D x_i, then y * silu(z)
"""
from __future__ import annotations

import triton
import triton.language as tl


def _helper(fn):
    """`triton.jit` for a device function, except under the interpreter: there the helpers
    run as plain Python inside the interpreted kernel (the interpreter re-patches
    triton.language on every device-function call, which dominates its run time)."""
    return fn if triton.knobs.runtime.interpret else triton.jit(fn)


# --------------------------------------------------------------------------- device helpers

@_helper
def load_tile(PTR, offs, mask, ACC: tl.constexpr):
    """Masked load converted to the accumulation dtype before any arithmetic (0 off the mask)."""
    return tl.load(PTR + offs, mask=mask, other=0.0).to(ACC)


@_helper
def mm(a, b, ACC: tl.constexpr):
    """a @ b in ACC (IEEE float32, or float64): no TF32 rounding of the operands."""
    return tl.dot(a, b, input_precision="ieee", out_dtype=ACC)


@_helper
def sigmoid(x):
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@_helper
def _softplus(x):
    """log(1 + exp(x)), or x above 20 (torch's and mamba_ssm's threshold); log1p by Kahan's
    trick so that a tiny exp(x) is not lost."""
    e = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + e
    lp = tl.where(w == 1.0, e, tl.log(w) * (e / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.where(x > 20.0, x, lp)


@_helper
def _dt_value(raw, lo, hi, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """The step size from dt + dt_bias: softplus, then the clamp to [lo, hi]."""
    dt = raw
    if SOFTPLUS:
        dt = _softplus(raw)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, lo), hi)
    return dt


@_helper
def dt_chain(raw, g, lo, hi, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """d Loss / d raw from g = d Loss / d dt, through _dt_value (torch's conventions: the
    clamp passes the gradient on [lo, hi] inclusive; softplus' slope is 1 above 20)."""
    v = raw
    if SOFTPLUS:
        v = _softplus(raw)
        g = g * tl.where(raw > 20.0, 1.0, sigmoid(raw))
    if HAS_LIMIT:
        g = tl.where((v >= lo) & (v <= hi), g, 0.0)
    return g


@_helper
def chunk_lanes(c, chunk, L, BLOCK_Q: tl.constexpr):
    """(t, real): the time index of each of the chunk's BLOCK_Q lanes, and which lanes are
    steps (lane < chunk and t < L); the others are padding, loaded as zeros."""
    q = tl.arange(0, BLOCK_Q)
    t = c * chunk + q
    return t, (q < chunk) & (t < L)


@_helper
def group_offsets(b, t, h, L, H, N, heads_per_group, offs_n):
    """(Q, N_PAD) offsets of B[b, t, g] or C[b, t, g] for head h (group g = h // (h/g))."""
    row = (b * L + t) * (H // heads_per_group) + h // heads_per_group
    return row[:, None] * N + offs_n[None, :]


@_helper
def reset_counts(RST, b, c, chunk, L, t, real, HAS_SEQ: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(r, r_prev, r_end): RST[b, t] counts the sequence starts at or before t, so a decay
    from step j to step i survives exactly when r_i == r_j. r_prev is the count before the
    chunk (0 for the first), r_end the count at its last real step. All zeros without
    seq_idx, so every comparison is true."""
    if HAS_SEQ:
        row = b * L
        r = tl.load(RST + row + t, mask=real, other=0)
        s = c * chunk
        r_prev = tl.where(s > 0, tl.load(RST + row + tl.maximum(s - 1, 0)), 0)
        r_end = tl.load(RST + row + tl.minimum(s + chunk, L) - 1)
    else:
        r = tl.zeros([BLOCK_Q], dtype=tl.int32)
        r_prev = 0
        r_end = 0
    return r, r_prev, r_end


@_helper
def decay_from_start(a, keep):
    """exp(a_0 + .. + a_i): from the state the chunk starts from to step i (0 across a reset)."""
    return tl.where(keep, tl.exp(tl.cumsum(a, 0)), 0.0)


@_helper
def decay_to_end(a, keep):
    """exp(a_{j+1} + .. + a_end): from step j to the chunk's end (0 across a reset). Summed
    from the end (a reverse cumulative sum), not as a difference of prefix sums."""
    return tl.where(keep, tl.exp(tl.cumsum(a, 0, reverse=True) - a), 0.0)


@_helper
def segment_decay(a, r, BLOCK_Q: tl.constexpr):
    """(Q, Q) causal decay matrix: [i, j] = exp(a_{j+1} + .. + a_i) for j <= i in the same
    sequence, else 0. Each segment is summed directly (a cumulative sum down the columns of
    a masked copy of a), so long chunks keep full precision."""
    i = tl.arange(0, BLOCK_Q)[:, None]
    j = tl.arange(0, BLOCK_Q)[None, :]
    seg = tl.cumsum(tl.where(i > j, a[:, None], 0.0), 0)
    keep = (j <= i) & (r[:, None] == r[None, :])
    return tl.where(keep, tl.exp(seg), 0.0)


# --------------------------------------------------------------------------- forward kernels

@triton.jit
def dt_kernel(
    DT_IN, DT_BIAS, A, RST,                       # inputs: dt (b, l, h), dt_bias, A (h,), resets
    DT, G,                                        # outputs: dt (b, h, l) ACC, G (b, h, n_chunks)
    L, H, chunk, n_chunks, lo, hi,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_SEQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr,
):
    """grid (b, n_chunks, cdiv(h, BLOCK_H)): tile (BLOCK_Q steps, BLOCK_H heads)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    t, real = chunk_lanes(c, chunk, L, BLOCK_Q)
    m = real[:, None] & mask_h[None, :]
    raw = load_tile(DT_IN, (b * L + t)[:, None] * H + offs_h[None, :], m, ACC)
    if HAS_BIAS:
        raw = raw + load_tile(DT_BIAS, offs_h, mask_h, ACC)[None, :]
    dt = tl.where(m, _dt_value(raw, lo, hi, SOFTPLUS, HAS_LIMIT), 0.0)
    tl.store(DT + (b * H + offs_h[None, :]) * L + t[:, None], dt, mask=m)
    a_sum = tl.sum(dt * load_tile(A, offs_h, mask_h, ACC)[None, :], 0)          # (BLOCK_H,)
    _, r_prev, r_end = reset_counts(RST, b, c, chunk, L, t, real, HAS_SEQ, BLOCK_Q)
    g = tl.where(r_end == r_prev, tl.exp(a_sum), 0.0)
    tl.store(G + (b * H + offs_h) * n_chunks + c, g, mask=mask_h)


@triton.jit
def chunk_state_kernel(
    X, B, DT, A, RST,                             # x (b, l, h, p), B (b, l, g, n), dt (b, h, l)
    STATES,                                       # output (b, n_chunks, h, p, n) ACC
    L, H, P, N, chunk, n_chunks, heads_per_group, n_pblocks,
    HAS_SEQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr,
    ACC: tl.constexpr,
):
    """grid (b, n_chunks, h * n_pblocks): state_c = (decay-to-end * dt * x)^T B, one dot."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h = tl.program_id(2) // n_pblocks
    offs_p = (tl.program_id(2) % n_pblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, N_PAD)
    mask_p = offs_p < P
    mask_n = offs_n < N
    t, real = chunk_lanes(c, chunk, L, BLOCK_Q)
    dt = load_tile(DT, (b * H + h) * L + t, real, ACC)
    a = dt * tl.load(A + h).to(ACC)
    r, _, r_end = reset_counts(RST, b, c, chunk, L, t, real, HAS_SEQ, BLOCK_Q)
    e = decay_to_end(a, r == r_end)
    x = load_tile(X, ((b * L + t) * H + h)[:, None] * P + offs_p[None, :],
              real[:, None] & mask_p[None, :], ACC)                          # (Q, BLOCK_P)
    Bm = load_tile(B, group_offsets(b, t, h, L, H, N, heads_per_group, offs_n),
               real[:, None] & mask_n[None, :], ACC)                         # (Q, N_PAD)
    st = mm(tl.trans(x * (dt * e)[:, None]), Bm, ACC)                       # (BLOCK_P, N_PAD)
    offs = (((b * n_chunks + c) * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
    tl.store(STATES + offs, st, mask=mask_p[:, None] & mask_n[None, :])


@triton.jit
def state_pass_kernel(
    STATES, G, INIT,              # (b, n_chunks, h, p, n), (b, h, n_chunks), (b, h, p, n)
    START, FINAL,                 # outputs: START like STATES, FINAL like INIT (ACC)
    H, P, N, n_chunks, n_pblocks,
    HAS_INIT: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr, ACC: tl.constexpr,
):
    """grid (b, h, n_pblocks): the sequential recurrence over chunks, one state tile held."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, N_PAD)
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    own = ((b * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
    if HAS_INIT:
        S = load_tile(INIT, own, mask, ACC)
    else:
        S = tl.zeros((BLOCK_P, N_PAD), dtype=ACC)
    for c in range(n_chunks):
        offs = (((b * n_chunks + c) * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
        tl.store(START + offs, S, mask=mask)
        S = tl.load(G + (b * H + h) * n_chunks + c) * S + load_tile(STATES, offs, mask, ACC)
    tl.store(FINAL + own, S, mask=mask)


@triton.jit
def chunk_scan_kernel(
    X, B, C, D, Z, DT, A, RST, START,             # inputs
    OUT, Y,                                       # out (b, l, h, p) x's dtype; Y: y before the gate
    L, H, P, N, chunk, n_chunks, heads_per_group, n_pblocks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_SEQ: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr, ACC: tl.constexpr,
):
    """grid (b, n_chunks, h * n_pblocks): the chunk's outputs for BLOCK_P channels, 3 dots."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h = tl.program_id(2) // n_pblocks
    offs_p = (tl.program_id(2) % n_pblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, N_PAD)
    mask_p = offs_p < P
    mask_n = offs_n < N
    t, real = chunk_lanes(c, chunk, L, BLOCK_Q)
    dt = load_tile(DT, (b * H + h) * L + t, real, ACC)
    a = dt * tl.load(A + h).to(ACC)
    r, r_prev, _ = reset_counts(RST, b, c, chunk, L, t, real, HAS_SEQ, BLOCK_Q)
    w = decay_from_start(a, r == r_prev)                                     # (Q,)
    decay = segment_decay(a, r, BLOCK_Q)                                     # (Q, Q)

    mqp = real[:, None] & mask_p[None, :]
    mqn = real[:, None] & mask_n[None, :]
    xo = ((b * L + t) * H + h)[:, None] * P + offs_p[None, :]
    go = group_offsets(b, t, h, L, H, N, heads_per_group, offs_n)
    x = load_tile(X, xo, mqp, ACC)                                                # (Q, BLOCK_P)
    Bm = load_tile(B, go, mqn, ACC)                                               # (Q, N_PAD)
    Cm = load_tile(C, go, mqn, ACC)
    so = (((b * n_chunks + c) * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
    S0 = load_tile(START, so, mask_p[:, None] & mask_n[None, :], ACC)             # (BLOCK_P, N_PAD)

    scores = mm(Cm, tl.trans(Bm), ACC) * decay * dt[None, :]                 # (Q, Q)
    y = mm(scores, x, ACC) + w[:, None] * mm(Cm, tl.trans(S0), ACC)         # (Q, BLOCK_P)
    if HAS_D:
        y += load_tile(D, h * P + offs_p, mask_p, ACC)[None, :] * x
    if HAS_Z:
        tl.store(Y + xo, y, mask=mqp)
        z = load_tile(Z, xo, mqp, ACC)
        y = y * z * sigmoid(z)
    tl.store(OUT + xo, y.to(OUT.dtype.element_ty), mask=mqp)
