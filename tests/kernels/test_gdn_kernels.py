"""The gated delta rule (sonata.kernels.gdn): the chunked WY form and the fused CPU kernels
against the float64 step-by-step oracle (outputs, final state and every gradient, on odd
lengths and chunk sizes, grouped key heads), the one-token step against the forward, and the
entry point's dispatch and argument checks."""
from __future__ import annotations

import pytest
import torch

from sonata.kernels import dispatch
from sonata.kernels.gdn import (BACKENDS, gated_delta_rule, gated_delta_rule_step, gdn_chunked_ref,
                                gdn_recurrent_ref, gdn_step_ref, l2norm)

numba = pytest.importorskip("numba")
from sonata.kernels.gdn import cpu as gdn_cpu_mod  # noqa: E402
from sonata.kernels.gdn import ops as gdn_ops  # noqa: E402


def inputs(b=2, L=13, h=4, hk=2, dk=8, dv=6, dtype=torch.float64, seed=0, grad=True):
    """q, k L2-normalised (as the layer gives them), g <= 0, beta in (0, 1), a random S0."""
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = l2norm(r(b, L, hk, dk)), l2norm(r(b, L, hk, dk))
    v = r(b, L, h, dv)
    g = -torch.rand(b, L, h, generator=gen, dtype=torch.float64) * 0.7
    beta = torch.rand(b, L, h, generator=gen, dtype=torch.float64)
    S0 = r(b, h, dk, dv)
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v, g, beta, S0)]


def run(impl, xs, **kw):
    """Outputs, final state and the gradients of a random weighting of both w.r.t. every input."""
    o, S = impl(*xs[:5], initial_state=xs[5], return_final_state=True, **kw)
    gen = torch.Generator().manual_seed(7)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ws = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)
    grads = torch.autograd.grad((o * wo).sum() + (S * ws).sum(), xs)
    return [o, S, *grads]


NAMES = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dS0"]


def assert_close(got, want, rtol):
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), f"{name} has NaN or Inf"
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()
        assert err < rtol, f"{name}: relative error {err:.2e}"


CASES = [(1, 4, 1), (7, 4, 2), (16, 4, 1), (17, 16, 2), (37, 8, 4), (64, 64, 1), (65, 64, 2)]


@pytest.mark.parametrize("L, chunk, hk", CASES, ids=[f"L{c[0]}-C{c[1]}-hk{c[2]}" for c in CASES])
@pytest.mark.parametrize("impl", ["chunked", "cpu"])
def test_each_form_equals_the_float64_recurrence_values_state_and_every_gradient(L, chunk, hk, impl):
    xs = inputs(L=L, hk=hk)
    want = run(gdn_recurrent_ref, xs)
    f = gdn_chunked_ref if impl == "chunked" else gdn_ops.gdn_cpu
    got = run(f, xs, chunk_size=chunk)
    assert_close(got, want, 1e-12)


def test_the_result_does_not_depend_on_the_chunk_size():
    xs = inputs(L=40, hk=1)
    want = run(gdn_chunked_ref, xs, chunk_size=40)
    for chunk in (1, 3, 64):
        assert_close(run(gdn_chunked_ref, xs, chunk_size=chunk), want, 1e-12)
        assert_close(run(gdn_ops.gdn_cpu, xs, chunk_size=chunk), want, 1e-12)


@pytest.mark.parametrize("impl", ["chunked", "cpu"])
def test_float32_is_within_float32_tolerance_of_the_oracle(impl):
    xs64 = inputs(L=50, h=4, hk=2, dk=16, dv=16)
    want = run(gdn_recurrent_ref, xs64)
    xs32 = [t.detach().float().requires_grad_() for t in xs64]
    f = gdn_chunked_ref if impl == "chunked" else gdn_ops.gdn_cpu
    got = run(f, xs32, chunk_size=16)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_close(got, want, 2e-5)


def test_a_strong_decay_and_full_writes_stay_finite():
    """g down to -30 (exp(g) ~ 1e-13: the chunk's cumulative decay spans ~1e-300 in float64) and
    beta = 1: the masked exponent keeps every entry finite."""
    xs = inputs(L=33, hk=1, grad=False)
    xs[3] = (xs[3] * 40).clamp(min=-30)
    xs[4] = torch.ones_like(xs[4])
    xs = [t.requires_grad_() for t in xs]
    want = run(gdn_recurrent_ref, xs)
    assert_close(run(gdn_chunked_ref, xs, chunk_size=16), want, 1e-10)
    assert_close(run(gdn_ops.gdn_cpu, xs, chunk_size=16), want, 1e-10)


def test_without_initial_state_or_final_state():
    q, k, v, g, beta, _ = inputs(L=9)
    o_ref = gdn_recurrent_ref(q, k, v, g, beta)
    dv_ref, = torch.autograd.grad(o_ref.sum(), [v])
    for backend in ("reference", "cpu", "recurrent"):
        o = gated_delta_rule(q, k, v, g, beta, chunk_size=4, backend=backend)
        assert torch.allclose(o, o_ref, atol=1e-12, rtol=0)
        dv, = torch.autograd.grad(o.sum(), [v])
        assert torch.allclose(dv, dv_ref, atol=1e-12, rtol=0)


def test_an_explicit_scale_is_applied_to_q():
    q, k, v, g, beta, S0 = inputs(L=5, grad=False)
    for backend in ("reference", "cpu", "recurrent"):
        a = gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=S0, backend=backend)
        b = gated_delta_rule(q * (0.3 / q.shape[-1] ** -0.5), k, v, g, beta, initial_state=S0, backend=backend)
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_the_step_chain_equals_the_forward(fused):
    q, k, v, g, beta, S0 = inputs(L=11, hk=2, grad=False)
    o, S = gdn_recurrent_ref(q, k, v, g, beta, initial_state=S0, return_final_state=True)
    state = S0.clone()
    outs = []
    with torch.inference_mode():
        for t in range(11):
            args = (state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
            outs.append(gated_delta_rule_step(*args) if fused else gdn_step_ref(*args))
    assert torch.allclose(torch.stack(outs, 1), o, atol=1e-12, rtol=0)
    assert torch.allclose(state, S, atol=1e-12, rtol=0)


def test_the_fused_step_runs_on_a_float32_state_and_matches_the_reference(monkeypatch):
    q, k, v, g, beta, S0 = (t.float() for t in inputs(L=1, hk=2, grad=False))
    calls = []
    kernel = gdn_cpu_mod.gdn_step_kernel
    monkeypatch.setattr(gdn_cpu_mod, "gdn_step_kernel", lambda *a: (calls.append(1), kernel(*a))[1])
    a_state, b_state = S0.clone(), S0.clone()
    with torch.no_grad():
        a = gated_delta_rule_step(a_state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    b = gdn_step_ref(b_state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    assert calls == [1]
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a_state, b_state, atol=1e-5)


def test_the_cpu_kernels_write_every_output_and_are_deterministic(monkeypatch):
    monkeypatch.setattr(gdn_cpu_mod, "POISON", True)          # outputs start as NaN
    xs = [t.detach().float().requires_grad_() for t in inputs(L=21, hk=2)]
    first = run(gdn_ops.gdn_cpu, xs, chunk_size=8)
    second = run(gdn_ops.gdn_cpu, xs, chunk_size=8)
    for name, a, b in zip(NAMES, first, second):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name} differs between two runs"


def test_half_precision_inputs_compute_in_float32():
    xs = [t.detach().to(torch.bfloat16) for t in inputs(L=9, grad=False)]
    want = gdn_recurrent_ref(*(t.double() for t in xs[:5]), initial_state=xs[5].double())
    for backend in ("reference", "cpu"):
        o = gated_delta_rule(*xs[:5], initial_state=xs[5], backend=backend)
        assert o.dtype == torch.bfloat16
        assert (o.double() - want).abs().max() < 0.05


def test_length_zero_returns_the_initial_state():
    q, k, v, g, beta, S0 = inputs(L=0, grad=False)
    for backend in BACKENDS:
        o, S = gated_delta_rule(q, k, v, g, beta, initial_state=S0, return_final_state=True, backend=backend)
        assert o.shape == (2, 0, 4, 6) and torch.equal(S, S0)


def test_dispatch_auto_picks_cpu_and_triton_runs_the_reference_without_a_fallback(monkeypatch):
    from sonata.kernels.gdn import resolve_backend
    x = torch.zeros(1, 1, 1, 1)
    assert resolve_backend("auto", x) == ("cpu", None)
    assert resolve_backend("triton", x) == ("reference", None)
    assert resolve_backend("recurrent", x) == ("recurrent", None)
    before = dispatch.fallback_count()
    q, k, v, g, beta, S0 = inputs(L=5, grad=False)
    a = gated_delta_rule(q, k, v, g, beta, initial_state=S0, backend="triton")
    assert dispatch.fallback_count() == before
    assert torch.allclose(a, gdn_recurrent_ref(q, k, v, g, beta, initial_state=S0), atol=1e-12)
    with pytest.raises(ValueError, match="unknown gdn backend 'cuda'"):
        gated_delta_rule(q, k, v, g, beta, backend="cuda")


BAD = [
    (lambda q, k, v, g, b, S: (q, k, v[..., 0], g, b, S), "v must be (batch, seqlen, heads, dv)"),
    (lambda q, k, v, g, b, S: (q[:, :3], k, v, g, b, S), "q must be (batch, seqlen, key heads, dk)"),
    (lambda q, k, v, g, b, S: (q, k[..., :4], v, g, b, S), "k must have q's shape"),
    (lambda q, k, v, g, b, S: (q[:, :, :1].expand(-1, -1, 3, -1), k[:, :, :1].expand(-1, -1, 3, -1), v, g, b, S),
     "4 value heads cannot share 3 key heads"),
    (lambda q, k, v, g, b, S: (q, k, v, g[..., :2], b, S), "g must be (2, 5, 4)"),
    (lambda q, k, v, g, b, S: (q, k, v, g, b, S[:, :, :3]), "initial_state must be (2, 4, 8, 6)"),
]


@pytest.mark.parametrize("make, fragment", BAD, ids=[f for _, f in BAD])
def test_bad_arguments_are_named(make, fragment):
    args = make(*inputs(L=5, grad=False))
    with pytest.raises(ValueError, match="^gdn: " + fragment.replace("(", r"\(").replace(")", r"\)")):
        gated_delta_rule(*args[:5], initial_state=args[5])
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        gated_delta_rule(*inputs(L=5, grad=False)[:5], chunk_size=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_state", [False, True])
def test_the_rule_op_passes_opcheck(dtype, with_state):
    """torch.ops.sonata.gated_delta_rule (gdn/ops.py): schema, the fake implementation against
    the real one, and the autograd registration, grouped key heads, with and without S0."""
    q, k, v, g, beta, S0 = inputs(L=11, dtype=dtype)
    torch.library.opcheck(gdn_ops.gated_delta_rule, (q, k, v, g, beta, S0 if with_state else None, 0.35, 4))
