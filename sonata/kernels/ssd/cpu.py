"""The SSD (Mamba-2) scan on CPU: the chunked form on batched matrix multiplies and a
hand-written backward. Semantics, shapes and names are `reference.py`'s.

Blocks. Cut the (padded) sequence into blocks of Q steps. In a block let s_i be the inclusive
cumulative sum of the log-decays a = dt A, X_i = dt_i x_i (p,), G_ij = C_i . B_j (the block's
(Q, Q) matrix for the head's group: lower-triangular, zero across a seq_idx reset) and S0 the
state (p, n) the block starts from:

    y_i   = sum_{j<=i} G_ij exp(s_i - s_j) X_j  +  exp(s_i) S0 C_i        (intra + from S0)
    S_end = exp(s_Q) S0  +  sum_j exp(s_Q - s_j) X_j B_j^T                  (the next S0)

and one multiply-add per block carries S_end on. A reset zeroes every decay across it (a
mask on G and on the per-position factors, never -inf in a sum).

Factored decays. exp(s_i - s_j) = e_i f_j, e = exp(s - m), f = exp(m - s), for any m; with m
the middle of the block's range of s, e and f stay within exp(+-R/2) when the block spans R
e-folds. The intra term is then e o (G (f o X)): one (Q, Q) matrix per block and *group*,
shared by its heads, times a (Q, heads_per_group * p) matrix; no per-head (Q, Q) matrix is
ever formed. e, f, exp(s), exp(s_Q - s) come from float64 cumulative sums over (b, l, h)
numbers, so each decay is exact to a float32 rounding however long the block; factors under
1e-30 are flushed to zero (float32 denormals cost ~100x per multiply). Q = min(chunk_size,
BLOCK), evened over the sequence (L = 300 runs 5 blocks of 60, not 64 + padding); the result
does not depend on Q beyond rounding. A block spanning more than R_MAX e-folds is halved
(not below MIN_BLOCK); beyond that (decays of ~4 e-folds a step) the per-head matrices
W_ij = exp(s_i - s_j) are formed explicitly (`explicit`).

Backward. dY is the gradient of y (before D and the gate), dE that of a block's S_end (the
final state's gradient for the last block):

    dS0  = exp(s_Q) dE + sum_i exp(s_i) dY_i C_i^T                  (= dE of the block before)
    dX_j = f_j (G^T (e o dY))_j + exp(s_Q - s_j) dE B_j + G_jj dY_j
    dG   = tril((e o dY)(f o X)^T)  (summed over the group's heads by the matmul itself)
    dC   = dG B + (exp(s) o dY) S0^T,     dB = dG^T C + (exp(s_Q - s) o X) dE^T

Every decay is exp of a difference of s's, so the gradient of the log-decay a_k is the sum
of the terms whose decay spans step k, and each family reduces to per-position dot products
over p (no (Q, Q) work):

    da_k = sum_{i>=k} exp(s_i) dY_i.(C_i S0)                         S0 -> y_i
         + sum_{i>=k} e_i dY_i.(G (f o X))_i - sum_{j>=k} f_j X_j.(G^T (e o dY))_j
                                                                     pairs j < k <= i
         + sum_{j<k} exp(s_Q - s_j) X_j.(B_j dE)                     X_j -> S_end
         + exp(s_Q) <dE, S0>                                         S0 -> S_end

with G strictly lower in the pair sums (the diagonal's terms cancel exactly, so they are
left out rather than left to cancel in float32). With explicit decays the pairs are summed
directly from the per-head (Q, Q) products instead (exact where strong decays leave dA tiny).
Then dA = sum da dt, ddt = da A + x . dX, dx = dt dX + D dY, and the gate, D, dt_bias,
softplus and the clamp by the chain rule. The forward saves the inputs, the block-start
states (b, g, nc, n, heads_per_group, p) and their reads C S0 (x-sized: one of the eleven
large products the backward would otherwise redo); the backward recomputes G, y and the
rest. The elementwise passes around the matrix multiplies (output, gate, the dot products,
dx) are one fused numba pass each (`cpu_fused.py`; torch ops when numba is missing, and in
float64).

Precision. float32 arithmetic (float64 for float64 inputs: gradcheck runs). Under
torch.autocast("cpu", bfloat16) or with bfloat16 inputs the matrix multiplies take bfloat16
operands where the CPU multiplies bfloat16 natively (AVX512-BF16 / AMX), except the two whose
difference gives the pair terms of da; decays, states and sums stay float32. Without such
instructions (AVX2), PyTorch's bfloat16 GEMM measured 12-30x slower than float32 here, so the
operands stay float32 (SONATA_SSD_BF16_MATMUL=1 forces bfloat16, =0 forbids it).
Deterministic: no atomics; the same inputs and thread count give bit-identical results.
"""
from __future__ import annotations

import math
import os
from functools import cache

import torch
import torch.nn.functional as F

from sonata.kernels.dispatch import opaque
from sonata.kernels.ssd import cpu_fused
from sonata.kernels.ssd.cpu_fused import prepare_dt, prepare_dt_backward
from sonata.kernels.ssd.reference import boundaries

BLOCK = 64          # the preferred block length on CPU (the quadratic part costs ~Q per step)
MIN_BLOCK = 32      # shortest block the factored form halves down to
R_MAX = 120.0       # most e-folds one factored block may span: e, f within exp(+-60)
POISON = False      # tests: fill every preallocated buffer with NaN first


@cache
def native_bf16() -> bool:
    """Whether bfloat16 matrix multiplies should run in bfloat16 here."""
    forced = os.environ.get("SONATA_SSD_BF16_MATMUL", "")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _new(shape, like):
    t = like.new_empty(shape)
    return t.fill_(math.nan) if POISON else t


def _mm(a, b, mm_dtype):
    if mm_dtype == a.dtype:
        return torch.bmm(a, b)
    return torch.bmm(a.to(mm_dtype), b.to(mm_dtype)).to(a.dtype)


class Blocks:
    """One call's block layout. Tensors live group-major, (b, g, nc, Q, hg, ...): for g = 1
    that is the caller's (b, l, h, ...) layout itself (no copy)."""

    def __init__(self, b, L, h, p, g, n, Q, explicit=False):
        self.b, self.L, self.h, self.p, self.g, self.n = b, L, h, p, g, n
        self.nc = -(-L // Q)
        self.Q = -(-L // self.nc)
        self.Lp, self.hg = self.nc * self.Q, h // g
        self.K, self.nb, self.explicit = self.hg * p, b * g * self.nc, explicit

    def put(self, t, heads=True):
        """(b, l, h, *r) [heads] or (b, l, g, *r) -> (b, g, nc, Q, [hg,] *r), zero-padded;
        a view of t itself when nothing moves."""
        b, L, g = self.b, self.L, self.g
        inner = (self.hg,) if heads else ()
        rest = t.shape[3:]
        v = t.reshape(b, L, g, *inner, *rest).transpose(1, 2)
        if self.Lp == L and g == 1:
            return v.reshape(b, g, self.nc, self.Q, *inner, *rest)
        o = _new((b, g, self.Lp, *inner, *rest), t)
        o[:, :, :L].copy_(v)
        o[:, :, L:].zero_()
        return o.view(b, g, self.nc, self.Q, *inner, *rest)

    def take(self, t, heads=True):
        """(b, g, nc, Q, [hg,] *r) -> (b, l, h, *r) [heads] or (b, l, g, *r): the inverse of
        put (a view for g = 1)."""
        b, g = self.b, self.g
        rest = t.shape[4:]
        v = t.reshape(b, g, self.Lp, *rest)[:, :, :self.L].transpose(1, 2)
        if heads:
            return v.reshape(b, self.L, g * rest[0], *rest[1:]) if rest else v.reshape(b, self.L, g)
        return v


def decay_range(a64, Q):
    """Largest span (max s - min s, e-folds) of the cumulative log-decay in any block of Q."""
    b, L, h = a64.shape
    nc = -(-L // Q)
    Q = -(-L // nc)
    s = F.pad(a64, (0, 0, 0, nc * Q - L)).view(b, nc, Q, h).cumsum(2)
    return float((s.amax(2) - s.amin(2)).max()) if s.numel() else 0.0


def plan(a64, L, chunk_size, block=None):
    """(Q, explicit): the block length and whether the decay matrices must be explicit."""
    if block is not None:                                   # tests pin the block
        explicit = decay_range(a64, block) > R_MAX
        return block, explicit
    Q = max(1, min(int(chunk_size), BLOCK, L))
    first = Q
    while decay_range(a64, Q) > R_MAX:
        if Q <= MIN_BLOCK:
            return first, True
        Q = max(MIN_BLOCK, Q // 2)
    return Q, False


class Decays:
    """Per-position decay factors of one call, float64-exact, cast to the arithmetic dtype;
    each (b, g, nc, Q, hg) unless noted. Factors under 1e-30 are flushed to zero (float32
    denormals cost ~100x in every multiply; a decay that small is 0 to float32 precision)."""

    def __init__(self, a64, starts, blk: Blocks, ct):
        s = blk.put(a64).cumsum(3)                                        # (b, g, nc, Q, hg)
        last = s[:, :, :, -1:]                                            # (b, g, nc, 1, hg)
        fs, te, cd = torch.exp(s), torch.exp(last - s), torch.exp(last[:, :, :, 0])
        self.mask = None
        if starts is not None:
            r = F.pad(starts.to(torch.float64), (0, blk.Lp - blk.L)).view(blk.b, 1, blk.nc, blk.Q)
            r = r.cumsum(-1)                                              # (b, 1, nc, Q) resets so far
            rl = r[..., -1:]
            fs = fs * (r == 0)[..., None]
            te = te * (r == rl)[..., None]
            cd = cd * (rl == 0)
            tri = torch.ones(blk.Q, blk.Q, dtype=torch.bool, device=a64.device).tril()
            same = (r[..., :, None] == r[..., None, :]) & tri             # (b, 1, nc, Q, Q)
            self.mask = same.expand(blk.b, blk.g, blk.nc, blk.Q, blk.Q).reshape(blk.nb, blk.Q, blk.Q)
        tiny = 1e-30 if ct != torch.float64 else 1e-300
        flush = lambda t: t.masked_fill_(t < tiny, 0.0).to(ct)
        self.fs, self.te, self.cd = flush(fs), flush(te), flush(cd)       # cd (b, g, nc, hg)
        if blk.explicit:                                                  # (b, g, nc, hg, Q, Q)
            st = s.transpose(-1, -2)
            W = flush((st[..., :, None] - st[..., None, :]).exp_())
            keep = (torch.ones(blk.Q, blk.Q, dtype=torch.bool, device=a64.device).tril()
                    if self.mask is None else self.mask.view(blk.b, blk.g, blk.nc, 1, blk.Q, blk.Q))
            self.W = W.masked_fill_(~keep, 0.0)
            self.e = self.f = torch.ones_like(self.fs)
        else:
            m = (s.amax(3, keepdim=True) + s.amin(3, keepdim=True)) * 0.5
            self.e, self.f = torch.exp(s - m).to(ct), torch.exp(m - s).to(ct)

    def apply_mask(self, M):
        """Zero (nb, Q, Q) M above the diagonal and across resets, in place."""
        return M.tril_() if self.mask is None else M.masked_fill_(~self.mask, 0.0)


def _heads(t):
    """(b, g, nc, Q, hg, p) -> (b, g, nc, hg, Q, p) view."""
    return t.transpose(3, 4)


def pass_states(st, cd, init):
    """Block-start states S0 (b, g, nc, n, hg, p) and the final state from the blocks' own
    states st and their decays cd (b, g, nc, hg): S0_{c+1} = cd_c S0_c + st_c."""
    nc = st.shape[2]
    S0 = _new(st.shape, st)
    cdv = cd[:, :, :, None, :, None]                                      # (b, g, nc, 1, hg, 1)
    if init is None:
        S0[:, :, 0].zero_()
    else:
        S0[:, :, 0].copy_(init)
    for c in range(nc - 1):
        torch.addcmul(st[:, :, c], S0[:, :, c], cdv[:, :, c], out=S0[:, :, c + 1])
    return S0, torch.addcmul(st[:, :, -1], S0[:, :, -1], cdv[:, :, -1])


def pass_states_backward(U, cd, dfinal):
    """Gradients dE of every block's end state, and of the initial state: dE_{c-1} = cd_c
    dE_c + U_c, with U_c = sum_i exp(s_i) dY_i C_i^T of block c."""
    nc = U.shape[2]
    dE = _new(U.shape, U)
    cdv = cd[:, :, :, None, :, None]
    if dfinal is None:
        dE[:, :, -1].zero_()
    else:
        dE[:, :, -1].copy_(dfinal)
    for c in range(nc - 1, 0, -1):
        torch.addcmul(U[:, :, c], dE[:, :, c], cdv[:, :, c], out=dE[:, :, c - 1])
    return dE, torch.addcmul(U[:, :, 0], dE[:, :, 0], cdv[:, :, 0])


def _state_layout(S, blk):
    """(b, h, p, n) -> (b, g, n, hg, p) and back (`_state_out`)."""
    return S.reshape(blk.b, blk.g, blk.hg, blk.p, blk.n).permute(0, 1, 4, 2, 3)


def _state_out(S, blk):
    return S.permute(0, 1, 3, 4, 2).reshape(blk.b, blk.h, blk.p, blk.n)


def _v(t):
    """A per-position scalar (b, g, nc, Q, hg) broadcast over p."""
    return t[..., None]


class _Setup:
    """What forward and backward both compute from the inputs (blocked layout)."""

    def __init__(self, x, dt, A, B, C, D, dt_bias, seq_idx, softplus, limit, chunk, block, ct,
                 fixed=None):
        b, L, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        self.dte = prepare_dt(dt.to(ct), None if dt_bias is None else dt_bias.to(ct), softplus, limit)
        a64 = self.dte.to(torch.float64) * A.to(torch.float64)            # (b, l, h)
        Q, explicit = fixed if fixed is not None else plan(a64, L, chunk, block)
        self.plan = (Q, explicit)
        blk = self.blk = Blocks(b, L, h, p, g, n, Q, explicit)
        dec = self.dec = Decays(a64, boundaries(seq_idx, L, x.device), blk, ct)
        self.dt_b = blk.put(self.dte)                                     # (b, g, nc, Q, hg)
        self.xb = blk.put(x.to(ct))                                       # (b, g, nc, Q, hg, p)
        self.Xf = self.xb * _v(self.dt_b * dec.f)                         # f o X, X = dt x
        self.Bb = blk.put(B.to(ct), heads=False).reshape(blk.nb, blk.Q, n)   # (nb, Q, n)
        self.Cb = blk.put(C.to(ct), heads=False).reshape(blk.nb, blk.Q, n)
        self.Dv = None                                                    # D as (1, g, 1, 1, hg, 1|p)
        if D is not None:
            Dc = D.to(ct).reshape(g, blk.hg, -1)
            self.Dv = Dc.view(1, g, 1, 1, blk.hg, Dc.shape[-1])

    def Xt(self):
        """exp(s_Q - s) o X: each input decayed to its block's end."""
        return self.xb * _v(self.dt_b * self.dec.te)

    def gram(self, mm_dtype):
        G = _mm(self.Cb, self.Bb.transpose(1, 2), mm_dtype)              # (nb, Q, Q) C_i . B_j
        return self.dec.apply_mask(G)

    def intra(self, G, mm_dtype):
        """G (f o X) per block and group (b, g, nc, Q, hg, p); times e it is the within-block
        term. Explicit decays: (G o W) X per head (e = f = 1)."""
        blk = self.blk
        if blk.explicit:
            M = self.dec.W * G.view(blk.b, blk.g, blk.nc, 1, blk.Q, blk.Q)
            return torch.matmul(M, _heads(self.Xf)).transpose(3, 4)
        return _mm(G, self.Xf.view(blk.nb, blk.Q, blk.K), mm_dtype).view(self.Xf.shape)

    def from_states(self, S0, mm_dtype):
        """C S0 per block (b, g, nc, Q, hg, p); times exp(s) it is the read of the state."""
        blk = self.blk
        return _mm(self.Cb, S0.reshape(blk.nb, blk.n, blk.K), mm_dtype).view(self.Xf.shape)


def ssd_forward(x, dt, A, B, C, D, z, dt_bias, init, seq_idx, softplus, limit, chunk,
                mm_dtype, block=None):
    """(out (b, l, h, p) in x's dtype, final state (b, h, p, n), the block-start states S0
    (b, g, nc, n, hg, p) and their reads C S0 (b, g, nc, Q, hg, p) for the backward, the
    plan)."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    su = _Setup(x, dt, A, B, C, D, dt_bias, seq_idx, softplus, limit, chunk, block, ct)
    blk, dec = su.blk, su.dec
    G = su.gram(mm_dtype)
    st = _mm(su.Bb.transpose(1, 2), su.Xt().view(blk.nb, blk.Q, blk.K), mm_dtype)   # (nb, n, K)
    st = st.view(blk.b, blk.g, blk.nc, blk.n, blk.hg, blk.p)
    S0, final = pass_states(st, dec.cd, None if init is None else _state_layout(init.to(ct), blk))
    raw_o = su.from_states(S0, mm_dtype)
    y = cpu_fused.output(su, raw_o, su.intra(G, mm_dtype), z)
    return blk.take(y).to(x.dtype), _state_out(final, blk), S0, raw_o, su.plan


def _revcum(t, dim):
    """sum over i >= k along dim."""
    return t.flip(dim).cumsum(dim).flip(dim)


def _per_head(t, blk):
    """(g, hg, ...) -> (h, ...)."""
    return t.reshape(blk.h, *t.shape[2:])


def ssd_backward(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, init, seq_idx, S0, raw_o, softplus,
                 limit, chunk, mm_dtype, fixed):
    """Gradients (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit), each None when its input is.
    raw_o: the forward's C S0 (the same product, so the same bits), or None to recompute it."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    f64 = torch.float64
    su = _Setup(x, dt, A, B, C, D, dt_bias, seq_idx, softplus, limit, chunk, None, ct, fixed)
    blk, dec = su.blk, su.dec
    nb, Q, n, K = blk.nb, blk.Q, blk.n, blk.K
    xb, dt_b, shape6 = su.xb, su.dt_b, su.Xf.shape                       # (b, g, nc, Q, hg, p)
    # the recomputed output, its diagonal (j = i) terms apart: G strictly lower from here on
    G = su.gram(mm_dtype)
    Gd = G.diagonal(dim1=1, dim2=2).clone().view(blk.b, blk.g, blk.nc, Q, 1)
    G.diagonal(dim1=1, dim2=2).zero_()
    if raw_o is None:
        raw_o = su.from_states(S0, mm_dtype)                              # C S0
    # raw_y and raw_s feed the log-decay gradient as a difference: both stay in ct, so a pair's
    # two roundings match (bfloat16 operands there cost ~10x in dA)
    raw_y = su.intra(G, ct)                                               # G (f o X), strict
    dout_b = blk.put(dout.to(ct) if dout is not None else torch.zeros_like(x, dtype=ct))
    dYb, dz, dYfs, dYe, d_o, d_y, x_y = cpu_fused.gate(su, raw_o, raw_y, Gd, z, dout_b)
    if dz is not None:
        dz = blk.take(dz).to(z.dtype)
    dYfs, dYe = dYfs.view(nb, Q, K), dYe.view(nb, Q, K)
    U = _mm(su.Cb.transpose(1, 2), dYfs, mm_dtype).view(S0.shape)       # (b, g, nc, n, hg, p)
    dE, dinit = pass_states_backward(
        U, dec.cd, None if dfinal is None else _state_layout(dfinal.to(ct), blk))
    dE3 = dE.view(nb, n, K)
    raw_e = _mm(su.Bb, dE3, mm_dtype).view(shape6)                        # B dE
    Xf3 = su.Xf.view(nb, Q, K)
    if blk.explicit:
        M = dec.W * G.view(blk.b, blk.g, blk.nc, 1, Q, Q)
        raw_s = torch.matmul(M.transpose(-1, -2), _heads(dYb)).transpose(3, 4)
        WP = torch.matmul(_heads(dYb), _heads(su.Xf).transpose(-1, -2)).mul_(dec.W)   # per head
        dG = WP.sum(3).view(nb, Q, Q)
        # the pairs j < k <= i summed directly (exact where strong decays make dA tiny)
        c = (WP * G.view(blk.b, blk.g, blk.nc, 1, Q, Q)).to(f64)
        pair_da = _revcum(c.cumsum(-1) - c, -2).diagonal(dim1=-2, dim2=-1).transpose(-1, -2)
    else:
        raw_s = _mm(G.transpose(1, 2), dYe, ct).view(shape6)              # G^T (e o dY)
        dG = _mm(dYe, Xf3.transpose(1, 2), mm_dtype)
    dG = dec.apply_mask(dG)                                               # (nb, Q, Q), diagonal kept
    dC = _mm(dG, su.Bb, mm_dtype).add_(_mm(dYfs, S0.reshape(nb, n, K).transpose(1, 2), mm_dtype))
    dB = _mm(dG.transpose(1, 2), su.Cb, mm_dtype).add_(
        _mm(su.Xt().view(nb, Q, K), dE3.transpose(1, 2), mm_dtype))
    # dX = f o raw_s + te o raw_e + Gd dY; the log-decays from per-position dot products,
    # each summed over the steps its decay spans (so no large sums cancel): S0 -> y_i (i >= k),
    # pairs j < k <= i, X_j -> S_end (j < k), S0 -> S_end (every k)
    dxb, x_s, x_e = cpu_fused.epilogue(su, raw_s, raw_e, dYb, Gd)
    into_y = (dec.fs * d_o).to(f64)
    if blk.explicit:
        da = _revcum(into_y, 3) + pair_da
    else:
        da = _revcum(into_y + (dec.e * d_y).to(f64) - (dt_b * dec.f * x_s).to(f64), 3)
    to_end = (dt_b * dec.te * x_e).to(f64)
    through = ((dE * S0).sum((3, 5)) * dec.cd).to(f64)                    # (b, g, nc, hg)
    da += (to_end.cumsum(3) - to_end) + through[:, :, :, None]
    q = dec.f * x_s + dec.te * x_e + Gd * x_y                             # x . dX
    dD = None
    if D is not None:
        dD = (x_y.sum((0, 2, 3)) if D.dim() == 1 else (xb * dYb).sum((0, 2, 3)))
        dD = _per_head(dD, blk).to(D.dtype)
    Ab = A.to(f64).view(1, blk.g, 1, 1, blk.hg)
    dA = _per_head((da * dt_b.to(f64)).sum((0, 2, 3)), blk).to(A.dtype)
    ddte = blk.take((da * Ab).to(ct) + q)                                 # (b, l, h)
    ddt, ddt_bias = prepare_dt_backward(ddte, dt.to(ct), None if dt_bias is None else dt_bias.to(ct),
                                        softplus, limit)
    dBn = blk.take(dB.view(blk.b, blk.g, blk.nc, Q, n), heads=False)      # (b, l, g, n)
    dCn = blk.take(dC.view(blk.b, blk.g, blk.nc, Q, n), heads=False)
    return (blk.take(dxb).to(x.dtype), ddt.to(dt.dtype), dA, dBn.to(B.dtype), dCn.to(C.dtype),
            dD, dz, None if ddt_bias is None else ddt_bias.to(dt_bias.dtype),
            None if init is None else _state_out(dinit, blk).to(init.dtype))


class SSDFunction(torch.autograd.Function):
    """out, final = SSDFunction.apply(x, dt, A, B, C, D, z, dt_bias, init, seq_idx, opts) with
    opts = (chunk, softplus, limit, mm_dtype, block). Saves the inputs, the block-start states
    and their reads C S0 (one x-sized tensor: the product the backward would redo first); the
    backward recomputes the rest (ssd_backward)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, init, seq_idx, opts):
        chunk, softplus, limit, mm_dtype, block = opts
        with torch.autocast("cpu", enabled=False):
            out, final, S0, raw_o, fixed = ssd_forward(x, dt, A, B, C, D, z, dt_bias, init, seq_idx,
                                                       softplus, limit, chunk, mm_dtype, block)
        ctx.opts, ctx.fixed = opts, fixed
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, init, seq_idx, S0, raw_o)
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        chunk, softplus, limit, mm_dtype, _ = ctx.opts
        with torch.autocast("cpu", enabled=False):
            grads = ssd_backward(dout, dfinal, *ctx.saved_tensors, softplus, limit, chunk,
                                 mm_dtype, ctx.fixed)
        return (*grads, None, None)


def matmul_dtype(x, B, C, ct):
    """bfloat16 under bf16 autocast or for bf16 inputs when the CPU runs bf16 GEMMs natively,
    else the arithmetic dtype (module docstring)."""
    autocast_bf16 = (torch.is_autocast_enabled("cpu")
                     and torch.get_autocast_dtype("cpu") == torch.bfloat16)
    wants = autocast_bf16 or torch.bfloat16 in (x.dtype, B.dtype, C.dtype)
    return torch.bfloat16 if wants and ct == torch.float32 and native_bf16() else ct


RECURRENT_MAX_N = 128  # the fused recurrence runs up to this d_state (`prefer_recurrent`)


def prefer_recurrent(x, B) -> bool:
    """Whether the fused recurrence (`cpu_recurrent.py`) runs instead of the chunked form.
    Measured on a 2-core AVX-512 EPYC (benchmarks/ssd.py, docs/kernels.md): forward + backward
    faster at every benchmark shape, 2-5x, in fp32 and under bf16 autocast, d_state 16-128,
    headdim 16-64, batch 1-16, L 128-2048. Its work grows as d_inner x N per token where the
    chunked form's grows as d_inner x (Q + N): above N = 128 (not measured) the chunked form
    keeps the call. Needs numba."""
    from sonata.kernels.ssd import cpu_recurrent
    return cpu_recurrent.available() and B.shape[3] <= RECURRENT_MAX_N


@opaque
def ssd_cpu(x, dt, A, B, C, chunk_size=64, D=None, z=None, dt_bias=None, initial_states=None,
            seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False,
            block=None, mm_dtype=None, form=None):
    """The fast path of sonata.kernels.ssd.ssd (same arguments and returns): the fused
    recurrence or the chunked form, `form` "recurrent" or "chunked", by default
    `prefer_recurrent`'s choice. `block` pins the chunked form's block length and `mm_dtype`
    its matmul operands' dtype (tests; either one means the chunked form)."""
    if form not in (None, "recurrent", "chunked"):
        raise ValueError(f"ssd_cpu: form must be 'recurrent' or 'chunked', got {form!r}")
    if form is None:
        form = ("recurrent" if block is None and mm_dtype is None and prefer_recurrent(x, B)
                else "chunked")
    if form == "recurrent":
        from sonata.kernels.ssd.cpu_recurrent import ssd_cpu_recurrent
        return ssd_cpu_recurrent(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                 dt_softplus, dt_limit, return_final_states)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    mm = matmul_dtype(x, B, C, ct) if mm_dtype is None else mm_dtype
    limit = (float(dt_limit[0]), float(dt_limit[1]))
    opts = (int(chunk_size), bool(dt_softplus), limit, mm, block)
    # the blocked layout views its inputs: views of a wider projection (the Mamba-2 block's
    # split of in_proj) are made contiguous first (a no-op for contiguous inputs)
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    z = None if z is None else z.contiguous()
    out, final = SSDFunction.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, opts)
    # the final state comes back contiguous (as mamba_ssm's does): a decoder steps it in place
    return (out, final.contiguous()) if return_final_states else out
