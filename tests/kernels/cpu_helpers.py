"""Helpers shared by the fused CPU kernel tests (test_selective_cpu.py, test_layers_cpu.py): the
per-run seed, the NaN-filled outputs fixture and the closeness check. (A module, not a conftest.py:
a second conftest module would hide tests/conftest.py from `from conftest import ...`.)"""
from __future__ import annotations

import os
import random

import pytest
import torch

from sonata.kernels.layers import cpu as layers_cpu
from sonata.kernels.selective import cpu as selective_cpu


def new_seed() -> int:
    env = os.environ.get("SONATA_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


@pytest.fixture
def nan_empty(monkeypatch):
    """Make every torch.empty in the cpu backends (the scan's and the layers') NaN-filled, so an output element
    that a kernel forgets to write shows up as NaN instead of stale memory."""

    class NaNTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return torch.empty(*args, **kwargs).fill_(float("nan"))

    for glue in (selective_cpu, layers_cpu):
        monkeypatch.setattr(glue, "torch", NaNTorch())


RMS_MIN_ELEMENTS = 16


def check_close(name, got, ref, seed, rtol, atol, rel_rms):
    """allclose (atol scaled by the reference's RMS, for gradients that are large
    sums) plus a relative-RMS bound; no NaN/inf anywhere. The relative-RMS bound is an
    average: it applies from RMS_MIN_ELEMENTS elements on. Below, it would be one sum's
    conditioning: a 1-element gradient that sums channels with cancellation measured a
    relative error over 2e-5 for 28 of 3,000 seeds (the delta projection's one-step case)."""
    ctx = f"{name} (seed={seed})"
    assert got is not None, f"{ctx}: missing"
    assert got.shape == ref.shape, f"{ctx}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    got = got.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    assert torch.isfinite(got).all(), f"{ctx}: non-finite values"
    scale = max(1.0, ref.pow(2).mean().sqrt().item()) if ref.numel() else 1.0
    err = (got - ref).abs()
    bad = err > atol * scale + rtol * ref.abs()
    assert not bad.any(), (f"{ctx}: {int(bad.sum())}/{bad.numel()} elements off, max abs err "
                           f"{err.max().item():.3g} (scale {scale:.3g})")
    denom = ref.norm().item()
    if denom > 0 and ref.numel() >= RMS_MIN_ELEMENTS:
        rel = (got - ref).norm().item() / denom
        assert rel <= rel_rms, f"{ctx}: relative RMS error {rel:.3g} > {rel_rms:.3g}"
