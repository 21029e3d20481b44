"""The Mamba-2 block family (`model.arch=mamba2`, or `mamba2` layers of `model.layers`): the
SSD layer as the reference implementation defines it ("Transformers are SSMs", Dao and Gu
2024), names as in state-spaces/mamba and transformers' Mamba2Mixer so weights move between
them (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj):

    z, xBC, dt = in_proj(u)                  widths d_inner, d_inner + 2 G N, nheads
    x, B, C    = silu(causal depthwise conv1d(xBC))        one convolution over all three
    y          = SSD(x as (nheads, headdim), dt + dt_bias -> softplus, A = -exp(A_log), B, C
                     as (G, N), D per head)                 `sonata.kernels.ssd.ssd`
    out        = out_proj(norm(y * silu(z)))               RMSNorm grouped by G (GatedRMSNorm)

On the `cpu` backend the convolution (`sonata.kernels.causal_conv_silu`) and the gated norm
are fused numba kernels, each beside its reference; in training the norm runs inside the SSD
recurrence's own kernels (`ssd_packed(..., norm=...)`; `sonata.kernels.rms_norm_gated` where
another form runs). in_proj is computed as three products over its row blocks (`_project`).

One decay per head per token, where Mamba-1 has d_inner x N of them: on the `cpu` backend the
SSD runs as a fused recurrence (one exp per head and step, d_inner x N multiply-adds) up to
N = 128, as the chunked form on matrix multiplies beyond (`sonata.kernels.ssd.cpu`). Initialisation is mamba_ssm's: A_log =
log U(1, 16) per head, dt log-uniform in [dt_min, dt_max] with its floor through dt_bias,
D = 1, the convolution PyTorch's default.

The forward can take and return the recurrent state (the convolution window over xBC, the
SSD state (b, nheads, headdim, N)), so a long sequence runs chunk by chunk and gives what one
pass gives; `step` is one token (`sonata.kernels.ssd.ssd_step`, fused on CPU) after
`prefill` has consumed a prompt in one parallel pass.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.kernels import causal_conv_silu
from sonata.kernels.ssd import ssd, ssd_packed, ssd_step
from sonata.model.block import PreNormBlock, dt_bias_init, head_layout_errors
from sonata.model.norm import GatedRMSNorm
from sonata.model.quant import QLinear, fake_quant_int8


class Mamba2Mixer(nn.Module):
    """The SSD layer: in_proj -> conv over x, B, C -> SiLU -> SSD -> gated grouped norm -> out_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, di, n, g, h = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.ngroups, cfg.nheads
        self.cfg = cfg
        self.conv_dim = di + 2 * g * n
        self.in_proj = QLinear(d, 2 * di + 2 * g * n + h, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.d_conv, groups=self.conv_dim,
                                padding=cfg.d_conv - 1, bias=True)
        self.dt_bias = nn.Parameter(dt_bias_init(cfg, h))
        self.A_log = nn.Parameter(torch.log(torch.empty(h).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = GatedRMSNorm(di, di // g, eps=cfg.norm_eps, backend=cfg.backend)
        self.out_proj = QLinear(di, d, bias=False)

    @property
    def A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())                              # (h,), always < 0

    @torch.no_grad()
    def constrain_A(self, a_min: float) -> None:
        """Project A so that every decay exp(dt*A) < 1: A <= -a_min."""
        self.A_log.clamp_(min=float(torch.log(torch.tensor(a_min))))

    def _split(self, zxbcdt):
        c = self.cfg
        return zxbcdt.split([c.d_inner, self.conv_dim, c.nheads], dim=-1)

    def _project(self, u):
        """self._split(self.in_proj(u)) as three products over in_proj's row blocks (z, xBC,
        dt), in every path (training, prefill, step): the same numbers, without the (b, L, 2 d_inner + 2 G N + h) product's odd width
        (518 at the seed size: its forward took 1.5x a 512-wide one) and without the backward
        concatenating the three parts' gradients into it (up to 1.9 ms a layer in float32,
        torch.profiler, the seed model)."""
        c, proj = self.cfg, self.in_proj
        sizes = [c.d_inner, self.conv_dim, c.nheads]
        w = fake_quant_int8(proj.weight) if proj.int8 else proj.weight     # per-row scales: a row
        bs = (None,) * 3 if proj.bias is None else proj.bias.split(sizes)  # block's are its own
        return tuple(F.linear(u, wi, bi) for wi, bi in zip(w.split(sizes, 0), bs))

    def _ssd(self, xBC, dt, initial_states=None, return_final_states=False):
        """SSD over xBC (b, L, conv_dim) after the convolution, dt (b, L, h) -> y (b, L, d_inner)."""
        c = self.cfg
        b, L, _ = xBC.shape
        gn = c.ngroups * c.d_state
        x, B, C = xBC.split([c.d_inner, gn, gn], dim=-1)
        out = ssd(x.reshape(b, L, c.nheads, c.headdim), dt, self.A,
                  B.reshape(b, L, c.ngroups, c.d_state), C.reshape(b, L, c.ngroups, c.d_state),
                  chunk_size=c.chunk_size, D=self.D.float(), dt_bias=self.dt_bias.float(),
                  initial_states=initial_states, dt_softplus=True,
                  return_final_states=return_final_states, backend=c.backend)
        y, last = out if return_final_states else (out, None)
        return y.reshape(b, L, c.d_inner), last

    def forward(self, u, state=None, return_state: bool = False):      # u (b, L, d)
        """-> out (b, L, d); with `return_state` (or a `state` to continue from) -> (out, state),
        state = (the last d_conv inputs of the convolution (b, conv_dim, d_conv), newest last;
        the SSD state (b, nheads, headdim, N), float32)."""
        if state is not None or return_state:
            return self._forward_with_state(u, state)
        c = self.cfg
        b, L, _ = u.shape
        z, xBC, dt = self._project(u)
        # under autocast the convolution hands the SSD float32 (what the fused kernels compute
        # in): no rounding to bfloat16 and back between them, and the SSD's output and
        # gradients stay float32 up to the norm; ssd_packed's backward writes one gradient
        # for the packed x, B, C
        keep = torch.float32 if torch.is_autocast_enabled(u.device.type) else None
        xBC = causal_conv_silu(xBC, self.conv1d.weight, self.conv1d.bias, c.backend, out_dtype=keep)
        # the gated norm goes with the SSD: the fused recurrence computes it in its own kernels
        y = ssd_packed(xBC, dt, self.A, c.headdim, c.ngroups, c.d_state, chunk_size=c.chunk_size,
                       D=self.D.float(), dt_bias=self.dt_bias.float(), dt_softplus=True, backend=c.backend,
                       norm=(z, self.norm.weight, self.norm.eps))
        return self.out_proj(y)

    def _forward_with_state(self, u, state):
        """The layer over u (b, L, d) continuing from `state` (None: zeros), and its new state."""
        conv_state, ssm_state = state if state is not None else self.empty_state(u.shape[0], u.device, u.dtype)
        z, xBC, dt = self._project(u)
        xs = torch.cat([conv_state.to(xBC.dtype), xBC.transpose(1, 2)], dim=-1)   # (b, cd, K + L)
        x = F.silu(F.conv1d(xs[..., 1:], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim))
        y, last = self._ssd(x.transpose(1, 2), dt, initial_states=ssm_state, return_final_states=True)
        return self.out_proj(self.norm(y, z)), (xs[..., -self.cfg.d_conv:].contiguous(), last)

    def empty_state(self, batch: int, device, dtype=torch.float32):
        c = self.cfg
        return (torch.zeros(batch, self.conv_dim, c.d_conv, device=device, dtype=dtype),
                torch.zeros(batch, c.nheads, c.headdim, c.d_state, device=device, dtype=torch.float32))

    def step(self, u, state):                                           # u (b, d)
        """One token: -> out (b, d), the state (the SSD state is updated in place)."""
        c = self.cfg
        conv_state, ssm_state = state
        b = u.shape[0]
        z, xBC, dt = self._project(u)                                      # (b, di), (b, cd), (b, h)
        conv_state = torch.cat([conv_state[..., 1:], xBC.unsqueeze(-1).to(conv_state.dtype)], dim=-1)
        xBC = F.silu((conv_state * self.conv1d.weight.squeeze(1)).sum(-1) + self.conv1d.bias)
        gn = c.ngroups * c.d_state
        x, B, C = xBC.split([c.d_inner, gn, gn], dim=-1)
        ct = ssm_state.dtype                                            # float32 (float64 in tests)
        y = ssd_step(ssm_state, x.reshape(b, c.nheads, c.headdim).to(ct), dt.to(ct), self.A.to(ct),
                     B.reshape(b, c.ngroups, c.d_state).to(ct), C.reshape(b, c.ngroups, c.d_state).to(ct),
                     D=self.D.to(ct), dt_bias=self.dt_bias.to(ct), dt_softplus=True)
        y = self.norm(y.reshape(b, c.d_inner).to(z.dtype), z)
        return self.out_proj(y), (conv_state, ssm_state)

    def prefill(self, u):                                               # u (b, L, d)
        """The layer over a whole prompt in one parallel pass, and the state `step` continues from."""
        return self._forward_with_state(u, None)


def check(cfg: ModelConfig) -> list[str]:
    """The SSD head layout's errors (sonata.model.families; Mamba-3 shares it): headdim divides
    d_inner, ngroups divides the heads, and A is negative by construction. Writes nothing."""
    return head_layout_errors(cfg, "mamba2 and mamba3")


class Mamba2Block(PreNormBlock):
    """Pre-norm residual block around the SSD layer: h + Mamba2Mixer(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, Mamba2Mixer(cfg))
