"""sonata/kernels/mamba3/reference.py: the Mamba-3 scan step by step, the oracle of the fast paths.

The scan, as mamba_ssm's released Mamba-3 computes it (SISO: rank R = 1; MIMO: rank R > 1), per
head, with the state S (headdim p x d_state n):

    Theta_t = Theta_{t-1} + angle_t                          the accumulated rotation angles
    q_t,r = rot(q_t,r, Theta_t),  k_t,r = rot(k_t,r, Theta_t)  each rank r of C (q) and B (k)
    v_t,r = x_t * mimo_x[r]                                  (SISO: v = x)
    S_t = alpha_t S_{t-1} + beta_t sum_r v_{t-1,r} k_{t-1,r}^T + gamma_t sum_r v_t,r k_t,r^T
          alpha = exp(dt A), beta = (1 - trap) dt alpha, gamma = trap dt
    y_t,r = S_t q_t,r + D v_t,r

`rot(., Theta)` turns pairs of state channels by one angle per pair: `adjacent` pairs (0, 1), (2,
3), ... of the first 2 x n_angles channels (mamba_ssm's SISO), or `half` pairs (j, j + n/2) for
j < n_angles (its MIMO kernels' layout). Shapes: q, k (b, L, R, h, n), the B/C bias already
added; x (b, L, h, p); dt, A, trap (b, L, h) (dt > 0, A < 0, trap in [0, 1]); angle (b, L, h,
n_angles) the step's angles (mamba_ssm: pi tanh(theta) dt); D (h,); mimo_x (h, R, p) or None.
The state between calls: (Theta (b, h, n_angles), S (b, h, p, n), k_prev (b, R, h, n) rotated,
x_prev (b, h, p)), mamba_ssm's (angle, ssm, k, v) cache in its order. Given float64 tensors the
whole computation is float64.
"""
from __future__ import annotations

import torch

PAIRINGS = ("adjacent", "half")


def rotate(v, angle, pairing="adjacent"):
    """Turn pairs of v's state channels (last dim n) by `angle` (..., n_angles), broadcast against
    v's leading dims: `adjacent` pairs (2j, 2j+1), `half` pairs (j, j + n/2), j < n_angles."""
    m = angle.shape[-1]
    if m == 0:
        return v
    cos, sin = torch.cos(angle).to(v.dtype), torch.sin(angle).to(v.dtype)
    if pairing == "adjacent":
        v1, v2 = v[..., 0:2 * m:2], v[..., 1:2 * m:2]
        out = torch.stack([v1 * cos - v2 * sin, v1 * sin + v2 * cos], dim=-1).flatten(-2)
        return torch.cat([out, v[..., 2 * m:]], dim=-1)
    half = v.shape[-1] // 2
    v1, v2 = v[..., :m], v[..., half:half + m]
    return torch.cat([v1 * cos - v2 * sin, v[..., m:half], v1 * sin + v2 * cos, v[..., half + m:]], dim=-1)


def ranked(x, mimo_x):
    """x (..., h, p) -> v (..., R, h, p): the rank-R up-projection x * mimo_x[:, r] (SISO: R = 1)."""
    if mimo_x is None:
        return x.unsqueeze(-3)
    return x.unsqueeze(-3) * mimo_x.transpose(0, 1).to(x.dtype)


def empty_state(b, R, h, p, n, n_angles, device=None, dtype=torch.float32):
    """The zero state (Theta, S, k_prev, x_prev); Theta is float64 (it accumulates unbounded)."""
    return (torch.zeros(b, h, n_angles, device=device, dtype=torch.float64),
            torch.zeros(b, h, p, n, device=device, dtype=dtype),
            torch.zeros(b, R, h, n, device=device, dtype=dtype),
            torch.zeros(b, h, p, device=device, dtype=dtype))


def step_ref(q, k, x, dt, A, trap, angle, D, mimo_x, pairing, state):
    """One token of the scan, functional: q, k (b, R, h, n); x (b, h, p); dt, A, trap (b, h);
    angle (b, h, n_angles) -> y (b, R, h, p), the new state."""
    Theta, S, kp, xp = state
    Theta = Theta + angle.to(Theta.dtype)
    th = Theta[:, None]                                                    # over the ranks
    qr, kr = rotate(q, th, pairing), rotate(k, th, pairing)
    v, vp = ranked(x, mimo_x), ranked(xp, mimo_x)
    alpha = torch.exp(dt * A)
    beta = (1 - trap) * dt * alpha
    gamma = trap * dt
    S = (alpha[..., None, None] * S + beta[..., None, None] * torch.einsum("brhn,brhp->bhpn", kp, vp)
         + gamma[..., None, None] * torch.einsum("brhn,brhp->bhpn", kr, v))
    y = torch.einsum("bhpn,brhn->brhp", S, qr)
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * v
    return y, (Theta, S, kr, x)


def mamba3_ref(q, k, x, dt, A, trap, angle, D=None, mimo_x=None, pairing="adjacent", state=None):
    """The scan token by token (module docstring) -> y (b, L, R, h, p), the final state."""
    b, L, R, h, n = q.shape
    st = state if state is not None else empty_state(b, R, h, x.shape[-1], n, angle.shape[-1], x.device, x.dtype)
    ys = []
    for t in range(L):
        y, st = step_ref(q[:, t], k[:, t], x[:, t], dt[:, t], A[:, t], trap[:, t], angle[:, t], D, mimo_x,
                         pairing, st)
        ys.append(y)
    y = torch.stack(ys, 1) if ys else x.new_zeros(b, 0, R, h, x.shape[-1])
    return y, st


__all__ = ["PAIRINGS", "empty_state", "mamba3_ref", "ranked", "rotate", "step_ref"]
