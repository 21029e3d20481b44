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
    those names are enough to import it. A real mamba_ssm is left alone; sonata's own shim
    (`sonata.interop.mamba_ssm.install()`, which may already be in sys.modules) keeps what it
    serves and gains only the stand-ins it lacks."""
    real = "mamba_ssm" in sys.modules and not getattr(sys.modules["mamba_ssm"], "__sonata_shim__", False)
    if not real:
        def _unavailable(*a, **k):
            raise RuntimeError("mamba_ssm is not installed; Mamba-2 is not benchmarked")
        names = ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
                 "mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated"]
        for n in names:
            if n not in sys.modules:
                sys.modules[n] = types.ModuleType(n)
                if "." in n:
                    parent, _, leaf = n.rpartition(".")
                    setattr(sys.modules[parent], leaf, sys.modules[n])
        ssd = sys.modules["mamba_ssm.ops.triton.ssd_combined"]
        for fn in ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"):
            if not hasattr(ssd, fn):
                setattr(ssd, fn, _unavailable)
    import mambapy.lm
    import mambapy.mamba
    import mambapy.pscan
    return mambapy


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
