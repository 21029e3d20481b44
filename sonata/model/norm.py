"""RMSNorm, the blocks' normalisation: fused on the `cpu` backend (sonata.kernels.rms_norm), and
Mamba-2's gated, grouped RMSNorm (`GatedRMSNorm`)."""
from __future__ import annotations

import torch
import torch.nn as nn

from sonata.kernels import rms_norm, rms_norm_gated


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension; fused on the `cpu` backend."""

    def __init__(self, d: int, eps: float = 1e-5, backend: str = "reference"):
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, backend=self.backend)


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: norm(y * silu(z)) over groups of `group_size` channels (the
    block's ngroups groups of d_inner / ngroups), times weight; transformers' MambaRMSNormGated
    and mamba_ssm's RMSNormGated(norm_before_gate=False) (`rms_norm_gated_ref`); fused on the
    `cpu` backend (sonata.kernels.rms_norm_gated). `norm_before_gate=True`: norm(y) * silu(z)
    (Mamba-3's per-head output norm, mamba_ssm's is_outproj_norm)."""

    def __init__(self, d: int, group_size: int, eps: float = 1e-5, backend: str = "reference",
                 norm_before_gate: bool = False):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, y, z=None):
        return rms_norm_gated(y, self.weight, z, self.eps, self.group_size, norm_before_gate=self.norm_before_gate,
                              backend=self.backend)
