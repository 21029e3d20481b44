"""sonata/kernels/selective/decode_cpu.py: the Mamba-1 model's one-token fused decode: one numba
call per generated token on CPU, every layer, the final norm and the head.

`sonata.model.decode.Decoder._step` runs a token through ~45 tiny torch ops; at the seed size
(d_model 96) each costs more in dispatch than in arithmetic. `step` here does the same
computation in one compiled call, on float32 numpy arrays prepared once (`pack`):

    per layer l, per sequence:
      hn       = rms_norm(h) * norm_w[l]
      x, z     = hn @ in_wt[l]                         (in_wt: (d, 2 di), the transposed in_proj)
      conv[l, slot] = x                                (ring buffer: slot t mod k holds input t)
      xc       = silu(bias + sum_taps w_tap * conv[l, slot of that tap])
      dt_in, B, C = xc @ x_wt[l]
      dt       = softplus(dt_in @ dt_wt[l] + dt_b[l])
      ssm[l]   = exp(dt * A) * ssm[l] + dt * xc * B    (per channel, N state entries)
      y        = (ssm[l] . C + D * xc) * silu(z)
      h       += y @ out_wt[l]
    logits = rms_norm(h) * norm_w[L] @ head_t         (head_t: (d, vocab), the tied embedding^T)

The ring buffer's layout, slot convention and the states are exactly `Decoder`'s (the torch
step and this one read and write the same memory), so either can continue the other.

Matrix-vector products are written as sums of scaled weight rows (out[:] += v[i] * W[i, :])
over the transposed weights: the inner loops are contiguous and vectorize, and for a batch
every weight row is read once for all the sequences. The decays exp(dt * A) of a sequence
are computed first, in one flat loop over its (di, n) entries that vectorizes. exp and
softplus are the scan kernels' float32 versions (sonata.kernels.cpu_simd: < 1 ulp, and < 2e-9
relative, from libm's); the compile flags are theirs too (`VEC_FLAGS`: sums may be reassociated
and multiply-adds fused, so results differ from the torch step's by float32 rounding).
Single-threaded: at these sizes a thread pool's fork/join
costs more than a step. Compiled on first use, cached on disk (`cache=True`; the cache is keyed
by every kernel source, `numba_cache`, since the step embeds cpu_simd.py's helpers).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from sonata.kernels.cpu_simd import fast_exp_f32, fast_softplus_f32, VEC_FLAGS

_ONE = np.float32(1.0)


@njit(**VEC_FLAGS)
def _rms_norm_rows(h, w, eps, out):
    """out[b] = h[b] * rsqrt(mean(h[b]^2) + eps) * w."""
    nb, d = h.shape
    for b in range(nb):
        ss = np.float32(0.0)
        for i in range(d):
            ss += h[b, i] * h[b, i]
        r = _ONE / np.sqrt(ss / np.float32(d) + eps)
        for i in range(d):
            out[b, i] = h[b, i] * r * w[i]


FP32, INT8, BF16 = 0, 1, 2     # how `step`'s projections are stored (its `wkind`)


@njit(**VEC_FLAGS)
def _axpy_rows(v, i, row, dst):
    """dst[b] += v[b, i] * row for every sequence b (row: one float32 weight row)."""
    n_out = row.shape[0]
    for b in range(v.shape[0]):
        s = v[b, i]
        ob = dst[b]
        for o in range(n_out):
            ob[o] += s * row[o]


@njit(**VEC_FLAGS)
def _matvec_rows(v, wt, scale, out, accumulate, wkind, acc, wrow):
    """out[b] (+)= v[b] @ W for every row b, W (n_in, n_out) held as `wt` by `wkind`: FP32
    (float32, W itself; `scale` unused), INT8 (int8, W = wt * scale[None, :]: one scale per
    output, the rows of the untransposed weight, sonata's int8) or BF16 (uint16, W's bfloat16
    bit patterns). INT8 and BF16 rows are widened to float32 one at a time in `wrow` (n_out
    floats); INT8 sums in `acc` (b, >= n_out) before their scales."""
    nb = v.shape[0]
    n_in, n_out = wt.shape
    dst = acc if wkind == INT8 else out
    if not accumulate or wkind == INT8:
        for b in range(nb):
            for o in range(n_out):
                dst[b, o] = 0
    row = wrow[:n_out]
    bits = row.view(np.uint32)
    for i in range(n_in):
        if wkind == FP32:
            _axpy_rows(v, i, wt[i], dst)
            continue
        src = wt[i]
        if wkind == INT8 and nb == 1:          # one sequence: widen inside the one pass over the row
            s, ob = v[0, i], dst[0]
            for o in range(n_out):
                ob[o] += s * np.float32(src[o])
            continue
        if wkind == BF16:                      # widened once per row, then used by every sequence
            for o in range(n_out):
                bits[o] = np.uint32(src[o]) << np.uint32(16)
        else:
            for o in range(n_out):
                row[o] = np.float32(src[o])
        _axpy_rows(v, i, row, dst)
    if wkind == INT8:
        for b in range(nb):
            for o in range(n_out):
                v_o = acc[b, o] * scale[o]
                out[b, o] = out[b, o] + v_o if accumulate else v_o


@njit(**VEC_FLAGS)
def step(idx, slot, emb, norm_w, eps, in_wt, conv_w, conv_b, x_wt, dt_wt, dt_b, A, D, out_wt,
         head_t, wkind, in_s, x_s, dt_s, out_s, head_s, conv, ssm, logits):
    """One token for every sequence, in place.

    idx (b,) int64; slot: the ring-buffer slot this token's conv input goes to.
    emb (vocab, d); norm_w (L + 1, d) (the last row: the final norm); eps (L + 1,)
    in_wt (L, d, 2 di); conv_w (L, k, di) (tap k-1 multiplies the newest input); conv_b (L, di)
    x_wt (L, di, r + 2n); dt_wt (L, r, di); dt_b (L, di); A (L, di, n); D (L, di)
    out_wt (L, di, d); head_t (d, vocab)
    The five projections (in_wt, x_wt, dt_wt, out_wt, head_t) share one storage, `wkind`:
    FP32, INT8 with the per-output scales in_s (L, 2 di), x_s (L, r + 2n), dt_s (L, di), out_s
    (L, d), head_s (vocab,) (unused for the others: any float32 arrays of those ranks), or BF16
    (bfloat16 bit patterns as uint16).
    conv (L, b, k, di) ring buffers; ssm (L, b, di, n) states: updated in place
    logits (b, vocab): written.
    """
    n_layers, d, two_di = in_wt.shape
    di = two_di // 2
    k = conv_w.shape[1]
    n = A.shape[2]
    rn = x_wt.shape[2]
    r = rn - 2 * n
    nb = idx.shape[0]
    f32 = np.float32
    h, hn = np.empty((nb, d), f32), np.empty((nb, d), f32)
    xz, xc = np.empty((nb, two_di), f32), np.empty((nb, di), f32)
    xdbl, dt_in = np.empty((nb, rn), f32), np.empty((nb, r), f32)
    dt, y = np.empty((nb, di), f32), np.empty((nb, di), f32)
    dA, dtv = np.empty((di, n), f32), np.empty(di, f32)
    dA_flat = dA.ravel()
    Bv, Cv = np.empty(n, f32), np.empty(n, f32)
    widest = max(two_di, rn, di, d, head_t.shape[1])
    isum = np.empty((nb, widest), f32)           # the int8 sums before their scales
    wrow = np.empty(widest, f32)                 # one weight row widened to float32
    for b in range(nb):
        for i in range(d):
            h[b, i] = emb[idx[b], i]
    for l in range(n_layers):
        _rms_norm_rows(h, norm_w[l], eps[l], hn)
        _matvec_rows(hn, in_wt[l], in_s[l], xz, False, wkind, isum, wrow)
        cw, cb, cv = conv_w[l], conv_b[l], conv[l]
        for b in range(nb):
            for c in range(di):
                cv[b, slot, c] = xz[b, c]
            for c in range(di):
                xc[b, c] = cb[c]
            for t in range(k):                     # tap t reads the input k-1-t steps back
                s = (slot - (k - 1 - t)) % k
                for c in range(di):
                    xc[b, c] += cw[t, c] * cv[b, s, c]
            for c in range(di):
                v = xc[b, c]
                xc[b, c] = v / (_ONE + fast_exp_f32(-v))          # silu
        _matvec_rows(xc, x_wt[l], x_s[l], xdbl, False, wkind, isum, wrow)
        for b in range(nb):
            for j in range(r):
                dt_in[b, j] = xdbl[b, j]
        _matvec_rows(dt_in, dt_wt[l], dt_s[l], dt, False, wkind, isum, wrow)
        Al, Dl, dbl = A[l], D[l], dt_b[l]
        for b in range(nb):
            hs = ssm[l, b]                                     # (di, n)
            for j in range(n):
                Bv[j] = xdbl[b, r + j]
                Cv[j] = xdbl[b, r + n + j]
            for c in range(di):
                dtv[c] = fast_softplus_f32(dt[b, c] + dbl[c])
            # the decays first, in one flat loop that vectorizes (exp inlined W lanes at a time)
            for c in range(di):
                for j in range(n):
                    dA[c, j] = dtv[c] * Al[c, j]
            for i in range(di * n):
                dA_flat[i] = fast_exp_f32(dA_flat[i])
            for c in range(di):
                u = xc[b, c]
                dtu = dtv[c] * u
                acc = np.float32(0.0)
                for j in range(n):
                    hj = dA[c, j] * hs[c, j] + dtu * Bv[j]
                    hs[c, j] = hj
                    acc += hj * Cv[j]
                zc = xz[b, di + c]
                y[b, c] = (acc + Dl[c] * u) * (zc / (_ONE + fast_exp_f32(-zc)))     # * silu(z)
        _matvec_rows(y, out_wt[l], out_s[l], h, True, wkind, isum, wrow)
    _rms_norm_rows(h, norm_w[n_layers], eps[n_layers], hn)
    _matvec_rows(hn, head_t, head_s, logits, False, wkind, isum, wrow)

