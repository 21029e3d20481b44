"""The scan's initial and final state, on every backend that runs here, against the float64
reference: forward, last state and every gradient, the initial state's included; and a
sequence scanned in pieces, each piece starting from the last one's final state, equals one
pass over the whole sequence (what chunked evaluation of a million-token sequence relies on).

The triton backend runs in Triton's CPU interpreter here (tests/conftest.py switches it on
before triton is imported when there is no GPU); a backend that cannot run here skips with
its reason instead of falling back silently.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from sonata import kernels
from sonata.kernels import selective_scan, selective_scan_ref

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def inputs(seed, batch, dim, N, L, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    dt = torch.exp(torch.rand(dim, generator=g, dtype=torch.float64) * math.log(100) + math.log(1e-3))
    bias = dt + torch.log(-torch.expm1(-dt))                      # softplus^-1: dt in [1e-3, 0.1]
    t = dict(u=randn(batch, dim, L), delta=0.3 * randn(batch, dim, L),
             A=-torch.arange(1, N + 1, dtype=torch.float64).repeat(dim, 1) * torch.exp(0.1 * randn(dim, N)),
             B=randn(batch, N, L), C=randn(batch, N, L), D=randn(dim), z=randn(batch, dim, L),
             delta_bias=bias, initial_state=randn(batch, dim, N))
    return {k: v.to(dtype) for k, v in t.items()}


def leaves(t, dtype=None):
    return {k: v.detach().to(dtype or v.dtype).clone().requires_grad_() for k, v in t.items()}


def runs_here(backend: str, x: torch.Tensor) -> None:
    name, reason = kernels.resolve_backend(backend, x)
    if name != backend:
        pytest.skip(f"{backend} backend cannot run here: {reason}")


def scan_and_grads(t, backend, dout, dlast):
    out, last = selective_scan(**t, delta_softplus=True, return_last_state=True, backend=backend)
    loss = (out.double() * dout).sum() + (last.double() * dlast).sum()
    return out, last, grads_of(loss, t)


def grads_of(loss, t):
    """Every input's gradient; zeros for one the loss does not reach (an empty sequence)."""
    grads = torch.autograd.grad(loss, [t[k] for k in NAMES], allow_unused=True)
    return {k: torch.zeros_like(t[k]) if g is None else g for k, g in zip(NAMES, grads)}


def close(name, got, want, tol):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if not got.numel():
        return
    scale = max(1.0, want.pow(2).mean().sqrt().item())
    err = (got - want).abs().max().item()
    assert err <= tol * scale, f"{name}: max abs error {err:.3g} > {tol:.1g} x {scale:.3g}"


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("shape", [(2, 37, 16, 130), (1, 5, 3, 1), (3, 40, 4, 0)],
                         ids=["odd", "one-step", "empty"])
def test_initial_state_against_float64_reference(backend, shape):
    seed = random.SystemRandom().randrange(2**31)
    batch, dim, N, L = shape
    t = inputs(seed, batch, dim, N, L)
    runs_here(backend, t["u"].float())
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(batch, dim, L, generator=g, dtype=torch.float64)
    dlast = torch.randn(batch, dim, N, generator=g, dtype=torch.float64)
    before = kernels.fallback_count()
    out, last, grads = scan_and_grads(leaves(t, torch.float32), backend, dout, dlast)
    assert kernels.fallback_count() == before, f"{backend} fell back to the reference"
    ref = leaves(t)
    r_out, r_last = selective_scan_ref(**{k: ref[k] for k in NAMES}, delta_softplus=True,
                                       return_last_state=True)
    r_grads = grads_of((r_out * dout).sum() + (r_last * dlast).sum(), ref)
    msg = f"{backend}, seed {seed}"
    close(f"out ({msg})", out, r_out, 2e-4)
    close(f"last state ({msg})", last, r_last, 2e-4)
    for k in NAMES:
        close(f"d{k} ({msg})", grads[k], r_grads[k], 5e-4)
    if L == 0:          # no step: the last state is the initial one, and so are their gradients
        assert torch.equal(last, t["initial_state"].float())
        assert torch.equal(grads["initial_state"], dlast.float())


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_pieces_chained_through_the_state_equal_one_pass(backend):
    """out and last state of a 300-step scan, whole and in pieces of 128, 100 and 72 steps
    (the pieces cross the cpu kernels' chunk boundary and end mid-chunk), in float32."""
    seed = random.SystemRandom().randrange(2**31)
    t = inputs(seed, 2, 33, 8, 300, torch.float32)
    runs_here(backend, t["u"])
    whole, whole_last = selective_scan(**t, delta_softplus=True, return_last_state=True, backend=backend)
    h, outs = t["initial_state"], []
    for a, b in ((0, 128), (128, 228), (228, 300)):
        piece = {k: (v[..., a:b] if k in ("u", "delta", "B", "C", "z") else v) for k, v in t.items()}
        piece["initial_state"] = h
        out, h = selective_scan(**piece, delta_softplus=True, return_last_state=True, backend=backend)
        outs.append(out)
    msg = f"{backend}, seed {seed}"
    close(f"out in pieces ({msg})", torch.cat(outs, -1), whole, 1e-5)
    close(f"last state in pieces ({msg})", h, whole_last, 1e-5)


def test_cpu_gradcheck_with_initial_state():
    """Every gradient of the fused cpu backward, the initial state's included, against
    finite differences in float64."""
    t = leaves(inputs(7, 2, 5, 3, 9))
    runs_here("cpu", t["u"])

    def f(*args):
        kw = dict(zip(NAMES, args))
        out, last = selective_scan(**kw, delta_softplus=True, return_last_state=True, backend="cpu")
        return out, last
    assert torch.autograd.gradcheck(f, tuple(t[k] for k in NAMES), eps=1e-6, atol=1e-6)
