"""sonata's int8: the one definition of its quantization (symmetric, per output
channel), the linear layer that trains through it (precision int8), and a model's int8
switch and export (`set_int8`, `int8_state`, `load_int8_state`: any module holding QLinears)."""
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


def set_int8(model: nn.Module, on: bool) -> None:
    """Fake-quantize every QLinear of `model` (projections and head) to int8, or stop."""
    for m in model.modules():
        if isinstance(m, QLinear):
            m.int8 = on


def int8_state(model: nn.Module) -> dict:
    """Export: real int8 weights with per-row scales for every QLinear's weight, plus the float
    tensors of everything else."""
    quant = {name + ".weight" for name, m in model.named_modules() if isinstance(m, QLinear)}
    out = {}
    for name, t in model.state_dict().items():
        if name in quant:
            q, scale = quantize_int8(t)
            out[name] = {"int8": q, "scale": scale}
        else:
            out[name] = t.detach().clone()
    return out


def load_int8_state(model: nn.Module, state: dict) -> None:
    """Load an `int8_state` export into `model`, dequantizing the int8 weights."""
    model.load_state_dict({k: (v["int8"].float() * v["scale"][:, None] if isinstance(v, dict) else v)
                           for k, v in state.items()})
