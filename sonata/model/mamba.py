"""The Mamba-1 block family: the selective SSM layer (`MambaMixer`), its time-invariant ablation
(`LTIMixer`, the Mamba paper's S4-in-a-Mamba-block row: delta, B and C learned parameters
instead of functions of the input; delta per channel, B and C shared by the channels), and the
pre-norm residual block around either (`MambaBlock`). Names mirror state-spaces/mamba (in_proj,
conv1d, x_proj, dt_proj, A_log, D, out_proj) so readers can move between codebases.

The scan runs through `sonata.kernels.selective_scan` with the backend of `ModelConfig.backend`.
The forward can take and return the recurrent state (the convolution window and the scan's
state), so a long sequence runs chunk by chunk and gives what one pass gives; `step` is one
token of the same recurrence (O(1) per token) after `prefill` has consumed a prompt in one
parallel pass (`sonata.model.decode.Decoder` is the fast version).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.kernels import conv_silu, selective_scan
from sonata.kernels.selective.reference import project_delta, step as scan_step
from sonata.model.block import PreNormBlock, dt_bias_init
from sonata.model.quant import QLinear


class MambaMixer(nn.Module):
    """The selective SSM layer: in_proj -> conv -> SiLU -> scan (gated by z) -> out_proj, with
    delta, B and C computed from the input (`_selection`; `LTIMixer` makes them parameters)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, di, n = cfg.d_model, cfg.d_inner, cfg.d_state
        self.cfg = cfg
        self.in_proj = QLinear(d, 2 * di, bias=False)
        self.conv1d = nn.Conv1d(di, di, cfg.d_conv, groups=di, padding=cfg.d_conv - 1, bias=True)
        self._init_selection(cfg)
        a_init = torch.arange(1, n + 1, dtype=torch.float32).repeat(di, 1)   # (di, n): S4D-real
        if cfg.a_param == "log":
            self.A_log = nn.Parameter(torch.log(a_init))
        else:
            self.A_param = nn.Parameter(-a_init)
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = QLinear(di, d, bias=False)
        self._init_dt(cfg)      # last: the random draws keep the order of earlier versions

    def _init_selection(self, cfg: ModelConfig) -> None:
        r, n = cfg.effective_dt_rank, cfg.d_state
        self.x_proj = QLinear(cfg.d_inner, r + 2 * n, bias=False)
        self.dt_proj = QLinear(r, cfg.d_inner, bias=True)

    def _init_dt(self, cfg: ModelConfig) -> None:
        r = cfg.effective_dt_rank
        nn.init.uniform_(self.dt_proj.weight, -r ** -0.5, r ** -0.5)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt_bias_init(cfg))

    @property
    def delta_bias(self) -> torch.Tensor:
        return self.dt_proj.bias

    @property
    def A(self) -> torch.Tensor:
        if self.cfg.a_param == "log":
            return -torch.exp(self.A_log.float())                       # (di, n), always < 0
        return self.A_param.float()                                     # may cross 0 unless constrained

    @torch.no_grad()
    def constrain_A(self, a_min: float) -> None:
        """Project A so that every decay exp(delta*A) < 1: A <= -a_min."""
        if self.cfg.a_param == "direct":
            self.A_param.clamp_(max=-a_min)
        else:
            self.A_log.clamp_(min=math.log(a_min))

    def _dt_B_C(self, x):
        """x (b, L, di) after conv+SiLU -> dt (b, L, r), B, C (b, L, n): views of x_proj's output."""
        r, n = self.cfg.effective_dt_rank, self.cfg.d_state
        return self.x_proj(x).split([r, n, n], dim=-1)

    def _selection(self, x):
        """x (b, L, di) after conv+SiLU -> (delta, B, C, delta_proj) as `selective_scan` takes
        them: delta is dt_proj's (b, L, r) input and delta_proj its weight (the scan projects);
        B, C (b, n, L) transposed views."""
        dt, B, C = self._dt_B_C(x)
        return dt, B.transpose(1, 2), C.transpose(1, 2), self.dt_proj.weight

    def ssm_inputs(self, x):
        """x (b, L, di) after conv+SiLU -> delta (b, di, L) before bias and softplus, B, C (b, n, L)."""
        delta, B, C, proj = self._selection(x)
        return (delta if proj is None else project_delta(delta, proj)), B, C

    def _scan(self, x, z, **state):
        """The scan of x (b, di, L) after conv+SiLU, gated by z (b, di, L)."""
        delta, B, C, proj = self._selection(x.transpose(1, 2))
        return selective_scan(x, delta, self.A, B, C, self.D.float(), z=z,
                              delta_bias=self.delta_bias.float(), delta_softplus=True,
                              backend=self.cfg.backend, delta_proj=proj, **state)

    def forward(self, h, state=None, return_state: bool = False):       # h (b, L, d)
        """-> out (b, L, d); with `return_state` (or a `state` to continue from) -> (out, state),
        state = (the last d_conv inputs of the convolution (b, di, d_conv), newest last; the
        scan's state (b, di, n))."""
        if state is not None or return_state:
            return self._forward_with_state(h, state)
        # The projections work in (b, L, channels); the convolution and the scan in (b, di, L).
        # Each gets a transposed view of the other's output. On the cpu backend x, the scan's
        # output and their gradients stay in the projections' layout (the kernels read and
        # write it in place: no transposed copies), the fused conv hands the gate z on in the
        # scan's layout, and the scan computes delta from dt_proj's low-rank input itself
        # (`delta_proj`: no (b, di, L) delta is stored or transposed); other backends run
        # dt_proj as a matmul first (kernels/__init__.py).
        x, z = conv_silu(self.in_proj(h), self.conv1d.weight, self.conv1d.bias,
                         self.cfg.backend)                              # (b, L, di) views
        y = self._scan(x.transpose(1, 2), z.transpose(1, 2))           # (b, di, L) view
        return self.out_proj(y.transpose(1, 2))

    def _forward_with_state(self, h, state):
        """The layer over h (b, L, d) continuing from `state` (None: zeros), and its new state.
        The convolution reads the previous chunk's last d_conv - 1 inputs before this one's."""
        cfg, di = self.cfg, self.cfg.d_inner
        conv_state, ssm_state = state if state is not None else self.empty_state(h.shape[0], h.device, h.dtype)
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)         # (b, di, L) each
        xs = torch.cat([conv_state.to(x.dtype), x], dim=-1)            # (b, di, d_conv + L)
        x = F.silu(F.conv1d(xs[..., 1:], self.conv1d.weight, self.conv1d.bias, groups=di))
        y, last = self._scan(x, z.contiguous(), return_last_state=True, initial_state=ssm_state)
        return self.out_proj(y.transpose(1, 2)), (xs[..., -cfg.d_conv:].contiguous(), last)

    def empty_state(self, batch: int, device, dtype=torch.float32):
        di = self.cfg.d_inner
        return (torch.zeros(batch, di, self.cfg.d_conv, device=device, dtype=dtype),      # conv window
                torch.zeros(batch, di, self.cfg.d_state, device=device, dtype=torch.float32))  # ssm

    def step(self, h, state):                                           # h (b, d)
        conv_state, ssm_state = state
        x, z = self.in_proj(h).chunk(2, dim=-1)                         # (b, di)
        conv_state = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], dim=-1)
        x = F.silu((conv_state * self.conv1d.weight.squeeze(1)).sum(-1) + self.conv1d.bias)
        delta, B, C = self.ssm_inputs(x.unsqueeze(1))                  # (b, di, 1), (b, n, 1)
        y, ssm_state = scan_step(ssm_state, x, delta[..., 0], self.A, B[..., 0], C[..., 0],
                                 self.D, z=z, delta_bias=self.delta_bias, delta_softplus=True)
        return self.out_proj(y), (conv_state, ssm_state)

    def prefill(self, h):                                               # h (b, L, d)
        """The layer over a whole prompt in one parallel pass, and the state `step` continues
        from: the last d_conv inputs of the convolution (zero-padded on the left) and the scan's
        last state."""
        return self._forward_with_state(h, None)


class LTIMixer(MambaMixer):
    """The time-invariant ablation: MambaMixer with delta, B and C learned parameters that do
    not depend on the input. delta = softplus(dt_bias) per channel (initialized as Mamba's
    bias), B and C (n,) shared by the channels, like Mamba's B_t and C_t but the same at every
    step. The scan, the convolution and the gate are Mamba's."""

    def _init_selection(self, cfg: ModelConfig) -> None:
        n = cfg.d_state
        self.dt_bias = nn.Parameter(torch.empty(cfg.d_inner))
        self.B = nn.Parameter(torch.empty(n))
        self.C = nn.Parameter(torch.empty(n))

    def _init_dt(self, cfg: ModelConfig) -> None:
        with torch.no_grad():
            self.dt_bias.copy_(dt_bias_init(cfg))
            self.B.normal_()
            self.C.normal_(std=cfg.d_state ** -0.5)

    @property
    def delta_bias(self) -> torch.Tensor:
        return self.dt_bias

    def _selection(self, x):
        b, L, _ = x.shape
        n = self.cfg.d_state
        delta = x.new_zeros(()).expand(b, self.cfg.d_inner, L)          # the bias is all of it
        return (delta, self.B[None, :, None].expand(b, n, L).to(x.dtype),
                self.C[None, :, None].expand(b, n, L).to(x.dtype), None)


class MambaBlock(PreNormBlock):
    """Pre-norm residual block around the selective layer: h + MambaMixer(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, MambaMixer(cfg))


class LTIBlock(PreNormBlock):
    """Pre-norm residual block around the time-invariant layer: h + LTIMixer(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, LTIMixer(cfg))


def check(cfg: ModelConfig) -> list[str]:
    """The family's own errors (sonata.model.families): none beyond each key's range, which
    Config.validate checks (dt_rank, a_param log or direct)."""
    return []
