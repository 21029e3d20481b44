"""sonata/kernels/mamba3/cpu_step.py: the released Mamba-3 layer's one-token step (generation)
as one fused numba pass, from in_proj's output row to the gated output before out_proj.

Per batch row it normalises B and C once per rank and group, then per head: dt, A, trap, the
angles (added to the state's Theta), q and k with their biases turned by Theta, the state update
S = alpha S + beta sum_r v_prev,r k_prev,r^T + gamma sum_r v_r k_r^T, y_r = S q_r + D v_r, the
gate (and the per-head norm), the ranks' down-projection; k and x become the state's k_prev
and x_prev. The semantics are `sonata.model.mamba3.Mamba3Mixer`'s released form, its torch step
(`mamba3_step`, `reference.step_ref`) the reference the tests hold this to. Float32 or float64
(the state's dtype), Theta in float64; the state is updated in place. It replaces some forty
small torch ops per layer and token, whose dispatch is what a step at these sizes costs.
"""
from __future__ import annotations

import math

import torch

from sonata.kernels.dispatch import opaque

try:
    import numpy as np
    from numba import njit

    from sonata.kernels import numba_cache

    numba_cache.install()

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz"})
    def step_kernel(proj, offs, dims, dt_bias, Bw, Cw, Bb, Cb, D, mx, mz, mo, norm_w, consts, Theta, S, kp, xp, y):
        b = proj.shape[0]
        h, p, n, m, R, g = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]
        trapezoid, half = dims[6] != 0, dims[7] != 0
        a_min, bc_eps, norm_eps, gain = consts[0], consts[1], consts[2], consts[3]
        z_o, x_o, B_o, C_o, dt_o, A_o, tr_o, th_o = offs[0], offs[1], offs[2], offs[3], offs[4], offs[5], offs[6], offs[7]
        rep = h // g
        hn = n // 2
        Bn = np.empty((R, g, n), S.dtype)
        Cn = np.empty((R, g, n), S.dtype)
        qr = np.empty((R, n), S.dtype)
        kr = np.empty((R, n), S.dtype)
        yr = np.empty((R, p), S.dtype)
        for bi in range(b):
            row = proj[bi]
            for r in range(R):
                for gi in range(g):
                    base = (r * g + gi) * n
                    sb = 0.0
                    sc = 0.0
                    for k in range(n):
                        sb += row[B_o + base + k] ** 2
                        sc += row[C_o + base + k] ** 2
                    ib = 1.0 / math.sqrt(sb / n + bc_eps)
                    ic = 1.0 / math.sqrt(sc / n + bc_eps)
                    for k in range(n):
                        Bn[r, gi, k] = row[B_o + base + k] * ib * Bw[k]
                        Cn[r, gi, k] = row[C_o + base + k] * ic * Cw[k]
            for hh in range(h):
                gi = hh // rep
                v = row[dt_o + hh] + dt_bias[hh]
                dt = math.log1p(math.exp(v)) if v <= 20.0 else v
                a = row[A_o + hh]
                A = -(1.0 + a) if a >= 0.0 else -1.0 / (1.0 - a)
                A = min(A, -a_min)
                tr = 1.0 / (1.0 + math.exp(-row[tr_o + hh])) if trapezoid else 1.0
                alpha = math.exp(dt * A)
                beta = (1.0 - tr) * dt * alpha
                gamma = tr * dt
                for r in range(R):
                    for k in range(n):
                        qr[r, k] = Cn[r, gi, k] + Cb[hh, r, k]
                        kr[r, k] = Bn[r, gi, k] + Bb[hh, r, k]
                for j in range(m):
                    th = row[th_o + j]
                    if gain > 0.0:
                        ang = math.pi / (1.0 + math.exp(-gain * th))
                    else:
                        ang = math.pi * math.tanh(th) * dt
                    Theta[bi, hh, j] += ang
                    c, s = math.cos(Theta[bi, hh, j]), math.sin(Theta[bi, hh, j])
                    i0, i1 = (j, j + hn) if half else (2 * j, 2 * j + 1)
                    for r in range(R):
                        q0, q1 = qr[r, i0], qr[r, i1]
                        qr[r, i0], qr[r, i1] = q0 * c - q1 * s, q0 * s + q1 * c
                        k0, k1 = kr[r, i0], kr[r, i1]
                        kr[r, i0], kr[r, i1] = k0 * c - k1 * s, k0 * s + k1 * c
                for pi in range(p):
                    xv = row[x_o + hh * p + pi]
                    xpv = xp[bi, hh, pi]
                    Srow = S[bi, hh, pi]
                    for k in range(n):
                        prev = 0.0
                        cur = 0.0
                        for r in range(R):
                            prev += mx[hh, r, pi] * kp[bi, r, hh, k]
                            cur += mx[hh, r, pi] * kr[r, k]
                        Srow[k] = alpha * Srow[k] + beta * xpv * prev + gamma * xv * cur
                    for r in range(R):
                        acc = 0.0
                        for k in range(n):
                            acc += Srow[k] * qr[r, k]
                        yr[r, pi] = acc + D[hh] * xv * mx[hh, r, pi]
                    xp[bi, hh, pi] = xv
                for r in range(R):
                    scale = 1.0
                    if norm_w.shape[0] > 0:
                        ms = 0.0
                        for pi in range(p):
                            ms += yr[r, pi] ** 2
                        scale = 1.0 / math.sqrt(ms / p + norm_eps)
                    for pi in range(p):
                        w = norm_w[hh * p + pi] * scale if norm_w.shape[0] > 0 else 1.0
                        zv = row[z_o + hh * p + pi] * mz[hh, r, pi]
                        yr[r, pi] = yr[r, pi] * w * zv / (1.0 + math.exp(-zv)) * mo[hh, r, pi]
                for pi in range(p):
                    acc = 0.0
                    for r in range(R):
                        acc += yr[r, pi]
                    y[bi, hh * p + pi] = acc
                for r in range(R):
                    for k in range(n):
                        kp[bi, r, hh, k] = kr[r, k]
except ImportError:         # no numba: the torch step everywhere
    step_kernel = None


def can_fuse(state, proj) -> bool:
    """The fused step serves CPU float32 / float64 tensors with no gradient asked."""
    Theta, S, kp, xp = state
    return (step_kernel is not None and proj.device.type == "cpu" and S.dtype in (torch.float32, torch.float64)
            and Theta.dtype == torch.float64 and all(t.is_contiguous() for t in state)
            and kp.dtype == S.dtype and xp.dtype == S.dtype and not (torch.is_grad_enabled() and proj.requires_grad))


@opaque
def mamba3_step_cpu(proj, sizes, mixer_params, dims, consts, state):
    """One token: proj (b, W) in_proj's output; sizes the split of W (z x B C dt A trap angles);
    mixer_params (dt_bias, B_norm w, C_norm w, B_bias, C_bias, D, mimo_x, mimo_z, mimo_o, norm w
    or None); dims (h, p, n, n_angles, R, ngroups, trapezoid, half pairing); consts (a_min, B/C
    norm eps, output norm eps, bounded-angle gain or 0); state (Theta, S, k_prev, x_prev) updated
    in place -> y (b, d_inner) in S's dtype, before out_proj."""
    dtype = state[1].dtype
    h, p = dims[0], dims[1]
    R = dims[4]

    def arr(t, shape=None):
        t = t.detach().to(dtype)
        if shape is not None:
            t = t.expand(shape)
        return t.contiguous().numpy()

    dt_bias, Bw, Cw, Bb, Cb, D, mx, mz, mo, norm_w = mixer_params
    ones = torch.ones(h, R, p, dtype=dtype)
    offs = np.cumsum([0] + list(sizes[:-1])).astype(np.int64)
    y = np.empty((proj.shape[0], h * p), dtype=state[1].numpy().dtype)
    step_kernel(arr(proj), offs, np.array(dims, np.int64), arr(dt_bias), arr(Bw), arr(Cw), arr(Bb), arr(Cb), arr(D),
                arr(ones if mx is None else mx), arr(ones if mz is None else mz), arr(ones if mo is None else mo),
                np.empty(0, y.dtype) if norm_w is None else arr(norm_w), np.array(consts, np.float64),
                *(t.numpy() for t in state), y)
    return torch.from_numpy(y)


__all__ = ["can_fuse", "mamba3_step_cpu", "step_kernel"]
