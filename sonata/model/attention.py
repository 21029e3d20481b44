"""The attention block family: causal multi-head self-attention with rotary position embeddings
(`torch.nn.functional.scaled_dot_product_attention`) and a GELU MLP, the same width as the
Mamba blocks: the selection study's baseline. Its recurrent state is the keys and values so far:
`step` decodes one token against them (a KV cache that grows by one entry per token) after
`prefill` has run the prompt, so hybrids and attention alone generate.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.model.norm import RMSNorm
from sonata.model.quant import QLinear


def rotary(x, t0: int):
    """Rotary position embedding of x (b, heads, L, hd) at positions t0 .. t0 + L - 1 (pairs
    (i, i + hd/2) rotated by position * 10000^(-2i/hd); angles in float64, so positions in the
    millions keep their precision)."""
    L, hd = x.shape[2], x.shape[3]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd)
    ang = torch.arange(t0, t0 + L, dtype=torch.float64, device=x.device)[:, None] * inv   # (L, hd/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def check(cfg: ModelConfig) -> list[str]:
    """The family's errors (sonata.model.families): heads of even width. Writes nothing."""
    if cfg.n_heads > 0 and cfg.d_model % (2 * cfg.n_heads) == 0:
        return []
    return [f"model.n_heads ({cfg.n_heads}) must divide model.d_model ({cfg.d_model}) into heads of even "
            f"width (rotary positions rotate pairs)"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary positions. Its state is the keys and
    values so far ((b, heads, T, hd) each): a chunk attends to them and to itself."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.heads = cfg.d_model, cfg.n_heads
        self.qkv = QLinear(d, 3 * d, bias=False)
        self.out_proj = QLinear(d, d, bias=False)

    def forward(self, h, state=None, return_state: bool = False):      # h (b, L, d)
        b, L, d = h.shape
        q, k, v = self.qkv(h).view(b, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        t0 = 0 if state is None else state[0].shape[2]
        q, k = rotary(q, t0), rotary(k, t0)                              # (b, heads, L, hd)
        if state is not None:
            k, v = torch.cat([state[0], k], dim=2), torch.cat([state[1], v], dim=2)
        if t0:   # the chunk's queries see every earlier key and their own causal part
            mask = torch.arange(t0, t0 + L, device=h.device)[:, None] >= torch.arange(t0 + L, device=h.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.out_proj(y.transpose(1, 2).reshape(b, L, d))
        return (y, (k, v)) if return_state or state is not None else y


class AttentionBlock(nn.Module):
    """Pre-norm transformer block: h + attn(norm(h)), then h + mlp(norm(h)) (GELU, 4x wide)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.norm = RMSNorm(d, cfg.norm_eps, backend=cfg.backend)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = RMSNorm(d, cfg.norm_eps, backend=cfg.backend)
        self.mlp = nn.Sequential(QLinear(d, 4 * d, bias=False), nn.GELU(), QLinear(4 * d, d, bias=False))

    def residual_outputs(self) -> list[nn.Module]:
        """The projections that write into the residual stream: attention's and the MLP's last."""
        return [self.attn.out_proj, self.mlp[2]]

    def forward(self, h, state=None, return_state: bool = False):
        if state is None and not return_state:
            h = h + self.attn(self.norm(h))
            return h + self.mlp(self.norm2(h))
        y, state = self.attn(self.norm(h), state, return_state=True)
        h = h + y
        return h + self.mlp(self.norm2(h)), state

    def empty_state(self, batch: int, device, dtype=torch.float32):
        """No keys or values yet: (b, heads, 0, hd) each."""
        a = self.attn
        hd = a.qkv.in_features // a.heads
        return (torch.zeros(batch, a.heads, 0, hd, device=device, dtype=dtype),) * 2

    def step(self, h, state):                                           # h (b, d)
        """One token: -> (b, d) and the keys and values with its own appended (the KV cache:
        each step attends to every earlier token at its position)."""
        y, state = self.forward(h[:, None], state, return_state=True)
        return y[:, 0], state

    def prefill(self, h):                                               # h (b, L, d)
        """The prompt in one causal pass, and its keys and values for `step` to continue from."""
        return self.forward(h, None, return_state=True)
