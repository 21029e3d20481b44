"""Triton SSD kernels, part 2: the three backward kernels (derivation in triton.py's docstring).

    dstate_kernel          E_c = sum_i exp(a_0 + .. + a_i) dy_i C_i^T: what chunk c's outputs
                            ask of the state it starts from
    state_pass_bwd_kernel  the reverse recurrence dS_c = G_c dS_{c+1} + E_c from dfinal;
                            stores dS_{c+1} (the gradient of chunk c's own state) and the
                            per-tile partials of dG_c = <dS_{c+1}, S_c>
    chunk_bwd_kernel       everything local to one chunk: dx, dz, dD, dB, dC (per head),
                            and the log-decay gradient -> ddt, dA, ddt_bias
"""
from __future__ import annotations

import triton
import triton.language as tl

from sonata.kernels.ssd.triton_fwd import (
    chunk_lanes,
    decay_from_start,
    decay_to_end,
    dt_chain,
    group_offsets,
    load_tile,
    mm,
    reset_counts,
    segment_decay,
    sigmoid,
)


@triton.jit
def dstate_kernel(
    DOUT, Z, C, DT, A, RST,                       # inputs
    E,                                            # output (b, n_chunks, h, p, n) ACC
    L, H, P, N, chunk, n_chunks, heads_per_group, n_pblocks,
    HAS_Z: tl.constexpr, HAS_SEQ: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr, ACC: tl.constexpr,
):
    """grid (b, n_chunks, h * n_pblocks): E_c = (decay-from-start * dy)^T C, one dot."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h = tl.program_id(2) // n_pblocks
    offs_p = (tl.program_id(2) % n_pblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, N_PAD)
    mask_p = offs_p < P
    mask_n = offs_n < N
    t, real = chunk_lanes(c, chunk, L, BLOCK_Q)
    a = load_tile(DT, (b * H + h) * L + t, real, ACC) * tl.load(A + h).to(ACC)
    r, r_prev, _ = reset_counts(RST, b, c, chunk, L, t, real, HAS_SEQ, BLOCK_Q)
    w = decay_from_start(a, r == r_prev)
    mqp = real[:, None] & mask_p[None, :]
    xo = ((b * L + t) * H + h)[:, None] * P + offs_p[None, :]
    dy = load_tile(DOUT, xo, mqp, ACC)
    if HAS_Z:
        z = load_tile(Z, xo, mqp, ACC)
        dy = dy * z * sigmoid(z)
    go = group_offsets(b, t, h, L, H, N, heads_per_group, offs_n)
    Cm = load_tile(C, go, real[:, None] & mask_n[None, :], ACC)
    e_c = mm(tl.trans(dy * w[:, None]), Cm, ACC)                           # (BLOCK_P, N_PAD)
    offs = (((b * n_chunks + c) * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
    tl.store(E + offs, e_c, mask=mask_p[:, None] & mask_n[None, :])


@triton.jit
def state_pass_bwd_kernel(
    E, G, START, DFINAL,                          # inputs
    DNEXT, DG_PART, DINIT,                        # outputs (ACC)
    H, P, N, n_chunks, n_pblocks,
    HAS_INIT: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr, ACC: tl.constexpr,
):
    """grid (b, h, n_pblocks): the chunks from last to first, one gradient tile held.
    DG_PART (b, h, n_chunks, n_pblocks) holds this tile's share of dG_c; torch sums it."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, N_PAD)
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    own = ((b * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
    dS = load_tile(DFINAL, own, mask, ACC)                                        # dS_{n_chunks}
    for ci in range(n_chunks):
        c = n_chunks - 1 - ci
        offs = (((b * n_chunks + c) * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
        tl.store(DNEXT + offs, dS, mask=mask)                                 # dS_{c+1}
        s0 = load_tile(START, offs, mask, ACC)
        tl.store(DG_PART + ((b * H + h) * n_chunks + c) * n_pblocks + pb,
                 tl.sum(tl.sum(dS * s0, 1), 0))
        dS = tl.load(G + (b * H + h) * n_chunks + c) * dS + load_tile(E, offs, mask, ACC)
    if HAS_INIT:
        tl.store(DINIT + own, dS, mask=mask)                                  # dS_0


@triton.jit
def chunk_bwd_kernel(
    X, DT_IN, DT_BIAS, A, B, C, D, Z, DOUT, Y, RST, DT, G, START, DNEXT, DG,   # inputs
    DX, DZ, DDT, DB_H, DC_H, DA_PART, DD_PART, DBIAS_PART,                    # outputs
    L, H, P, N, chunk, n_chunks, heads_per_group, lo, hi,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    BLOCK_Q: tl.constexpr, P_PAD: tl.constexpr, N_PAD: tl.constexpr, ACC: tl.constexpr,
):
    """grid (b, n_chunks, h): all of the head's channels at once (dB, dC and ddt sum over
    them). dB and dC go out per head (b, l, h, n), the rest of the sums per (b, c, h)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h = tl.program_id(2)
    offs_p = tl.arange(0, P_PAD)
    offs_n = tl.arange(0, N_PAD)
    mask_p = offs_p < P
    mask_n = offs_n < N
    t, real = chunk_lanes(c, chunk, L, BLOCK_Q)
    dt = load_tile(DT, (b * H + h) * L + t, real, ACC)
    A_h = tl.load(A + h).to(ACC)
    a = dt * A_h
    r, r_prev, r_end = reset_counts(RST, b, c, chunk, L, t, real, HAS_SEQ, BLOCK_Q)
    w = decay_from_start(a, r == r_prev)                                     # (Q,)
    e = decay_to_end(a, r == r_end)                                          # (Q,)
    decay = segment_decay(a, r, BLOCK_Q)                                     # (Q, Q)

    mqp = real[:, None] & mask_p[None, :]
    mqn = real[:, None] & mask_n[None, :]
    mpn = mask_p[:, None] & mask_n[None, :]
    xo = ((b * L + t) * H + h)[:, None] * P + offs_p[None, :]
    go = group_offsets(b, t, h, L, H, N, heads_per_group, offs_n)
    x = load_tile(X, xo, mqp, ACC)                                                # (Q, P_PAD)
    Bm = load_tile(B, go, mqn, ACC)                                               # (Q, N_PAD)
    Cm = load_tile(C, go, mqn, ACC)
    so = (((b * n_chunks + c) * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
    S0 = load_tile(START, so, mpn, ACC)                                           # S_c (P_PAD, N_PAD)
    dSn = load_tile(DNEXT, so, mpn, ACC)                                          # dS_{c+1}

    dy = load_tile(DOUT, xo, mqp, ACC)
    if HAS_Z:
        z = load_tile(Z, xo, mqp, ACC)
        sz = sigmoid(z)
        dz = dy * load_tile(Y, xo, mqp, ACC) * sz * (1.0 + z * (1.0 - sz))       # d silu(z) / dz
        tl.store(DZ + xo, dz.to(DZ.dtype.element_ty), mask=mqp)
        dy = dy * z * sz

    xdt = x * dt[:, None]
    cb = mm(Cm, tl.trans(Bm), ACC)                                           # (Q, Q) C_i . B_j
    scores = cb * decay
    dscores = mm(dy, tl.trans(xdt), ACC)                                     # dy_i . xdt_j
    dcb = dscores * decay
    dseg = dscores * scores                 # d Loss / d (a_{j+1} + .. + a_i) of entry [i, j]
    bd = mm(Bm, tl.trans(dSn), ACC)                                          # (Q, P_PAD)
    dxdt = mm(tl.trans(scores), dy, ACC) + e[:, None] * bd
    de = tl.sum(xdt * bd, 1)                                                  # d Loss / d e_j
    dw = tl.sum(dy * mm(Cm, tl.trans(S0), ACC), 1)                           # d Loss / d w_i
    dC = mm(dcb, Bm, ACC) + w[:, None] * mm(dy, S0, ACC)                    # (Q, N_PAD)
    dB = mm(tl.trans(dcb), Cm, ACC) + e[:, None] * mm(xdt, dSn, ACC)
    ho = ((b * L + t) * H + h)[:, None] * N + offs_n[None, :]
    tl.store(DC_H + ho, dC, mask=mqn)
    tl.store(DB_H + ho, dB, mask=mqn)

    # Log-decay gradient. Every exponent is a sum of a_k over a range of the chunk, so
    # da_k = d Loss / d a_k collects the terms whose range holds step k, each family summed
    # directly (never a long sum minus another: triton.py's docstring says why): the
    # segments [i, j] with j < k <= i (the diagonal holds no step), w_i for i >= k, e_j for
    # j < k, and G_c (the whole chunk) for every k.
    lane_i = tl.arange(0, BLOCK_Q)[:, None]
    lane_j = tl.arange(0, BLOCK_Q)[None, :]
    tail = tl.cumsum(dseg, 0, reverse=True)                 # [k, j]: sum_{i >= k} dseg[i, j]
    da = tl.sum(tl.where(lane_j < lane_i, tail, 0.0), 1)     # pairs j < k <= i
    da += tl.cumsum(dw * w, 0, reverse=True)                 # w_i, i >= k
    da += tl.sum(tl.where(lane_j < lane_i, (de * e)[None, :], 0.0), 1)   # e_j, j < k
    da += tl.load(DG + (b * H + h) * n_chunks + c) * tl.load(G + (b * H + h) * n_chunks + c)
    part = (b * n_chunks + c) * H + h
    tl.store(DA_PART + part, tl.sum(tl.where(real, dt * da, 0.0), 0))
    ddt = tl.sum(x * dxdt, 1) + A_h * da
    raw = load_tile(DT_IN, (b * L + t) * H + h, real, ACC)
    if HAS_BIAS:
        raw += tl.load(DT_BIAS + h).to(ACC)
    ddt = tl.where(real, dt_chain(raw, ddt, lo, hi, SOFTPLUS, HAS_LIMIT), 0.0)
    tl.store(DDT + (b * L + t) * H + h, ddt.to(DDT.dtype.element_ty), mask=real)
    if HAS_BIAS:
        tl.store(DBIAS_PART + part, tl.sum(ddt, 0))

    dx = dxdt * dt[:, None]
    if HAS_D:
        dx += load_tile(D, h * P + offs_p, mask_p, ACC)[None, :] * dy
        tl.store(DD_PART + part * P + offs_p, tl.sum(dy * x, 0), mask=mask_p)
    tl.store(DX + xo, dx.to(DX.dtype.element_ty), mask=mqp)
