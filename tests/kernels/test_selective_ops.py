"""The fused CPU selective scan as PyTorch custom ops (sonata.kernels.selective.ops):
torch.library.opcheck on the forward (with its autograd) in every argument combination the
model uses (D, z, delta_bias, softplus, the delta projection folded in, an initial state), and
the op's outputs and gradients equal to the reference scan's."""
import pytest
import torch

from sonata.kernels.selective import ops, selective_scan, selective_scan_ref


def _inputs(batch=2, dim=6, L=9, N=4, R=0, dtype=torch.float64, seed=0, h0=False, time_major_bc=False):
    g = torch.Generator().manual_seed(seed)

    def t(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=dtype) * scale).requires_grad_()
    u = t(batch, dim, L)
    delta = t(batch, L, R, scale=0.5) if R else t(batch, dim, L, scale=0.5)
    A = (-torch.rand(dim, N, generator=g, dtype=dtype) - 0.5).requires_grad_()
    if time_major_bc:                               # B, C as transposed views of (b, L, N)
        B = t(batch, L, N).transpose(1, 2)
        C = t(batch, L, N).transpose(1, 2)
    else:
        B, C = t(batch, N, L), t(batch, N, L)
    return dict(u=u, delta=delta, A=A, B=B, C=C, D=t(dim), z=t(batch, dim, L), delta_bias=t(dim, scale=0.3),
                delta_proj=t(dim, R, scale=0.5) if R else None, initial_state=t(batch, dim, N) if h0 else None)


CASES = {"plain": dict(), "no-D-z-bias": dict(D=None, z=None, delta_bias=None), "projected": dict(R=3),
         "initial-state": dict(h0=True), "time-major-B-C": dict(time_major_bc=True)}


def _args(name, dtype=torch.float64):
    kw = dict(CASES[name])
    over = {k: kw.pop(k) for k in ("D", "z", "delta_bias") if k in kw}
    a = {**_inputs(dtype=dtype, **kw), **over}
    return (a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"], True,
            a["delta_proj"], a["initial_state"])


@pytest.mark.parametrize("name", CASES)
def test_the_scan_op_passes_opcheck(name):
    torch.library.opcheck(ops.selective_scan, _args(name))


@pytest.mark.parametrize("name", CASES)
def test_the_op_equals_the_reference_scan_values_and_gradients(name):
    args = _args(name)
    u, delta, A, B, C, D, z, db, sp, W, h0 = args
    out, last, _ = ops.selective_scan(*args)
    ref_delta = delta if W is None else (delta @ W.t()).transpose(1, 2)
    want, want_last = selective_scan_ref(u, ref_delta, A, B, C, D, z, db, sp, True, h0)
    assert torch.allclose(out, want, atol=1e-10) and torch.allclose(last, want_last, atol=1e-10)
    leaves = [t for t in (u, delta, A, B, C, D, z, db, W, h0) if t is not None]
    g = torch.autograd.grad((out * 1.3).sum() + (last ** 2).sum(), leaves)
    w = torch.autograd.grad((want * 1.3).sum() + (want_last ** 2).sum(), leaves)
    for a, b in zip(g, w):
        assert torch.allclose(a, b, atol=1e-9)


def test_the_cpu_backend_runs_the_op():
    a = _inputs(dtype=torch.float32)
    out = selective_scan(a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"], True,
                         backend="cpu")
    assert "sonata_selective_scan" in type(out.grad_fn).__name__
