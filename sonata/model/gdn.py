"""The Gated DeltaNet block family (`model.arch=gdn`, or `gdn` layers of `model.layers`): the
linear-attention layer of Qwen3-Next's hybrids (Yang, Kautz and Hatamizadeh, "Gated Delta
Networks", ICLR 2025), as transformers' Qwen3NextGatedDeltaNet computes it:

    q, k, v, z, b, a = in_proj(u)          widths hk dk, hk dk, d_inner, d_inner, h, h
    q, k, v  = silu(causal depthwise conv1d([q | k | v]))   one convolution, no bias
    q, k     = l2norm(q), l2norm(k)         per key head; the kernel scales q by dk^-0.5
    beta     = sigmoid(b)  (2 sigmoid(b) with model.allow_neg_eigval),
    g        = -exp(A_log) softplus(a + dt_bias)                       per value head and token
    S_t      = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t
    out      = out_proj(norm(o) * weight * silu(z))   RMSNorm per head, before the gate

The config keys are Mamba-2's: value heads h = model.nheads (d_inner / model.headdim) of width
dv = model.headdim, key heads hk = model.ngroups of width dk = model.d_state (each shared by
h / hk value heads, as Qwen3-Next's num_k_heads serve its num_v_heads), conv kernel
model.d_conv, the kernel's chunk model.chunk_size, norm epsilon model.norm_eps. in_proj's rows
are [q | k | v | z | b | a] in that order (Qwen3-Next interleaves them per key head in two
projections, in_proj_qkvz and in_proj_ba: the same numbers, rows permuted). Initialisation is
Mamba-2's: A_log = log U(1, 16) per head, dt_bias the inverse softplus of a log-uniform step in
[dt_min, dt_max]; the output norm's weight (dv,) is shared by the heads, as in Qwen3-Next.

The recurrence is `sonata.kernels.gdn.gated_delta_rule` (fused numba on CPU, the chunked WY
form elsewhere); the convolution and the gated norm are sonata's fused layer kernels
(`causal_conv_silu`, `rms_norm_gated` with the norm first). The forward can take and return the
state (the convolution's last d_conv inputs (b, conv_dim, d_conv), newest last, and S (b, h, dk,
dv) in float32, float64 for a float64 model), so a long sequence runs chunk by chunk; `step`
is one token (`gated_delta_rule_step`, both parts of the state updated in place) after `prefill`
has consumed a prompt in one parallel pass.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.kernels import causal_conv_silu, rms_norm_gated
from sonata.kernels.dispatch import compute_dtype
from sonata.kernels.gdn import gated_delta_rule, gated_delta_rule_step, l2norm
from sonata.model.block import PreNormBlock, dt_bias_init, head_layout_errors
from sonata.model.quant import QLinear


class HeadGatedNorm(nn.Module):
    """The output norm: RMSNorm over each head's dv channels, times weight (dv,) shared by the
    heads, times silu(z) (norm before the gate: Qwen3-Next's RMSNormGated, fla's
    FusedRMSNormGated); fused on the `cpu` backend."""

    def __init__(self, dv: int, eps: float, backend: str):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.ones(dv))

    def forward(self, o, z):                                            # (..., h, dv) each
        return rms_norm_gated(o, self.weight, z, self.eps, None, norm_before_gate=True, backend=self.backend)


class GDNMixer(nn.Module):
    """in_proj -> conv over q, k, v -> SiLU -> L2 norm of q, k -> gated delta rule -> gated norm
    per head -> out_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, di, h, hk, dk = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.ngroups, cfg.d_state
        self.cfg = cfg
        self.key_dim = hk * dk
        self.conv_dim = 2 * self.key_dim + di
        self.in_proj = QLinear(d, self.conv_dim + di + 2 * h, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.d_conv, groups=self.conv_dim,
                                padding=cfg.d_conv - 1, bias=False)
        self.dt_bias = nn.Parameter(dt_bias_init(cfg, h))
        self.A_log = nn.Parameter(torch.log(torch.empty(h).uniform_(1, 16)))
        self.norm = HeadGatedNorm(cfg.headdim, cfg.norm_eps, cfg.backend)
        self.out_proj = QLinear(di, d, bias=False)

    def _split(self, proj):
        c = self.cfg
        return proj.split([self.conv_dim, c.d_inner, c.nheads, c.nheads], dim=-1)    # qkv, z, b, a

    def _gates(self, b, a):
        """beta = sigmoid(b) (twice that with model.allow_neg_eigval: the transition I - beta k k^T
        then has the eigenvalue 1 - beta in (-1, 1)), g = -exp(A_log) softplus(a + dt_bias), in
        float32 (float64 for a float64 model): the log decay must not round to 0 or -inf in half
        precision."""
        ct = compute_dtype(a.dtype)
        g = -torch.exp(self.A_log.to(ct)) * F.softplus(a.to(ct) + self.dt_bias.to(ct))
        beta = torch.sigmoid(b.to(ct))
        return (2 * beta if self.cfg.allow_neg_eigval else beta), g

    def _heads(self, qkv):
        """The convolution's output (..., conv_dim) -> q, k (..., hk, dk) L2-normalised, v (..., h, dv)."""
        c = self.cfg
        q, k, v = qkv.split([self.key_dim, self.key_dim, c.d_inner], dim=-1)
        lead = qkv.shape[:-1]
        q = l2norm(q.reshape(*lead, c.ngroups, c.d_state))
        k = l2norm(k.reshape(*lead, c.ngroups, c.d_state))
        return q, k, v.reshape(*lead, c.nheads, c.headdim)

    def _finish(self, o, z):
        """o (..., h, dv), z (..., d_inner) -> out_proj(norm(o) * silu(z))."""
        c = self.cfg
        y = self.norm(o.to(z.dtype), z.reshape(*z.shape[:-1], c.nheads, c.headdim))
        return self.out_proj(y.reshape(*z.shape))

    def forward(self, u, state=None, return_state: bool = False):      # u (b, L, d)
        """-> out (b, L, d); with `return_state` (or a `state` to continue from) -> (out, state)."""
        c = self.cfg
        qkv, z, b, a = self._split(self.in_proj(u))
        if state is None and not return_state:
            qkv = causal_conv_silu(qkv, self.conv1d.weight, None, c.backend)
            S0 = None
        else:
            conv_state, S0 = state if state is not None else self.empty_state(u.shape[0], u.device, u.dtype)
            xs = torch.cat([conv_state.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)   # (b, cd, K + L)
            qkv = F.silu(F.conv1d(xs[..., 1:], self.conv1d.weight, None, groups=self.conv_dim)).transpose(1, 2)
            conv_state = xs[..., -c.d_conv:].contiguous()
        q, k, v = self._heads(qkv)
        beta, g = self._gates(b, a)
        out = gated_delta_rule(q, k, v, g, beta, initial_state=S0, return_final_state=S0 is not None,
                               chunk_size=c.chunk_size, backend=c.backend)
        if S0 is None:
            return self._finish(out, z)
        o, S = out
        return self._finish(o, z), (conv_state, S)

    def empty_state(self, batch: int, device, dtype=torch.float32):
        c = self.cfg
        return (torch.zeros(batch, self.conv_dim, c.d_conv, device=device, dtype=dtype),
                torch.zeros(batch, c.nheads, c.d_state, c.headdim, device=device, dtype=compute_dtype(dtype)))

    def step(self, u, state):                                           # u (b, d)
        """One token: -> out (b, d), the state (both parts updated in place)."""
        conv_state, S = state
        qkv, z, b, a = self._split(self.in_proj(u))
        conv_state.copy_(torch.cat([conv_state[..., 1:], qkv.unsqueeze(-1).to(conv_state.dtype)], dim=-1))
        qkv = F.silu((conv_state * self.conv1d.weight.squeeze(1)).sum(-1).to(qkv.dtype))
        q, k, v = self._heads(qkv)
        beta, g = self._gates(b, a)
        o = gated_delta_rule_step(S, q, k, v, g, beta)
        return self._finish(o, z), (conv_state, S)

    def prefill(self, u):                                               # u (b, L, d)
        """The layer over a whole prompt in one parallel pass, and the state `step` continues from."""
        return self.forward(u, None, return_state=True)


def check(cfg: ModelConfig) -> list[str]:
    """The head layout's errors (sonata.model.families): headdim divides d_inner (the value
    heads), ngroups divides the value heads (the key heads), a positive chunk; A is negative by
    construction. Writes nothing."""
    return head_layout_errors(cfg, "gdn", kept="their decay", heads="value heads", groups=", gdn's key heads",
                              into=" into gdn value heads")


class GDNBlock(PreNormBlock):
    """Pre-norm residual block around the Gated DeltaNet layer: h + GDNMixer(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, GDNMixer(cfg))
