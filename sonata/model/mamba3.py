"""The Mamba-3 block family (`model.arch=mamba3`; Lahoti, Li, Chen, Wang, Bick, Kolter, Dao, Gu,
ICLR 2026), in two forms of one block (`model.mamba3_form`).

**released** (the default): mamba_ssm's `Mamba3` module as released, SISO and MIMO
(docs/models.md has the equations and the argument map):

    z, x, B, C, dd_dt, dd_A, trap, theta = in_proj(u)    no short convolution; theta: one per pair
    dt = softplus(dd_dt + dt_bias),  A = -max(heavy_tail(dd_A), a_min)     per head, per token
    trap = sigmoid(trap);  angle = pi tanh(theta) dt    (every head turns its pairs by theta's angles)
    q = RMSNorm(C) + C_bias,  k = RMSNorm(B) + B_bias     per rank r, group-shared, biased per head
    the scan (sonata.kernels.mamba3): S_t = alpha S + beta sum_r v_{t-1,r} k_{t-1,r}^T
        + gamma sum_r v_t,r k_t,r^T with k, q turned by the accumulated angle; y_r = S q_r + D v_r
    out_r = y_r silu(z_r)  (outproj_norm: RMSNorm_head(y_r) w silu(z_r));  z_r = z mimo_z[r]
    out = out_proj(sum_r out_r mimo_o[r])      (SISO: R = 1, v = x, no mimo_* parameters)

with heavy_tail(a) = 1 + a for a >= 0, 1 / (1 - a) below. MIMO (`model.mimo_rank` R > 1) pairs
state channel j with j + N/2 for the rotation, as mamba_ssm's MIMO kernels do; SISO pairs
neighbours. Parameter names and shapes are mamba_ssm's (in_proj, dt_bias, B_bias / C_bias (h,
R, N), B_norm / C_norm, mimo_x / mimo_z / mimo_o (h, R, p), D, norm, out_proj), so its
state_dict loads as it is (sonata.interop.mamba_ssm's Mamba3).

**paper**: sonata's first reading of the paper's equations, kept for notebook 10's study rows:

    Delta = softplus(dt + dt_bias),  A = -max(softplus(a + a_bias), a_min)   a_bias: |A| in U(1, 16)
    lam = sigmoid(lam + lam_bias);  phi_t = Delta_t theta_t, one theta per head and pair
    h_t = alpha_t R(phi_t) h_{t-1} + beta_t R(phi_t) B_{t-1} x_{t-1}^T + gamma_t B_t x_t^T
    out = out_proj(GatedRMSNorm(y * silu(z)))       (Mamba-2's norm, ngroups groups)

Both forms: `model.rope_fraction` (the rotated share of the state; 0: no rotation),
`model.trapezoid=false` (lam = trap = 1: exponential Euler, Mamba-2's update) and
`model.bounded_angle=g` (g > 0; not the paper's: the step angle is pi sigmoid(g theta), within
(0, pi), and 0 and a half turn are reached by saturation, notebook 10's half-turn row).

The scan runs in sonata.kernels.mamba3: SISO on the SSD kernel (the "RoPE trick": in the frame
that turns with the accumulated angle the update is a real SSD), MIMO in chunks of matrix
products; `mamba3_ref` is the update token by token, float64 when given float64, the oracle
the tests hold both to. In the paper form the state turns by +phi, which is the kernel's
rotation of k and q by -Theta: its angle goes in negated. `recurrence_ref` is the paper form's
update in the unrotated frame, a second, independent oracle. The state carried between calls
(and by the one-token `step`) is the kernel's (Theta, S, k_prev, x_prev), mamba_ssm's
(angle_dt_state, ssm_state, k_state, v_state) with the angle unwrapped in float64.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.kernels.mamba3 import empty_state, mamba3_scan, mamba3_step, rotate
from sonata.kernels.mamba3.cpu_step import can_fuse, mamba3_step_cpu
from sonata.model import mamba2
from sonata.model.block import PreNormBlock, dt_bias_init
from sonata.model.norm import GatedRMSNorm, RMSNorm
from sonata.model.quant import QLinear


def rotated_dims(cfg: ModelConfig) -> int:
    """The state channels that rotate (an even count: n_angles = rotated_dims / 2 pairs)."""
    return 2 * int(cfg.d_state * cfg.rope_fraction // 2)


def heavy_tail(a):
    """mamba_ssm's activation of the data-dependent A: 1 + a for a >= 0, 1 / (1 - a) below."""
    return a.clamp_min(0) + torch.reciprocal(1 - a.clamp_max(0))


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
    """The Mamba-3 layer, either form (module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, di, n, g, h, p = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.ngroups, cfg.nheads, cfg.headdim
        self.cfg, self.R = cfg, rotated_dims(cfg)
        self.released = cfg.mamba3_form == "released"
        self.rank = cfg.mimo_rank if self.released else 1
        self.n_angles = self.R // 2
        self.pairing = "half" if self.rank > 1 else "adjacent"
        r = self.rank
        angles = self.n_angles if self.released else h * self.n_angles
        self.sizes = [di, di, r * g * n, r * g * n, h, h, h, angles]       # z x B C dt A trap angles
        self.in_proj = QLinear(d, sum(self.sizes), bias=False)
        self.dt_bias = nn.Parameter(dt_bias_init(cfg, h))
        self.D = nn.Parameter(torch.ones(h))
        if self.released:
            self.B_bias = nn.Parameter(torch.ones(h, r, n))
            self.C_bias = nn.Parameter(torch.ones(h, r, n))
            self.B_norm = RMSNorm(n, eps=cfg.norm_eps)
            self.C_norm = RMSNorm(n, eps=cfg.norm_eps)
            if r > 1:                                                    # mamba_ssm's MIMO initialisation
                self.mimo_x = nn.Parameter(torch.ones(h, r, p) / r)
                self.mimo_z = nn.Parameter(torch.ones(h, r, p))
                self.mimo_o = nn.Parameter(torch.ones(h, r, p) / r)
            if cfg.outproj_norm:
                self.norm = GatedRMSNorm(di, p, eps=cfg.norm_eps, norm_before_gate=True)
        else:
            a0 = torch.empty(h).uniform_(1, 16)                                 # |A| at a = 0: U(1, 16)
            self.a_bias = nn.Parameter(a0 + torch.log(-torch.expm1(-a0)))      # softplus^-1
            self.lam_bias = nn.Parameter(torch.zeros(h))                        # lam = 0.5 at a zero input
            self.B_norm = nn.Parameter(torch.ones(n))
            self.C_norm = nn.Parameter(torch.ones(n))
            self.B_bias = nn.Parameter(torch.ones(h, n))
            self.C_bias = nn.Parameter(torch.ones(h, n))
            self.norm = GatedRMSNorm(di, di // g, eps=cfg.norm_eps)
        self.out_proj = QLinear(di, d, bias=False)

    @torch.no_grad()
    def constrain_A(self, a_min: float) -> None:
        """A is floored at -a_min by construction (`ssm_inputs`): nothing to project."""

    def ssm_inputs(self, u):
        """u (b, L, d) -> z (b, L, di); the scan's inputs x (b, L, h, p), dt, A (b, L, h), trap
        (b, L, h) or None (Euler), angle (b, L, h, n_angles), q (C), k (B) (b, L, R, h, n)."""
        c = self.cfg
        b, L, _ = u.shape
        z, x, B, C, dt, a, trap, theta = self.in_proj(u).split(self.sizes, dim=-1)
        ct = torch.float64 if u.dtype == torch.float64 else torch.float32     # float64: the tests
        dt = F.softplus(dt.to(ct) + self.dt_bias.to(ct))
        h, m, rep = c.nheads, self.n_angles, c.nheads // c.ngroups
        if self.released:
            A = (-heavy_tail(a.to(ct))).clamp(max=-c.a_min)
            trap = torch.sigmoid(trap.to(ct)) if c.trapezoid else None
            theta = theta.to(ct)[:, :, None, :]                                 # shared by the heads
            angle = (math.pi * torch.sigmoid(c.bounded_angle * theta)).expand(b, L, h, m) if c.bounded_angle > 0 \
                else math.pi * torch.tanh(theta) * dt[..., None]

            def bc(t, norm, bias):
                t = norm(t.to(ct).reshape(b, L, self.rank, c.ngroups, c.d_state))
                return t.repeat_interleave(rep, dim=3) + bias.transpose(0, 1).to(ct)
            q, k = bc(C, self.C_norm, self.C_bias), bc(B, self.B_norm, self.B_bias)
        else:
            A = -F.softplus(a.to(ct) + self.a_bias.to(ct)).clamp(min=c.a_min)
            trap = torch.sigmoid(trap.to(ct) + self.lam_bias.to(ct)) if c.trapezoid else None
            theta = theta.to(ct).reshape(b, L, h, m)
            phi = math.pi * torch.sigmoid(c.bounded_angle * theta) if c.bounded_angle > 0 else dt[..., None] * theta
            angle = -phi                             # the state turns by +phi: k and q by -Theta

            def bc(t, w, bias):
                t = t.to(ct).reshape(b, L, c.ngroups, c.d_state)
                t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w.to(ct)
                return (t.repeat_interleave(rep, dim=2) + bias.to(ct))[:, :, None]
            q, k = bc(C, self.C_norm, self.C_bias), bc(B, self.B_norm, self.B_bias)
        return z, x.to(ct).reshape(b, L, h, c.headdim), dt, A, trap, angle, q, k

    def empty_state(self, batch: int, device, dtype=torch.float32):
        c = self.cfg
        ct = torch.float64 if dtype == torch.float64 else torch.float32
        return empty_state(batch, self.rank, c.nheads, c.headdim, c.d_state, self.n_angles, device, ct)

    def scan(self, x, dt, A, trap, angle, q, k, state=None):
        """The scan on `ssm_inputs`' tensors -> y (b, L, R, h, p) (D included), the final state."""
        mimo_x = self.mimo_x if self.rank > 1 else None
        return mamba3_scan(q, k, x, dt, A, trap, angle, self.D, mimo_x, self.pairing, state,
                           chunk_size=self.cfg.chunk_size, backend=self.cfg.backend)

    def gate_out(self, y, z):
        """y (b, L, R, h, p) from the scan, z (b, L, di) -> out (b, L, d): the gate (and norm), the
        down-projection of the ranks, out_proj."""
        c = self.cfg
        b, L = y.shape[:2]
        if not self.released:
            return self.out_proj(self.norm(y[:, :, 0].reshape(b, L, c.d_inner).to(z.dtype), z))
        zr = z.to(y.dtype).reshape(b, L, 1, c.nheads, c.headdim)
        if self.rank > 1:
            zr = zr * self.mimo_z.transpose(0, 1).to(y.dtype)
        if c.outproj_norm:
            shape = (b, L, self.rank, c.d_inner)
            y = self.norm(y.reshape(shape), zr.expand(y.shape).reshape(shape)).reshape(y.shape)
        else:
            y = y * F.silu(zr)
        y = (y * self.mimo_o.transpose(0, 1).to(y.dtype)).sum(2) if self.rank > 1 else y[:, :, 0]
        return self.out_proj(y.reshape(b, L, c.d_inner).to(z.dtype))

    def forward(self, u, state=None, return_state: bool = False):
        """-> out (b, L, d); with `return_state` (or a `state`) -> (out, state)."""
        b, L, _ = u.shape
        st = state if state is not None else self.empty_state(b, u.device, u.dtype)
        if L == 0:
            out = self.out_proj(u.new_zeros(b, 0, self.cfg.d_inner))
            return (out, st) if (state is not None or return_state) else out
        z, x, dt, A, trap, angle, q, k = self.ssm_inputs(u)
        y, new = self.scan(x, dt, A, trap, angle, q, k, st)
        out = self.gate_out(y, z)
        return (out, new) if (state is not None or return_state) else out

    @torch.no_grad()
    def step(self, u, state):                                           # u (b, d)
        """One token (the state is updated in place) -> (out (b, d), state). The released form
        on CPU runs one fused numba pass from in_proj's output to the gated output
        (sonata.kernels.mamba3.cpu_step); the torch ops below are its reference."""
        if self.released and self.cfg.backend in ("auto", "cpu"):
            proj = self.in_proj(u)
            if can_fuse(state, proj):
                return self.out_proj(mamba3_step_cpu(proj, self.sizes, self.step_params(), self.step_dims(),
                                                     self.step_consts(), state).to(u.dtype)), state
        z, x, dt, A, trap, angle, q, k = self.ssm_inputs(u[:, None])
        y = mamba3_step(q[:, 0], k[:, 0], x[:, 0], dt[:, 0], A[:, 0], None if trap is None else trap[:, 0],
                        angle[:, 0], self.D, self.mimo_x if self.rank > 1 else None, self.pairing, state)
        return self.gate_out(y[:, None], z)[:, 0], state

    def prefill(self, u):
        return self.forward(u, None, return_state=True)

    def step_params(self):
        """The released form's tensors, in the fused step's order."""
        multi = self.rank > 1
        return (self.dt_bias, self.B_norm.weight, self.C_norm.weight, self.B_bias, self.C_bias, self.D,
                self.mimo_x if multi else None, self.mimo_z if multi else None, self.mimo_o if multi else None,
                self.norm.weight if self.cfg.outproj_norm else None)

    def step_dims(self):
        c = self.cfg
        return (c.nheads, c.headdim, c.d_state, self.n_angles, self.rank, c.ngroups, int(c.trapezoid),
                int(self.pairing == "half"))

    def step_consts(self):
        c = self.cfg
        return (c.a_min, self.B_norm.eps, c.norm_eps, c.bounded_angle)


def check(cfg: ModelConfig) -> list[str]:
    """The family's errors (sonata.model.families): the SSD head layout (Mamba-2's check), the
    released form's options asked of the paper form, and a rotation that turns at least one pair
    of state channels. Writes nothing."""
    errors = mamba2.check(cfg)
    if cfg.mamba3_form == "paper":
        for key, val, off in (("mimo_rank", cfg.mimo_rank, 1), ("outproj_norm", cfg.outproj_norm, False)):
            if val != off:
                errors.append(f"model.{key}={val} is an option of mamba_ssm's released Mamba-3: set "
                              f"model.mamba3_form=released, or leave model.{key} out")
    if cfg.rope_fraction != 0 and rotated_dims(cfg) < 2:
        errors.append(f"model.rope_fraction={cfg.rope_fraction:g} rotates no pair of the {cfg.d_state} state "
                      f"channels (2 x floor(d_state x fraction / 2) = 0): give at least {2 / cfg.d_state:g} to "
                      f"rotate a pair, or 0 to turn the rotation off")
    return errors


class Mamba3Block(PreNormBlock):
    """Pre-norm residual block around the Mamba-3 layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, Mamba3Mixer(cfg))


__all__ = ["Mamba3Block", "Mamba3Mixer", "check", "heavy_tail", "recurrence_ref", "rotate", "rotated_dims"]
