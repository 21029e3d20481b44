"""The SSD recurrence's inner steps (`cpu_recurrent.py`'s kernels call them per head and
token): the explicit vector steps, numba intrinsics that emit their vector loops themselves
(`cpu_simd.VectorIR`; why, and what they measured, in `cpu_recurrent.py`'s docstring), and the
Mamba-2 block's gated norm over a work item's rows, fused into those kernels.

The vector steps take one head's (p, n) state block, rows contiguous, n a multiple of the
lanes; four rows at a time (`VectorIR.by_four`). Their float arithmetic is the loops' in
`cpu_recurrent.py` (S = a S + X B), the sums in another fixed order.
"""
from __future__ import annotations


import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from sonata.kernels.cpu_simd import VectorIR, fast_sigmoid, VEC_FLAGS


@intrinsic
def fwd_rows(typingctx, S, Bt, Ct, X, acc, a, p, n):
    """One head's forward step: S_i = a S_i + X_i B and acc_i = S_i . C for the p rows of S
    (p x n, rows contiguous); n a multiple of the lanes. Four rows at a time (B and C loaded
    once for them, the four sums reduced together: `VectorIR.hsum4`), the rest one by one."""
    sig = types.void(S, Bt, Ct, X, acc, a, p, n)

    def codegen(context, builder, signature, args):
        S_, B_, C_, X_, ac_, a_, p_, n_ = args
        V = VectorIR(builder, a_.type)
        p_, n_ = V.i64(p_), V.i64(n_)
        av, nv = V.splat(a_), builder.udiv(n_, V.lanes)
        accs = [V.var() for _ in range(4)]

        def rows_step(rows):
            xbs = [V.splat(V.scalar(X_, i)) for i in rows]
            offs = [builder.mul(i, n_) for i in rows]
            with cgutils.for_range(builder, nv) as jl:
                col = builder.mul(jl.index, V.lanes)
                bv, cv = V.load(B_, col), V.load(C_, col)
                for xb, row, acv in zip(xbs, offs, accs):
                    off = builder.add(row, col)
                    s = V.fma(av, V.load(S_, off), builder.fmul(xb, bv))
                    V.store(s, S_, off)
                    builder.store(V.fma(s, cv, builder.load(acv)), acv)

        V.by_four(p_, rows_step, accs, ac_)
        return context.get_dummy_value()
    return sig, codegen

@intrinsic
def rec_block(typingctx, S0, S1, Bt, X, a, p, n):
    """The backward's recomputation of one step: S1 = a S0 + X B^T (p x n blocks), the
    forward's arithmetic exactly; by columns of one vector, B's held in a register."""
    sig = types.void(S0, S1, Bt, X, a, p, n)

    def codegen(context, builder, signature, args):
        S0_, S1_, B_, X_, a_, p_, n_ = args
        V = VectorIR(builder, a_.type)
        p_, n_ = V.i64(p_), V.i64(n_)
        av = V.splat(a_)
        with cgutils.for_range(builder, builder.udiv(n_, V.lanes)) as jl:
            col = builder.mul(jl.index, V.lanes)
            bv = V.load(B_, col)
            with cgutils.for_range(builder, p_) as il:
                off = builder.add(builder.mul(il.index, n_), col)
                xb = V.splat(V.scalar(X_, il.index))
                V.store(V.fma(av, V.load(S0_, off), builder.fmul(xb, bv)), S1_, off)
        return context.get_dummy_value()
    return sig, codegen

@intrinsic
def rev_block(typingctx, G, S1, S0, Ct, Bt, DC, DB, dy, X, accx, a, p, n):
    """One head's reverse step (the module docstring): with gs_i = G_i + dy_i C, adds
    sum_i dy_i S1_i to DC and sum_i X_i gs_i to DB, writes accx_i = gs_i . B and G_i = a gs_i,
    and returns <gs, S0>. Four rows at a time: C, B and the DC, DB sums in registers over
    them, their four gs_i . B reduced together (`VectorIR.hsum4`); the rest one by one."""
    sig = a(G, S1, S0, Ct, Bt, DC, DB, dy, X, accx, a, p, n)

    def codegen(context, builder, signature, args):
        G_, S1_, S0_, C_, B_, DC_, DB_, dy_, X_, ax_, a_, p_, n_ = args
        V = VectorIR(builder, a_.type)
        p_, n_ = V.i64(p_), V.i64(n_)
        av, nv = V.splat(a_), builder.udiv(n_, V.lanes)
        dav = V.var()
        accs = [V.var() for _ in range(4)]

        def rows_pass(rows):
            dybs = [V.splat(V.scalar(dy_, i)) for i in rows]
            xbs = [V.splat(V.scalar(X_, i)) for i in rows]
            offs = [builder.mul(i, n_) for i in rows]
            with cgutils.for_range(builder, nv) as jl:
                col = builder.mul(jl.index, V.lanes)
                cv, bv = V.load(C_, col), V.load(B_, col)
                dcv, dbv, da = V.load(DC_, col), V.load(DB_, col), builder.load(dav)
                for dyb, xb, row, acv in zip(dybs, xbs, offs, accs):
                    off = builder.add(row, col)
                    gs = V.fma(dyb, cv, V.load(G_, off))
                    dcv = V.fma(V.load(S1_, off), dyb, dcv)
                    builder.store(V.fma(gs, bv, builder.load(acv)), acv)
                    dbv = V.fma(gs, xb, dbv)
                    da = V.fma(gs, V.load(S0_, off), da)
                    V.store(builder.fmul(gs, av), G_, off)
                V.store(dcv, DC_, col)
                V.store(dbv, DB_, col)
                builder.store(da, dav)

        V.by_four(p_, rows_pass, accs, ax_)
        return V.hsum(builder.load(dav))
    return sig, codegen


# The Mamba-2 block's gated norm fused in (`cpu_recurrent.SSDPackedFunction`'s norm): its
# groups are the items' head groups (d_inner / ngroups channels), so an item normalises its own
# rows once its heads are done, and its backward starts from them, while they are in cache; no
# separate kernel, no torch glue around one. Gate first, as the block: v = y silu(z), out = v r w
# with r = 1 / sqrt(mean(v^2) + eps); backward with gn = dyn w: dv = r gn - v r^3 mean(gn v),
# dy = dv silu(z), dz = dv y silu'(z), dw = sum over rows of dyn v r (`cpu_norm`'s formulas).
# Offsets into the rows are unsigned: with a signed run-time offset (`a[c0 + c]`) numba checks
# every access for a negative index to wrap, and these loops ran 3.5-4x slower.
@njit(**VEC_FLAGS)
def norm_forward_rows(y, nz, nw, eps, bi, gi, cg, yn, rstd):
    """yn[bi, :, group gi] and rstd[bi, :, gi] from y (b, L, h, p) and nz (b, L, h p)."""
    nb, L, h, p = y.shape
    y3 = y.reshape(nb, L, h * p)                   # C-contiguous views: the loops vectorize
    one = np.ones(1, y.dtype)[0]
    e, inv = y.dtype.type(eps), one / y.dtype.type(cg)
    c0, cu = np.uint64(gi * cg), np.uint64(cg)     # unsigned (above)
    zr = np.empty(cg, y.dtype)
    sg = np.empty(cg, y.dtype)
    v = np.empty(cg, y.dtype)
    for t in range(L):
        for c in range(cu):
            zr[c] = nz[bi, t, c0 + c]
        for c in range(cu):         # alone: with a sum beside it the exponential's loop
            sg[c] = fast_sigmoid(zr[c], one)                    # stayed scalar (3x slower)
        ss = np.zeros(1, y.dtype)[0]
        for c in range(cu):
            vc = y3[bi, t, c0 + c] * zr[c] * sg[c]
            v[c] = vc
            ss += vc * vc
        r = one / np.sqrt(ss * inv + e)
        rstd[bi, t, gi] = r
        for c in range(cu):
            yn[bi, t, c0 + c] = v[c] * r * nw[c0 + c]

@njit(**VEC_FLAGS)
def norm_backward_rows(y, nz, nw, rstd, dyn, bi, gi, cg, dy, dnz, dnw):
    """dy[bi, :, group gi's heads] (the SSD's output gradient), dnz likewise, and dnw
    (cg,) the item's sum of the weight's gradient, from dyn (b, L, h p)."""
    nb, L, h, p = y.shape
    y3, dy3 = y.reshape(nb, L, h * p), dy.reshape(nb, L, h * p)
    one = np.ones(1, y.dtype)[0]
    inv = one / y.dtype.type(cg)
    c0, cu = np.uint64(gi * cg), np.uint64(cg)     # unsigned (above)
    zr = np.empty(cg, y.dtype)
    sg = np.empty(cg, y.dtype)
    v = np.empty(cg, y.dtype)
    gn = np.empty(cg, y.dtype)
    for c in range(cu):
        dnw[c] = 0
    for t in range(L):
        r = rstd[bi, t, gi]
        dot = np.zeros(1, y.dtype)[0]
        for c in range(cu):
            zr[c] = nz[bi, t, c0 + c]
        for c in range(cu):
            sg[c] = fast_sigmoid(zr[c], one)
        for c in range(cu):
            vc = y3[bi, t, c0 + c] * zr[c] * sg[c]
            v[c] = vc
            g_ = dyn[bi, t, c0 + c] * nw[c0 + c]
            gn[c] = g_
            dot += g_ * vc
        k = r * r * r * dot * inv
        for c in range(cu):
            dv = r * gn[c] - v[c] * k
            dy3[bi, t, c0 + c] = dv * zr[c] * sg[c]
            dnz[bi, t, c0 + c] = dv * y3[bi, t, c0 + c] * sg[c] * (one + zr[c] * (one - sg[c]))
            dnw[c] += dyn[bi, t, c0 + c] * v[c] * r
