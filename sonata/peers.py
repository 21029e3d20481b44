"""Peer implementations the benchmarks compare against (never used for training).

mambapy (alxndrTL/mamba.py) is a pure-PyTorch Mamba with a parallel scan over the
materialized (B, L, D, N) tensors: the natural CPU peer of sonata's fused kernels.
It is an optional dependency (`pip install -e .[bench]`).
"""
from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F


def import_mambapy():
    """mambapy's LM imports its Mamba-2 module, which needs mamba_ssm's Triton ops at
    import time. We only use Mamba-1 (pure PyTorch parallel scan), so stand-ins for
    those names are enough to import it."""
    if "mamba_ssm" not in sys.modules:
        def _unavailable(*a, **k):
            raise RuntimeError("mamba_ssm is not installed; Mamba-2 is not benchmarked")
        names = ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
                 "mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated"]
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        ssd = sys.modules["mamba_ssm.ops.triton.ssd_combined"]
        ssd.mamba_chunk_scan_combined = ssd.mamba_split_conv1d_scan_combined = _unavailable
    import mambapy.lm
    import mambapy.mamba
    import mambapy.pscan
    return mambapy


class GPT2LM(torch.nn.Module):
    """transformers' GPT2LMHeadModel as a sonata language model (`model.arch=gpt2`): the
    baseline of the ten-minute race (benchmarks/race.py), trained by sonata's own trainer on the
    same batches as any sonata model. Width model.d_model, model.n_layers blocks of
    model.n_heads heads, context `n_positions` (data.seq_len), tied embeddings, no dropout
    (sonata's models have none). forward(idx) -> logits (b, L, vocab); no recurrent state."""

    def __init__(self, cfg, n_positions: int):
        super().__init__()
        try:
            import transformers
        except ImportError:
            from sonata.errors import ConfigError
            raise ConfigError("model.arch=gpt2 needs transformers: pip install transformers") from None
        self.cfg = cfg
        conf = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=n_positions, n_embd=cfg.d_model,
                                       n_layer=cfg.n_layers, n_head=cfg.n_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=True,
                                       bos_token_id=None, eos_token_id=None)   # no 50256 outside the vocabulary
        self.gpt = transformers.GPT2LMHeadModel(conf)

    def forward(self, idx, state=None, return_state: bool = False):
        if state is not None or return_state:
            raise ValueError("model.arch=gpt2 has no recurrent state (score whole sequences)")
        return self.gpt(input_ids=idx, use_cache=False).logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())          # the tied embedding once


def free_scan(x, delta, A, B, C, D):
    """A stand-in for the selective scan that costs O(batch * L * d_inner): no state, no
    recurrence, but every input reaches the output (so every gradient flows), in mambapy's
    layout: x, delta (b, L, d); A (d, N); B, C (b, L, N); D (d,) -> (b, L, d). The "scan-free
    peer" is mambapy's model with its scan replaced by this: what its step costs outside
    the scan."""
    return x * delta * ((B * C).sum(-1, keepdim=True) + A.sum(-1)) + D * x


def mambapy_lm(d_model, n_layers, d_state, vocab_size, device="cpu", scan_free=False):
    """mambapy's LM at the given size, with tied embeddings like sonata's (same parameter count);
    scan_free: every block's scan replaced by `free_scan`."""
    mp = import_mambapy()
    cfg = mp.mamba.MambaConfig(d_model=d_model, n_layers=n_layers, d_state=d_state, pscan=True)
    lm = mp.lm.LM(cfg, vocab_size=vocab_size)
    lm.lm_head.weight = lm.embedding.weight
    if scan_free:
        for layer in lm.mamba.layers:
            layer.mixer.selective_scan = free_scan      # instance attribute: called without self
    return lm.to(device)


def mambapy_scan(u, delta, A, B, C, D, z, delta_bias):
    """mambapy's selective_scan (pscan) in sonata's layout, with the same bias, softplus
    and silu(z) gate, so both compute the same function."""
    pscan = import_mambapy().pscan.pscan
    x = u.transpose(1, 2)                                           # (b, L, d)
    dt = F.softplus(delta.transpose(1, 2) + delta_bias)             # (b, L, d)
    deltaA = torch.exp(dt.unsqueeze(-1) * A)                        # (b, L, d, n)
    BX = dt.unsqueeze(-1) * B.transpose(1, 2).unsqueeze(2) * x.unsqueeze(-1)
    hs = pscan(deltaA, BX)
    y = (hs @ C.transpose(1, 2).unsqueeze(-1)).squeeze(3) + D * x
    return (y * F.silu(z.transpose(1, 2))).transpose(1, 2)
