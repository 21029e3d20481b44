"""The Mamba-3 block family, SISO (`model.arch=mamba3`; Lahoti, Li, Chen, Wang, Bick, Kolter,
Dao, Gu, ICLR 2026), written from the paper's equations:

    z, x, B, C, dt, a, lam, theta = in_proj(u)        no short convolution
    Delta = softplus(dt + dt_bias),  A = -max(softplus(a + a_bias), a_min)   per head, data-dependent
    lam   = sigmoid(lam + lam_bias)                   the trapezoid's mix of the step's two ends
    B, C  = RMSNorm(B), RMSNorm(C) + a learned bias per head (initialised to 1)
    h_t   = alpha_t R(phi_t) h_{t-1} + beta_t R(phi_t) B_{t-1} x_{t-1}^T + gamma_t B_t x_t^T
            alpha = exp(Delta A), beta = (1 - lam) Delta exp(Delta A), gamma = lam Delta
    y_t   = h_t C_t + D x_t;   out = out_proj(norm(y * silu(z)))

R(phi) rotates pairs of the first R = rope_fraction x N state channels by phi_t = Delta_t
theta_t (a complex-valued state written in real pairs); `model.rope_fraction=0` turns the
rotation off, `model.trapezoid=false` makes lam = 1 (exponential Euler: Mamba-2's update).
`model.bounded_angle=g` (g > 0; not the paper's) makes the step's angle pi sigmoid(g theta_t):
within (0, pi), and 0 and a half turn are reached by saturation, so an angle that a token must
turn by exactly pi (parity) stops depending on the rest of the layer's input. Notebook 10
trains it as "Mamba-3, half-turn angle" beside the paper's angle; it cannot turn by more than
pi, which a sum mod 5 needs (docs/results.md). mamba_ssm's released Mamba-3 differs from the
equations above in two places sonata keeps as the paper prints them: its step angle is
Delta_t pi tanh(theta_t) with one theta per pair shared by every head, and its A has no bias
(|A| = softplus(0) at a zero input, where `a_bias` starts |A| in U(1, 16) as Mamba-2's A).

The fast path runs on the SSD kernel (`sonata.kernels.ssd.ssd`). In the frame that turns with
the accumulated angle Theta_t = phi_1 + ... + phi_t (h~ = R(-Theta) h) the rotation moves onto
B and C (B~_t = R(-Theta_t) B_t, the "RoPE trick") and the update is a real SSD whose input at
t is the sum of two rank-one terms; each term is a set of heads of one SSD call (the second
reads B~_{t-1} and x_{t-1}), sharing the decays, and their outputs add. The per-head data-
dependent A enters as the kernel's step size Delta |A| with A = -1, the inputs scaled to match
(which is why |A| is floored at a_min). `recurrence_ref` is the update above step by step, in
float64 when given float64: the oracle the tests hold the fast path to. The state carried
between calls (and by the one-token `step`) is (h~, Theta, x_{t-1}, B~_{t-1}).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.kernels.ssd import ssd
from sonata.model import mamba2
from sonata.model.block import PreNormBlock, dt_bias_init
from sonata.model.norm import GatedRMSNorm
from sonata.model.quant import QLinear


def rotated_dims(cfg: ModelConfig) -> int:
    """R: the state channels that rotate (an even count, pairs (0, 1), (2, 3), ...)."""
    return 2 * int(cfg.d_state * cfg.rope_fraction // 2)


def rotate(v, angle):
    """Rotate pairs of v's first 2 * angle.shape[-1] channels by `angle` (..., R/2); v (..., N)."""
    r = 2 * angle.shape[-1]
    if r == 0:
        return v
    v1, v2 = v[..., 0:r:2], v[..., 1:r:2]
    cos, sin = torch.cos(angle).to(v.dtype), torch.sin(angle).to(v.dtype)
    out = torch.stack([v1 * cos - v2 * sin, v1 * sin + v2 * cos], dim=-1).flatten(-2)
    return torch.cat([out, v[..., r:]], dim=-1)


def recurrence_ref(x, delta, A, lam, phi, B, C, D=None, state=None):
    """The Mamba-3 SISO update step by step, unrotated frame. x (b, L, h, p); delta, A, lam
    (b, L, h) (delta after softplus, A < 0); phi (b, L, h, R/2) the step's angles; B, C
    (b, L, h, n); D (h,). state: (h (b, h, p, n), B_prev (b, h, n), x_prev (b, h, p)) or None.
    -> y (b, L, h, p), the final (h, B_{L-1}, x_{L-1})."""
    b, L, H, P = x.shape
    n = B.shape[-1]
    if state is None:
        h = x.new_zeros(b, H, P, n)
        Bp, xp = x.new_zeros(b, H, n), x.new_zeros(b, H, P)
    else:
        h, Bp, xp = (t.clone() for t in state)
    ys = []
    for t in range(L):
        alpha = torch.exp(delta[:, t] * A[:, t])                                 # (b, h)
        beta = (1 - lam[:, t]) * delta[:, t] * alpha
        gamma = lam[:, t] * delta[:, t]

        def turn(m):                                       # R(phi_t) on the state channels
            return rotate(m, phi[:, t, :, None, :] if m.dim() == 4 else phi[:, t])

        h = (alpha[..., None, None] * turn(h) + beta[..., None, None] * turn(xp[..., None] * Bp[:, :, None, :])
             + gamma[..., None, None] * x[:, t, ..., None] * B[:, t, :, None, :])
        y = torch.einsum("bhpn,bhn->bhp", h, C[:, t])
        if D is not None:
            y = y + D[:, None] * x[:, t]
        ys.append(y)
        Bp, xp = B[:, t], x[:, t]
    return torch.stack(ys, 1), (h, Bp, xp)


class Mamba3Mixer(nn.Module):
    """The Mamba-3 SISO layer (module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, di, n, g, h = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.ngroups, cfg.nheads
        self.cfg, self.R = cfg, rotated_dims(cfg)
        self.sizes = [di, di, g * n, g * n, h, h, h, h * self.R // 2]     # z x B C dt a lam theta
        self.in_proj = QLinear(d, sum(self.sizes), bias=False)
        self.dt_bias = nn.Parameter(dt_bias_init(cfg, h))
        a0 = torch.empty(h).uniform_(1, 16)                                     # |A| at a = 0: U(1, 16)
        self.a_bias = nn.Parameter(a0 + torch.log(-torch.expm1(-a0)))          # softplus^-1
        self.lam_bias = nn.Parameter(torch.zeros(h))                            # lam = 0.5 at a zero input
        self.B_norm = nn.Parameter(torch.ones(n))
        self.C_norm = nn.Parameter(torch.ones(n))
        self.B_bias = nn.Parameter(torch.ones(h, n))
        self.C_bias = nn.Parameter(torch.ones(h, n))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = GatedRMSNorm(di, di // g, eps=cfg.norm_eps)
        self.out_proj = QLinear(di, d, bias=False)

    @torch.no_grad()
    def constrain_A(self, a_min: float) -> None:
        """A is floored at -a_min by construction (`ssm_inputs`): nothing to project."""

    def ssm_inputs(self, u):
        """u (b, L, d) -> z (b, L, di), x (b, L, h, p), delta, A, lam (b, L, h), phi (b, L, h, R/2),
        B, C (b, L, h, n) before the rotation."""
        c = self.cfg
        b, L, _ = u.shape
        z, x, B, C, dt, a, lam, theta = self.in_proj(u).split(self.sizes, dim=-1)
        ct = torch.float64 if u.dtype == torch.float64 else torch.float32     # float64: the tests
        delta = F.softplus(dt.to(ct) + self.dt_bias.to(ct))
        A = -F.softplus(a.to(ct) + self.a_bias.to(ct)).clamp(min=c.a_min)
        lam = torch.sigmoid(lam.to(ct) + self.lam_bias.to(ct)) if c.trapezoid else torch.ones_like(delta)
        theta = theta.to(ct).reshape(b, L, c.nheads, self.R // 2)
        if c.bounded_angle > 0:                      # a half turn at most, reached by saturation
            phi = math.pi * torch.sigmoid(c.bounded_angle * theta)
        else:
            phi = delta[..., None] * theta
        rep = c.nheads // c.ngroups

        def bc(t, w, bias):
            t = t.to(ct).reshape(b, L, c.ngroups, c.d_state)
            t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w.to(ct)
            return t.repeat_interleave(rep, dim=2) + bias.to(ct)

        return (z, x.to(ct).reshape(b, L, c.nheads, c.headdim), delta, A, lam, phi,
                bc(B, self.B_norm, self.B_bias), bc(C, self.C_norm, self.C_bias))

    def empty_state(self, batch: int, device, dtype=torch.float32):
        c = self.cfg
        ct = torch.float64 if dtype == torch.float64 else torch.float32
        return (torch.zeros(batch, c.nheads, c.headdim, c.d_state, device=device, dtype=ct),   # h~
                torch.zeros(batch, c.nheads, self.R // 2, device=device, dtype=torch.float64),  # Theta
                torch.zeros(batch, c.nheads, c.headdim, device=device, dtype=ct),              # x_{t-1}
                torch.zeros(batch, c.nheads, c.d_state, device=device, dtype=ct))              # B~_{t-1}

    def _scan(self, x, delta, A, lam, phi, B, C, state):
        """The SSD form of the update: -> y (b, L, h, p) before D, the new state."""
        c = self.cfg
        h0, theta0, xp, Bp = state
        Theta = theta0[:, None] + torch.cumsum(phi.double(), dim=1)                # (b, L, h, R/2)
        Bt, Ct = rotate(B, -Theta), rotate(C, -Theta)
        absA = -A
        dtk = delta * absA                                                        # the kernel's step
        xs, Bs, inits = [x * (lam / absA)[..., None]], [Bt], [h0]
        if c.trapezoid:
            x_prev = torch.cat([xp[:, None], x[:, :-1]], dim=1)
            B_prev = torch.cat([Bp[:, None], Bt[:, :-1]], dim=1)
            xs.append(x_prev * ((1 - lam) * torch.exp(delta * A) / absA)[..., None])
            Bs.append(B_prev)
            inits.append(torch.zeros_like(h0))
        k = len(xs)
        ones = -torch.ones(c.nheads * k, device=x.device, dtype=x.dtype)
        y, hf = ssd(torch.cat(xs, 2), dtk.repeat(1, 1, k), ones, torch.cat(Bs, 2), Ct.repeat(1, 1, k, 1),
                    chunk_size=c.chunk_size, initial_states=torch.cat(inits, 1), return_final_states=True,
                    backend=c.backend)
        H = c.nheads
        y = sum(y[:, :, i * H:(i + 1) * H] for i in range(k))
        hf = sum(hf[:, i * H:(i + 1) * H] for i in range(k))
        return y, (hf, Theta[:, -1], x[:, -1], Bt[:, -1])

    def forward(self, u, state=None, return_state: bool = False):
        """-> out (b, L, d); with `return_state` (or a `state`) -> (out, state)."""
        b, L, _ = u.shape
        st = state if state is not None else self.empty_state(b, u.device, u.dtype)
        if L == 0:
            out = self.out_proj(u.new_zeros(b, 0, self.cfg.d_inner))
            return (out, st) if (state is not None or return_state) else out
        z, x, delta, A, lam, phi, B, C = self.ssm_inputs(u)
        y, new = self._scan(x, delta, A, lam, phi, B, C, st)
        y = (y + x * self.D.to(x.dtype)[:, None]).reshape(b, L, self.cfg.d_inner).to(z.dtype)
        out = self.out_proj(self.norm(y, z))
        return (out, new) if (state is not None or return_state) else out

    @torch.no_grad()
    def step(self, u, state):                                           # u (b, d)
        """One token of the update in the turning frame (the state is updated in place)."""
        c = self.cfg
        h, Theta, xp, Bp = state
        z, x, delta, A, lam, phi, B, C = self.ssm_inputs(u[:, None])
        x, delta, A, lam, B, C = x[:, 0], delta[:, 0], A[:, 0], lam[:, 0], B[:, 0], C[:, 0]
        Theta += phi[:, 0].double()
        Bt, Ct = rotate(B, -Theta), rotate(C, -Theta)
        alpha = torch.exp(delta * A)
        h.mul_(alpha[..., None, None])
        h.add_((lam * delta)[..., None, None] * x[..., None] * Bt[:, :, None, :])
        if c.trapezoid:
            h.add_(((1 - lam) * delta * alpha)[..., None, None] * xp[..., None] * Bp[:, :, None, :])
        y = torch.einsum("bhpn,bhn->bhp", h, Ct) + x * self.D.to(x.dtype)[:, None]
        xp.copy_(x)
        Bp.copy_(Bt)
        y = self.norm(y.reshape(u.shape[0], c.d_inner).to(z.dtype), z[:, 0])
        return self.out_proj(y), state

    def prefill(self, u):
        return self.forward(u, None, return_state=True)


def check(cfg: ModelConfig) -> list[str]:
    """The family's errors (sonata.model.families): the SSD head layout (Mamba-2's check) and a
    rotation that turns at least one pair of state channels. Writes nothing."""
    errors = mamba2.check(cfg)
    if cfg.rope_fraction != 0 and rotated_dims(cfg) < 2:
        errors.append(f"model.rope_fraction={cfg.rope_fraction:g} rotates no pair of the {cfg.d_state} state "
                      f"channels (2 x floor(d_state x fraction / 2) = 0): give at least {2 / cfg.d_state:g} to "
                      f"rotate a pair, or 0 to turn the rotation off")
    return errors


class Mamba3Block(PreNormBlock):
    """Pre-norm residual block around the Mamba-3 layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, Mamba3Mixer(cfg))


__all__ = ["Mamba3Block", "Mamba3Mixer", "check", "recurrence_ref", "rotate", "rotated_dims"]
