"""What the state-space block families share: the pre-norm residual block around a mixer
(`PreNormBlock`: h + mixer(norm(h)), with the state, one-token step and prefill passed through)
and the step-size initialisation of the reference implementation (`dt_bias_init`)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from sonata.core.config import ModelConfig
from sonata.model.norm import RMSNorm


def dt_bias_init(cfg: ModelConfig, count: int | None = None) -> torch.Tensor:
    """softplus^-1(dt) with dt log-uniform in [dt_min, dt_max] (at least dt_init_floor): one per
    channel (Mamba-1: count = d_inner) or per head (Mamba-2: count = nheads)."""
    n = cfg.d_inner if count is None else count
    dt = torch.exp(torch.rand(n) * (math.log(cfg.dt_max) - math.log(cfg.dt_min))
                   + math.log(cfg.dt_min)).clamp(min=cfg.dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))


class PreNormBlock(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h)). The mixer's `forward(x, state,
    return_state)`, `step` and `prefill` are passed through with the residual added."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, backend=cfg.backend)
        self.mixer = mixer

    def forward(self, h, state=None, return_state: bool = False):
        if state is None and not return_state:
            return h + self.mixer(self.norm(h))
        y, state = self.mixer(self.norm(h), state, return_state=True)
        return h + y, state

    def residual_outputs(self) -> list[nn.Module]:
        """The projections that write into the residual stream (MambaLM scales their initial
        weights by 1/sqrt(n_layers)): the mixer's out_proj."""
        return [self.mixer.out_proj]

    def step(self, h, state):
        y, state = self.mixer.step(self.norm(h), state)
        return h + y, state

    def prefill(self, h):
        y, state = self.mixer.prefill(self.norm(h))
        return h + y, state
