"""The SSD (Mamba-2) scan on CPU as a fused recurrence: one numba pass forward, one backward,
for the shapes where it beats the chunked form (`cpu.py`; the rule is `prefer_recurrent`).
Semantics, shapes and names are `reference.py`'s; the same arguments as `ssd_cpu`.

Per (batch, head), the state S (p, n) steps token by token with one decay per head:

    a_t = exp(dt_t A)  (0 where a packed sequence starts: seq_idx)
    S_t = a_t S_{t-1} + (dt_t x_t) B_t^T,   y_t = S_t C_t + D x_t,   out_t = y_t silu(z_t)

d_inner x N multiply-adds per token and h exponentials, against the chunked form's ~Q + 2N
per channel and its dozens of torch ops per call: at small N, short blocks and small
batches (the seed model) the recurrence is the faster one. The loops over n are the
vectorized ones (B_t, C_t rows contiguous).

Backward. The adjoint G_t = dLoss/dS_t runs backwards, G_{t-1} = a_t (G_t + dY_t C_t^T)
with dY the gradient of y before D (times silu(z) with a gate); every gradient is local in
time from G_t, S_{t-1} and S_t:

    dX_t = (G_t + dY_t C_t^T) B_t           dB_t = sum_heads (G_t + dY_t C_t^T)^T X_t
    dC_t = sum_heads S_t^T dY_t             da_t = <G_t + dY_t C_t^T, S_{t-1}> a_t
    dx = dt dX + D dY,  ddt = x . dX + da A,  dA = sum da dt,  dinit = the adjoint at t = -1

(G_t here before step t's own output term is added.) The states are not stored: the forward
keeps one per T steps (the state a segment starts from, (b, L/T, h, p, n)); the backward
walks the segments from last to first, recomputes the segment's T states from its
checkpoint into a per-thread buffer, then runs the reverse step over them (Mamba-1's
kernels do the same, `sonata/kernels/selective/cpu_kernels.py`). T = SEGMENT = 64.

Layout for speed (benchmarks/ssd.py table 3; perf on the 2-core EPYC): the backward keeps
its per-item buffers (dC_t, dB_t, copies of C_t and B_t, the adjoint, the segment's states)
as rows of ONE array. LLVM vectorizes each loop over n only after runtime checks that the
arrays it writes and reads do not overlap; with six arrays those checks, paid per row,
were 15% of the backward, with one array they mostly go. The ungated and gated dY loops
are separate loops (a branch inside was computed for both, in float64: 11%). Together
with the packed entry below, a training step of the seed-size N=64 model is 6-8% faster.

Explicit vector steps (`cpu_steps.py`: `fwd_rows`, `rec_block`, `rev_block`, numba
intrinsics that emit their vector loops, `cpu_simd.VectorIR`), where d_state is a multiple of the
vector's lanes: the loops above are short (one row of n per state row, 32-64 rows per head and
step), and LLVM versioned each behind its overlap checks and ended each with a horizontal sum,
which together cost about what the work did. The vector steps take four rows at a time: B_t
and C_t (and in the reverse step the dC_t and dB_t sums) stay in registers across them, their
four row sums are reduced together (`VectorIR.hsum4`), and nothing is checked. What that buys
shows in whole training steps: `python benchmarks/ssd.py --only-models` (docs/results.md, the
SSD section). The loops stay for
other sizes (and run in the tests: VECTOR). dB_t and dC_t add up in a contiguous per-item
array, copied out once (they may be views of the packed gradient).

The Mamba-2 block's gated norm can run inside these kernels (`SSDPackedFunction`'s norm, the
block's default on the cpu backend): a work item's heads are one norm group, so it normalises
its rows after its heads and its backward starts from them.

`SSDPackedFunction` is the Mamba-2 block's entry (`ssd.ssd_packed`): it takes the block's
packed [x | B | C] and writes one packed gradient (no concatenation of three).

Parallel over (batch, group) work items (serial at one thread: `cpu_simd.for_workers`); an item runs its group's heads one after the
other, so it owns dB and dC of its (batch, group) rows and adds the heads in a fixed order:
no atomics, bit-identical reruns whatever the thread count. float32 arithmetic (float64 for
float64 inputs: gradcheck); bfloat16 inputs or autocast run it in float32 and return x's
dtype. dt's bias, softplus and clamp and their gradients are `cpu_fused.prepare_dt`'s torch ops.
"""
from __future__ import annotations

import math

import numpy as np
import torch

try:
    from numba import prange

    from sonata.kernels.cpu_simd import addr, for_workers, parallel_kernel, vector_lanes, workers
    from sonata.kernels.ssd.cpu_steps import (fwd_rows, norm_backward_rows, norm_forward_rows, rec_block,
                                              rev_block)
except ImportError:         # no numba: the chunked form runs (prefer_recurrent says no)
    prange = range
    parallel_kernel = None

from sonata.kernels.dispatch import opaque
from sonata.kernels.ssd.cpu_fused import prepare_dt, prepare_dt_backward

# Each kernel is a `cpu_simd.parallel_kernel`: at one worker its serial twin runs, which never
# starts numba's thread pool (cpu_simd says why that matters on a busy host).
_kernel = (lambda fn: fn) if parallel_kernel is None else parallel_kernel(
    cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})

# the backward's work array: these rows, then the adjoint (p rows from _G), then the segment's
# states (T + 1 blocks of p rows); module constants, so numba compiles them in
_DC, _DB, _CT, _BT, _G = 0, 1, 2, 3, 4

SEGMENT = 64    # steps between saved states: the checkpoints hold what the chunked form's block
               # states hold (L / 64 states); 8-64 measured within noise of each other

# The explicit vector steps (`cpu_steps.py`) run where d_state is a multiple of the vector's lanes
# (`vector_lanes`: 16 float32 / 8 float64 with AVX-512, 8 / 4 with AVX2); the loops beside
# them otherwise, or everywhere with VECTOR false (the tests run both).
VECTOR = True


def _vector_ok(n: int, dtype) -> bool:
    return VECTOR and parallel_kernel is not None and n % vector_lanes(dtype) == 0


@_kernel
def _forward(x, dte, A, B, C, starts, init, Dm, z, T, vec, nz, nw, eps, out, ypre, ck, final, yn, rstd):
    """out (and ypre = y before the gate, when z is given), the checkpoints ck and the final
    state. init (b, h, p, n) or empty; Dm (h, p); z empty without a gate; starts (b, L) int8;
    vec: the explicit vector step (B and C C-contiguous, n a multiple of the lanes). With nz
    (b, L, h p, any strides; empty without): the gated norm too, yn = norm(y silu(nz)) nw over
    each group's h/g heads (`norm_forward_rows`), rstd (b, L, g) its 1/rms; out keeps y."""
    nb, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    hg = h // g
    has_init, gated = init.shape[0] > 0, z.shape[0] > 0
    for item in prange(nb * g):
        bi, gi = item // g, item % g
        S = np.empty((p, n), x.dtype)
        Xv = np.empty(p, x.dtype)
        acc = np.empty(p, x.dtype)
        zero = np.zeros(1, x.dtype)[0]                  # typed: an int 0 would widen to float64
        for hh in range(hg):
            hd = gi * hg + hh
            if has_init:
                S[:, :] = init[bi, hd]
            else:
                S[:, :] = 0
            Ah = A[hd]
            for t in range(L):
                if t % T == 0:
                    ck[bi, t // T, hd] = S
                dt = dte[bi, t, hd]
                a = np.exp(dt * Ah)
                if starts[bi, t] != 0:
                    a = zero
                for i in range(p):
                    Xv[i] = dt * x[bi, t, hd, i]
                if vec:
                    row = ((bi * L + t) * g + gi) * n
                    fwd_rows(addr(S, 0), addr(B, row), addr(C, row), addr(Xv, 0), addr(acc, 0), a, p, n)
                else:
                    Bt, Ct = B[bi, t, gi], C[bi, t, gi]     # rows: the loops over n vectorize
                    for i in range(p):
                        Xi = Xv[i]
                        Si = S[i]
                        ac = zero
                        for j in range(n):
                            s = a * Si[j] + Xi * Bt[j]
                            Si[j] = s
                            ac += s * Ct[j]
                        acc[i] = ac
                for i in range(p):
                    y = acc[i] + Dm[hd, i] * x[bi, t, hd, i]
                    if gated:
                        ypre[bi, t, hd, i] = y
                        zz = z[bi, t, hd, i]
                        out[bi, t, hd, i] = y * zz / (1.0 + np.exp(-zz))
                    else:
                        out[bi, t, hd, i] = y
            final[bi, hd] = S
        if nz.shape[0] > 0:                             # the item's rows, while in cache
            norm_forward_rows(out, nz, nw, eps, bi, gi, hg * p, yn, rstd)


@_kernel
def _backward(x, dte, A, B, C, starts, Dm, z, ypre, dout, dfinal, ck, T, vec, nz, nw, rstd, y, dyn,
                   dx, ddte, dAp, dB, dC, dDp, dz, dinit, dnz, dnwp):
    """Gradients: dx, ddte (of the prepared dt), dAp (b, h) partials of dA, dB and dC
    (written whole), dDp (b, h, p) partials of D per channel, dz (gated), dinit (b, h, p, n).
    dfinal (b, h, p, n) or empty. With nz (the forward's gated norm): dyn is the gradient of
    its output, and the item first writes its rows of dout (y's gradient), dnz and its
    partial of the norm weight's gradient dnwp (b g, h p / g) (`norm_backward_rows`)."""
    nb, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    hg = h // g
    nck = ck.shape[1]
    has_df, gated = dfinal.shape[0] > 0, z.shape[0] > 0
    for item in prange(nb * g):
        bi, gi = item // g, item % g
        if nz.shape[0] > 0:
            norm_backward_rows(y, nz, nw, rstd, dyn, bi, gi, hg * p, dout, dnz, dnwp[item])
        W = np.empty((_G + p + (T + 1) * p, n), x.dtype)  # dC_t, dB_t, C_t, B_t, the adjoint, the states
        sb = _G + p                                      # S_{t0-1+k} row i is W[sb + k * p + i]
        av = np.empty(T, x.dtype)
        Xv = np.empty(p, x.dtype)
        dyv = np.empty(p, x.dtype)
        dBi, dCi = np.zeros((L, n), x.dtype), np.zeros((L, n), x.dtype)   # the item's dB, dC: contiguous
        axv = np.empty(p, x.dtype)                      # its gs_i . B_t
        zero = np.zeros(1, x.dtype)[0]
        one = np.ones(1, x.dtype)[0]
        for hh in range(hg):
            hd = gi * hg + hh
            Ah = A[hd]
            if has_df:
                W[_G:sb, :] = dfinal[bi, hd]
            else:
                W[_G:sb, :] = 0
            for i in range(p):
                dDp[bi, hd, i] = 0
            dA_acc = 0.0
            for c in range(nck - 1, -1, -1):
                t0 = c * T
                t1 = min(L, t0 + T)
                W[sb:sb + p, :] = ck[bi, c, hd]
                for t in range(t0, t1):                 # recompute the segment's states
                    k = t - t0
                    dt = dte[bi, t, hd]
                    a = np.exp(dt * Ah)
                    if starts[bi, t] != 0:
                        a = zero
                    av[k] = a
                    if vec:
                        for i in range(p):
                            Xv[i] = dt * x[bi, t, hd, i]
                        rec_block(addr(W, (sb + k * p) * n), addr(W, (sb + (k + 1) * p) * n),
                                   addr(B, ((bi * L + t) * g + gi) * n), addr(Xv, 0), a, p, n)
                        continue
                    for i in range(p):
                        Xi = dt * x[bi, t, hd, i]
                        for j in range(n):
                            W[sb + (k + 1) * p + i, j] = a * W[sb + k * p + i, j] + Xi * B[bi, t, gi, j]
                for t in range(t1 - 1, t0 - 1, -1):     # the reverse step
                    k = t - t0
                    dt = dte[bi, t, hd]
                    a = av[k]
                    if gated:                   # two loops: a branch inside would be evaluated for both
                        for i in range(p):
                            zz = z[bi, t, hd, i]
                            sg = one / (one + np.exp(-zz))
                            go = dout[bi, t, hd, i]
                            dz[bi, t, hd, i] = go * ypre[bi, t, hd, i] * sg * (one + zz * (one - sg))
                            dyv[i] = go * zz * sg
                    else:
                        for i in range(p):
                            dyv[i] = dout[bi, t, hd, i]
                    for i in range(p):
                        xi = x[bi, t, hd, i]
                        Xv[i] = dt * xi
                        dDp[bi, hd, i] += dyv[i] * xi
                    ddt = zero
                    if vec:
                        row = ((bi * L + t) * g + gi) * n
                        da = rev_block(addr(W, _G * n), addr(W, (sb + (k + 1) * p) * n), addr(W, (sb + k * p) * n),
                                        addr(C, row), addr(B, row), addr(dCi, t * n), addr(dBi, t * n),
                                        addr(dyv, 0), addr(Xv, 0), addr(axv, 0), a, p, n)
                        for i in range(p):
                            dx[bi, t, hd, i] = dt * axv[i] + Dm[hd, i] * dyv[i]
                        for i in range(p):      # apart: dx's layout (a packed view or not) must not
                            ddt += x[bi, t, hd, i] * axv[i]     # change how this sum vectorizes
                    else:
                        for j in range(n):
                            W[_DC, j] = 0
                            W[_DB, j] = 0
                        da = zero
                        for j in range(n):
                            W[_CT, j] = C[bi, t, gi, j]
                            W[_BT, j] = B[bi, t, gi, j]
                        for i in range(p):
                            dyi, Xi = dyv[i], Xv[i]
                            accx = zero
                            for j in range(n):
                                gs = W[_G + i, j] + dyi * W[_CT, j]
                                W[_DC, j] += W[sb + (k + 1) * p + i, j] * dyi
                                accx += gs * W[_BT, j]
                                W[_DB, j] += gs * Xi
                                da += gs * W[sb + k * p + i, j]
                                W[_G + i, j] = gs * a
                            dx[bi, t, hd, i] = dt * accx + Dm[hd, i] * dyi
                            ddt += x[bi, t, hd, i] * accx
                        for j in range(n):
                            dBi[t, j] += W[_DB, j]
                            dCi[t, j] += W[_DC, j]
                    da = da * a
                    ddte[bi, t, hd] = ddt + da * Ah
                    dA_acc += da * dt
            dAp[bi, hd] = dA_acc
            dinit[bi, hd] = W[_G:sb]
        dB[bi, :, gi, :] = dBi                          # dB, dC may be views of one packed gradient
        dC[bi, :, gi, :] = dCi


def available() -> bool:
    return parallel_kernel is not None


def _np(t):
    return t.detach().contiguous().numpy()


def _empty(ct, ndim):
    return np.empty((0,) * ndim, dtype=np.float32 if ct == torch.float32 else np.float64)


def _starts(seq_idx, b, L):
    s = torch.zeros(b, L, dtype=torch.int8)
    if seq_idx is not None and L > 1:
        s[:, 1:] = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int8)
    return s.numpy()


def _ct(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _forward_into(ctx, x, dt, A, B, C, D, z, dt_bias, init, seq_idx, opts, norm=None):
    """The forward kernel over x, B, C (copied contiguous in the compute dtype), saving what
    the backward reads on ctx -> (out, final, yn) as numpy arrays in the compute dtype. norm:
    (nz (b, L, h p), weight (h p,), eps, groups) for the gated norm fused in (yn its output; None
    without)."""
    softplus, limit = opts
    ct = _ct(x)
    b, L, h, p = x.shape
    n = B.shape[3]
    with torch.autocast("cpu", enabled=False):
        dte = prepare_dt(dt.to(ct), None if dt_bias is None else dt_bias.to(ct), softplus, limit)
        Dm = (torch.zeros(h, p, dtype=ct) if D is None
              else D.to(ct).reshape(h, -1).expand(h, p)).contiguous()
    T = SEGMENT
    xs, Bs, Cs = _np(x.to(ct)), _np(B.to(ct)), _np(C.to(ct))
    zs = _empty(ct, 4) if z is None else _np(z.to(ct))
    starts = _starts(seq_idx, b, L)
    out = np.empty_like(xs)
    ypre = np.empty_like(xs) if z is not None else _empty(ct, 4)
    ck = np.empty((b, -(-L // T), h, p, n), xs.dtype)
    final = np.empty((b, h, p, n), xs.dtype)
    if norm is None:
        nz, nw, eps, yn, rstd = _empty(ct, 3), _empty(ct, 1), 0.0, _empty(ct, 3), _empty(ct, 3)
    else:
        nz_t, nw_t, eps, groups = norm
        nz, nw = nz_t.detach().to(ct).numpy(), _np(nw_t.to(ct))       # nz: any strides
        yn, rstd = np.empty((b, L, h * p), xs.dtype), np.empty((b, L, groups), xs.dtype)
    vec = _vector_ok(n, xs.dtype)
    for_workers(_forward, workers())(xs, _np(dte), _np(A.to(ct)), Bs, Cs, starts,
                                     _empty(ct, 4) if init is None else _np(init.to(ct)), _np(Dm), zs, T, vec,
                                     nz, nw, float(eps), out, ypre, ck, final, yn, rstd)
    ctx.opts, ctx.T, ctx.starts, ctx.vec = opts, T, starts, vec
    ctx.arrays = (xs, _np(dte), Bs, Cs, zs, ypre, ck, _np(Dm))
    ctx.norm = None if norm is None else (nz, nw, rstd, out)
    return out, final, yn


def _backward_into(ctx, dout, dfinal, x, dt, A, D, z, dt_bias, dx, dB, dC, dyn=None):
    """The backward kernel: writes dx, dB and dC (numpy arrays of x's and B's shapes, any
    strides: views of one packed gradient are fine) -> (ddt, dA, dD, dz, ddt_bias, dinit) as
    tensors in the compute dtype (None where the input was None); with the norm fused in, dyn
    (its output's gradient) in place of dout, and two more: (dnz, dnorm_weight)."""
    xs, dte, Bs, Cs, zs, ypre, ck, Dm = ctx.arrays
    softplus, limit = ctx.opts
    ct = _ct(x)
    b, L, h, p = xs.shape
    n = Bs.shape[3]
    if ctx.norm is None:
        go = np.zeros_like(xs) if dout is None else _np(dout.to(ct))
        nz, nw, rstd, y, dynn = _empty(ct, 3), _empty(ct, 1), _empty(ct, 3), _empty(ct, 4), _empty(ct, 3)
        dnz, dnwp = _empty(ct, 3), _empty(ct, 2)
    else:
        nz, nw, rstd, y = ctx.norm
        go = np.empty_like(xs)                          # the kernel writes y's gradient here first
        dynn = np.zeros((b, L, h * p), xs.dtype) if dyn is None else _np(dyn.to(ct))
        dnz, dnwp = np.empty((b, L, h * p), xs.dtype), np.empty((b * rstd.shape[2], h * p // rstd.shape[2]), xs.dtype)
    df = _empty(ct, 4) if dfinal is None else _np(dfinal.to(ct))
    dz = np.empty_like(xs) if z is not None else _empty(ct, 4)
    ddte, dAp = np.empty(dte.shape, xs.dtype), np.empty((b, h), xs.dtype)
    dDp, dinit = np.empty((b, h, p), xs.dtype), np.empty((b, h, p, n), xs.dtype)
    for_workers(_backward, workers())(xs, dte, _np(A.to(ct)), Bs, Cs, ctx.starts, Dm, zs, ypre, go, df, ck,
                                      ctx.T, ctx.vec, nz, nw, rstd, y, dynn,
                                      dx, ddte, dAp, dB, dC, dDp, dz, dinit, dnz, dnwp)
    T = torch.from_numpy
    with torch.autocast("cpu", enabled=False):
        ddt, ddt_bias = prepare_dt_backward(T(ddte), dt.to(ct), None if dt_bias is None else dt_bias.to(ct),
                                            softplus, limit)
        dD = None
        if D is not None:
            dDc = T(dDp).sum(0)                                            # (h, p)
            dD = dDc.sum(1) if D.dim() == 1 else dDc
        dA = T(dAp).to(torch.float64).sum(0)
        grads = (ddt, dA, dD, None if z is None else T(dz), ddt_bias, T(dinit))
        if ctx.norm is None:
            return grads
        g = rstd.shape[2]                               # the items' partials, in a fixed order
        return grads + (T(dnz), T(dnwp).reshape(b, g, -1).sum(0).reshape(-1))


def _view(a, shape):
    """a reshaped without a copy (setting .shape raises where a copy would be needed: the
    kernel must write into the packed gradient itself)."""
    v = a.view()
    v.shape = shape
    return v


def _like(t, ref):
    return None if t is None or ref is None else t.to(ref.dtype)


class SSDRecurrentFunction(torch.autograd.Function):
    """out, final = SSDRecurrentFunction.apply(x, dt, A, B, C, D, z, dt_bias, init, seq_idx,
    opts) with opts = (softplus, limit). Saves the inputs, the checkpoints and (with z) y
    before the gate."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, init, seq_idx, opts):
        out, final, _ = _forward_into(ctx, x, dt, A, B, C, D, z, dt_bias, init, seq_idx, opts)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, init)
        return torch.from_numpy(out).to(x.dtype), torch.from_numpy(final)

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, dt, A, B, C, D, z, dt_bias, init = ctx.saved_tensors
        xs, Bs = ctx.arrays[0], ctx.arrays[2]
        dx, dB, dC = np.empty_like(xs), np.empty_like(Bs), np.empty_like(Bs)
        ddt, dA, dD, dz, ddt_bias, dinit = _backward_into(ctx, dout, dfinal, x, dt, A, D, z, dt_bias, dx, dB, dC)
        T = torch.from_numpy
        return (T(dx).to(x.dtype), ddt.to(dt.dtype), dA.to(A.dtype), T(dB).to(B.dtype), T(dC).to(C.dtype),
                _like(dD, D), _like(dz, z), _like(ddt_bias, dt_bias), _like(dinit, init), None, None)


class SSDPackedFunction(torch.autograd.Function):
    """out = SSDPackedFunction.apply(xBC, dt, A, D, dt_bias, dims, opts, norm): the recurrence
    over the Mamba-2 block's packed convolution output xBC (b, L, h p + 2 g n) = [x | B | C],
    dims = (h, p, g, n), no gate, initial or final state. Its backward writes dx, dB and dC
    into one packed gradient (the split's gradient would be a concatenation of three).
    norm: None, or (z, weight, eps) for the block's gated norm fused in: out = norm(y silu(z))
    weight (b, L, h p) over g groups, as `GatedRMSNorm`; then z and weight get gradients."""

    @staticmethod
    def forward(ctx, xBC, dt, A, D, dt_bias, dims, opts, z=None, weight=None, eps=1e-5):
        h, p, g, n = dims
        b, L, _ = xBC.shape
        x, B, C = xBC.split([h * p, g * n, g * n], dim=-1)
        norm = None if z is None else (z, weight, eps, g)
        out, _, yn = _forward_into(ctx, x.reshape(b, L, h, p), dt, A, B.reshape(b, L, g, n),
                                   C.reshape(b, L, g, n), D, None, dt_bias, None, None, opts, norm)
        ctx.dims = dims
        ctx.save_for_backward(xBC, dt, A, D, dt_bias, z, weight)
        return torch.from_numpy(out if z is None else yn).to(xBC.dtype)

    @staticmethod
    def backward(ctx, dout):
        xBC, dt, A, D, dt_bias, z, weight = ctx.saved_tensors
        h, p, g, n = ctx.dims
        b, L, _ = xBC.shape
        d = np.empty((b, L, h * p + 2 * g * n), ctx.arrays[0].dtype)
        dx = _view(d[..., :h * p], (b, L, h, p))
        dB = _view(d[..., h * p:h * p + g * n], (b, L, g, n))
        dC = _view(d[..., h * p + g * n:], (b, L, g, n))
        if z is None:
            ddt, dA, dD, _, ddt_bias, _ = _backward_into(ctx, dout, None, xBC, dt, A, D, None, dt_bias, dx, dB, dC)
            dz = dw = None
        else:
            ddt, dA, dD, _, ddt_bias, _, dz, dw = _backward_into(ctx, None, None, xBC, dt, A, D, None, dt_bias,
                                                                 dx, dB, dC, dyn=dout)
            dz, dw = dz.to(z.dtype), dw.to(weight.dtype)
        return (torch.from_numpy(d).to(xBC.dtype), ddt.to(dt.dtype), dA.to(A.dtype), _like(dD, D),
                _like(ddt_bias, dt_bias), None, None, dz, dw, None)


@opaque
def ssd_cpu_recurrent(x, dt, A, B, C, chunk_size=64, D=None, z=None, dt_bias=None, initial_states=None,
                      seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False):
    """The fused recurrence (module docstring); ssd_cpu's arguments (chunk_size is ignored)."""
    limit = (float(dt_limit[0]), float(dt_limit[1]))
    out, final = SSDRecurrentFunction.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx,
                                            (bool(dt_softplus), limit))
    return (out, final) if return_final_states else out


@opaque
def ssd_cpu_recurrent_packed(xBC, dt, A, dims, D=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                             norm=None):
    """The fused recurrence over the packed xBC (b, L, h p + 2 g n), dims = (h, p, g, n)
    (`SSDPackedFunction`) -> out (b, L, h, p); with norm = (z, weight, eps), the block's gated
    norm fused in -> norm(y silu(z)) weight (b, L, h p)."""
    limit = (float(dt_limit[0]), float(dt_limit[1]))
    args = (xBC, dt, A, D, dt_bias, tuple(int(v) for v in dims), (bool(dt_softplus), limit))
    if norm is None:
        return SSDPackedFunction.apply(*args)
    z, weight, eps = norm
    return SSDPackedFunction.apply(*args, z, weight, float(eps))
