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


def head_layout_errors(cfg: ModelConfig, family: str, kept: str = "A", heads: str = "heads", groups: str = "",
                       into: str = "") -> list[str]:
    """The errors of a headed family's layout (Mamba-2, Mamba-3, Gated DeltaNet): headdim divides
    d_inner, ngroups divides the heads, the chunk is positive, and A stays negative by construction
    (model.a_param=log). `kept`, `heads`, `groups` and `into` say it in the family's words. Writes
    nothing."""
    errors = []
    if cfg.headdim <= 0 or cfg.d_inner % cfg.headdim:
        errors.append(f"model.headdim ({cfg.headdim}) must divide d_inner = model.expand x model.d_model "
                      f"({cfg.d_inner}){into}")
    elif cfg.ngroups <= 0 or cfg.nheads % cfg.ngroups:
        errors.append(f"model.ngroups ({cfg.ngroups}{groups}) must divide the {cfg.nheads} {heads} (d_inner / headdim)")
    if cfg.chunk_size <= 0:
        errors.append("model.chunk_size must be positive")
    if cfg.a_param != "log":
        errors.append(f"model.a_param=direct is the Mamba-1 ablation; {family} layers keep {kept} negative by "
                      f"construction (model.a_param=log)")
    return errors


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
