"""sonata/kernels/mamba3/ssd_form.py: the SISO Mamba-3 scan (rank 1) on the SSD kernel.

With k and q turned by their accumulated angle (the "RoPE trick"), the SISO update is a real
SSD. Its two input terms per step, gamma_t v_t k_t^T and beta_t v_{t-1} k_{t-1}^T, fold into
one: the pair (k_s, v_s) enters with gamma_s at step s and with beta_{s+1} = (1 - trap_{s+1})
dt_{s+1} alpha_{s+1} at step s+1, and alpha_{s+1} is the decay from s to s+1, so the state is
an SSD with the input weight w_s = gamma_s + (1 - trap_{s+1}) dt_{s+1} (chunked.py's fold), less
the part of it the output at s itself must not see yet: y_s -= (1 - trap_{s+1}) dt_{s+1}
(q_s . k_s) v_s. The pending term of the last token (its k and v) is the state's k_prev and
x_prev; the first token's, from the state before, enters the initial state. One SSD call of
h heads, the same work as Mamba-2's.

The per-token A enters as the kernel's step size dt_k = dt |A| with the kernel's A = -1, the
input x w / dt_k (the kernel multiplies by dt_k again). dt_k is floored at 1e-12 in the kernel's
step and its division alike, so the input weight stays exactly w, and the decay differs from
exp(-dt |A|) by under 1e-12 where the floor applies (dt |A| under 1e-12: a step that decays
nothing). The SSD backends (fused numba on CPU, Triton on GPU) and their backward serve
Mamba-3 unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sonata.kernels.mamba3.reference import empty_state, rotate
from sonata.kernels.ssd import ssd

STEP_FLOOR = 1e-12


def mamba3_siso_ssd(q, k, x, dt, A, trap, angle, D=None, pairing="adjacent", state=None, chunk_size=64,
                    backend="auto"):
    """reference.mamba3_ref's result for R = 1 (q, k (b, L, 1, h, n)); trap None: exponential
    Euler (trap = 1) -> y (b, L, 1, h, p), the final state."""
    b, L, _, h, n = q.shape
    Theta0, S0, kp, xp = state if state is not None else empty_state(b, 1, h, x.shape[-1], n, angle.shape[-1],
                                                                      x.device, x.dtype)
    Theta = Theta0[:, None] + torch.cumsum(angle.to(torch.float64), dim=1)
    qr, kr = rotate(q[:, :, 0], Theta, pairing), rotate(k[:, :, 0], Theta, pairing)   # (b, L, h, n)
    dtk = (dt * -A).clamp_min(STEP_FLOOR)
    if trap is None:
        w, init, shift = dt, S0, None
    else:
        shift = F.pad(((1 - trap) * dt)[:, 1:], (0, 0, 0, 1))                       # (b, L, h)
        w = trap * dt + shift
        init = S0 + ((1 - trap[:, 0]) * dt[:, 0])[..., None, None] * xp[..., None] * kp[:, 0, :, None, :]
    minus_one = -torch.ones(h, device=x.device, dtype=x.dtype)
    y, hf = ssd(x * (w / dtk)[..., None], dtk, minus_one, kr, qr, chunk_size=chunk_size, initial_states=init,
                return_final_states=True, backend=backend)
    if shift is not None:
        y = y - (shift * (qr * kr).sum(-1))[..., None] * x
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * x
    return y[:, :, None], (Theta[:, -1], hf, kr[:, -1, None], x[:, -1])


__all__ = ["STEP_FLOOR", "mamba3_siso_ssd"]
