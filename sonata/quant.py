"""sonata's int8: the one definition of its quantization (symmetric, per output
channel) and the linear layer that trains through it (precision int8)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Real int8 weights and their per-row fp32 scales: w ~= q * scale[:, None]
    (symmetric, per output channel: the one definition of sonata's int8)."""
    scale = w.detach().float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(w.detach().float() / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def fake_quant_int8(w: torch.Tensor) -> torch.Tensor:
    """w rounded through int8 (quantize_int8), with a straight-through gradient."""
    q, scale = quantize_int8(w)
    return w + (q.to(w.dtype) * scale.to(w.dtype)[:, None] - w).detach()


class QLinear(nn.Linear):
    """nn.Linear whose weight is int8 fake-quantized while `int8` is on (precision int8)."""
    int8 = False

    def forward(self, x):
        w = fake_quant_int8(self.weight) if self.int8 else self.weight
        return F.linear(x, w, self.bias)
