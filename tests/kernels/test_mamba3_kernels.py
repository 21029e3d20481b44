"""The Mamba-3 scan (sonata.kernels.mamba3, mamba_ssm's released semantics): the SISO path on
the SSD kernel and the chunked path (any rank) against the token-by-token float64 oracle,
outputs, final state and the gradient of every input and of the initial state, at lengths
around the chunk, both rotation layouts, SISO and MIMO; the one-token step; the backends."""
from __future__ import annotations

import pytest
import torch

from sonata.kernels.mamba3 import mamba3_chunked, mamba3_ref, mamba3_scan, mamba3_siso_ssd, mamba3_step, rotate


def case(L, R, seed, b=2, h=3, n=8, p=4, m=2, dtype=torch.float64, euler=False):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g, dtype=torch.float64)).to(dtype)

    q, k, x = r(b, L, R, h, n), r(b, L, R, h, n), r(b, L, h, p)
    dt = (torch.rand(b, L, h, generator=g, dtype=torch.float64) * 0.5 + 0.01).to(dtype)
    A = -(torch.rand(b, L, h, generator=g, dtype=torch.float64) * 2 + 1e-4).to(dtype)
    trap = None if euler else torch.rand(b, L, h, generator=g, dtype=torch.float64).to(dtype)
    angle, D = r(b, L, h, m, scale=2.0), r(h)
    mimo_x = r(h, R, p) if R > 1 else None
    state = (r(b, h, m).double(), r(b, h, p, n), r(b, R, h, n), r(b, h, p))
    return [q, k, x, dt, A, trap, angle, D, mimo_x], state


def leaves(args, state):
    args = [None if t is None else t.detach().clone().requires_grad_(True) for t in args]
    state = tuple(t.detach().clone().requires_grad_(True) for t in state)
    return args, state


def check_equal(run, ref_run, L, R, pairing, seed, euler=False):
    args, state = case(L, R, seed, euler=euler)
    a1, s1 = leaves(args, state)
    a2, s2 = leaves(args, state)
    y, st = run(*a1, pairing, s1)
    trap = a2[5] if a2[5] is not None else torch.ones_like(a2[3])
    y_ref, st_ref = ref_run(*a2[:5], trap, *a2[6:], pairing, s2)
    assert (y - y_ref).abs().max() < 1e-11 * max(1.0, float(y_ref.detach().abs().max()))
    for a, b in zip(st, st_ref):
        assert torch.allclose(a, b, atol=1e-11, rtol=1e-11)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    ws = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in st]

    def loss(y, st):
        return (y * w).sum() + sum((t * u).sum() for t, u in zip(st, ws) if t.requires_grad)

    names = "q k x dt A trap angle D mimo_x Theta0 S0 k_prev x_prev".split()
    ins1 = [t for t in (*a1, *s1) if t is not None]
    ins2 = [t for t in (*a2, *s2) if t is not None]
    got = torch.autograd.grad(loss(y, st), ins1, allow_unused=True)
    ref = torch.autograd.grad(loss(y_ref, st_ref), ins2, allow_unused=True)
    present = [nm for nm, t in zip(names, (*a1, *s1)) if t is not None]
    for nm, a, b in zip(present, got, ref):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None:
            assert torch.allclose(a, b, atol=1e-9, rtol=1e-8), nm


@pytest.mark.parametrize("L", [1, 17, 64, 65])
@pytest.mark.parametrize("R,pairing", [(1, "adjacent"), (1, "half"), (2, "half"), (4, "half"), (3, "adjacent")])
def test_the_chunked_scan_equals_the_oracle(L, R, pairing):
    def run(*a):
        return mamba3_chunked(*a, chunk_size=16)
    check_equal(run, mamba3_ref, L, R, pairing, seed=L + 10 * R)


@pytest.mark.parametrize("L", [1, 17, 65])
@pytest.mark.parametrize("pairing,euler", [("adjacent", False), ("half", False), ("adjacent", True)])
def test_the_siso_scan_on_the_ssd_kernel_equals_the_oracle(L, pairing, euler):
    def run(q, k, x, dt, A, trap, angle, D, mimo_x, pairing, state):
        return mamba3_siso_ssd(q, k, x, dt, A, trap, angle, D, pairing, state, chunk_size=16, backend="cpu")
    check_equal(run, mamba3_ref, L, 1, pairing, seed=L, euler=euler)


@pytest.mark.parametrize("R", [1, 4])
def test_float32_fast_paths_are_within_float32_tolerance(R):
    args, state = case(130, R, seed=3, dtype=torch.float32)
    y, _ = mamba3_scan(*args, "half", state, chunk_size=64, backend="cpu")
    y_ref, _ = mamba3_ref(*(None if t is None else t.double() for t in args), "half",
                          tuple(t.double() for t in state))
    assert y.dtype == torch.float32
    assert (y.double() - y_ref).abs().max() < 2e-5 * float(y_ref.abs().max())


def test_the_step_continues_a_scan_in_place():
    args, state = case(9, 2, seed=4)
    y, st = mamba3_scan(*args, "half", state, backend="chunked")
    y8, st8 = mamba3_scan(*(None if t is None else (t if t.dim() < 3 else t[:, :8]) for t in args), "half", state,
                          backend="chunked")
    live = tuple(t.clone() for t in st8)
    q, k, x, dt, A, trap, angle, D, mimo_x = args
    y9 = mamba3_step(q[:, 8], k[:, 8], x[:, 8], dt[:, 8], A[:, 8], trap[:, 8], angle[:, 8], D, mimo_x, "half", live)
    assert torch.allclose(y9, y[:, 8], atol=1e-11)
    for a, b in zip(live, st):
        assert torch.allclose(a, b, atol=1e-11)


def test_rotations_turn_the_named_pairs():
    v = torch.arange(8.0)[None]
    quarter = torch.tensor([[torch.pi / 2, 0.0]])
    assert torch.allclose(rotate(v, quarter, "adjacent"), torch.tensor([[-1.0, 0, 2, 3, 4, 5, 6, 7]]), atol=1e-6)
    assert torch.allclose(rotate(v, quarter, "half"), torch.tensor([[-4.0, 1, 2, 3, 0, 5, 6, 7]]), atol=1e-6)


def test_backends_and_bad_requests():
    args, state = case(5, 1, seed=5)
    ys = [mamba3_scan(*args, "adjacent", state, backend=b)[0] for b in ("reference", "chunked", "cpu", "auto")]
    for y in ys[1:]:
        assert torch.allclose(y, ys[0], atol=1e-11)
    empty = [None if t is None else (t if t.dim() < 3 else t[:, :0]) for t in args]
    y0, st0 = mamba3_scan(*empty, "adjacent", state)
    assert y0.shape == (2, 0, 1, 3, 4) and all(a is b for a, b in zip(st0, state))
    with pytest.raises(ValueError, match="unknown mamba3 backend 'numba'"):
        mamba3_scan(*args, "adjacent", state, backend="numba")
    with pytest.raises(ValueError, match="pairing must be one of adjacent, half"):
        mamba3_scan(*args, "pairs", state)
