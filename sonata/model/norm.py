"""RMSNorm, the blocks' normalisation: fused on the `cpu` backend (sonata.kernels.rms_norm)."""
from __future__ import annotations

import torch
import torch.nn as nn

from sonata.kernels import rms_norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension; fused on the `cpu` backend."""

    def __init__(self, d: int, eps: float = 1e-5, backend: str = "reference"):
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, backend=self.backend)
