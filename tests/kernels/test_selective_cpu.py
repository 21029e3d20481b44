"""The fused numba CPU scan (sonata/kernels/selective/cpu_kernels.py, its glue selective/cpu.py)
against the float64 reference.

Inputs are fresh random draws every run. Each test draws its seed from the OS and
puts it in every assertion message; set SONATA_TEST_SEED=<seed> to replay a failure.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import cpu_helpers
from cpu_helpers import check_close, new_seed
from sonata.kernels import cpu_simd  # noqa: E402   numba is a dependency: a broken one fails here, not skips
from sonata.kernels import fallback_count, selective_scan, selective_scan_ref  # noqa: E402
from sonata.kernels.selective import cpu  # noqa: E402

nan_empty = cpu_helpers.nan_empty           # the fixture

GRAD_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def make_inputs(seed, batch, dim, N, L, *, D=True, z=True, bias=True, softplus=True,
                big_delta=False, dtype=torch.float32):
    """Mamba-like inputs: dt = softplus(delta + bias) mostly in [0.001, 0.1] (log-uniform
    init of the bias, small delta), or in ~[0.3, 5] with big_delta; A = -(1..N) with jitter.
    Returns (tensors dict, kwargs for selective_scan)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    dt_init = torch.exp(torch.rand(dim, generator=g, dtype=torch.float64)
                        * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    if big_delta:
        dt_raw = 1.0 + 1.5 * randn(batch, dim, L)                  # softplus: ~0.3 .. 5
        bias_t = 0.1 * randn(dim)
    else:
        bias_t = dt_init + torch.log(-torch.expm1(-dt_init))         # softplus^-1(dt_init)
        dt_raw = bias_t[None, :, None] + 0.3 * randn(batch, dim, L)
    if softplus:
        delta = dt_raw - (bias_t[None, :, None] if bias else 0)
    else:                          # delta (+ bias) is used as dt directly: keep it positive
        dt = torch.nn.functional.softplus(dt_raw)
        delta = dt - (bias_t[None, :, None] if bias else 0)
    A = -torch.arange(1, N + 1, dtype=torch.float64).repeat(dim, 1) * torch.exp(0.1 * randn(dim, N))
    t = dict(u=randn(batch, dim, L), delta=delta, A=A, B=randn(batch, N, L), C=randn(batch, N, L),
             D=randn(dim) if D else None, z=randn(batch, dim, L) if z else None,
             delta_bias=bias_t if bias else None)
    t = {k: (v.to(dtype) if v is not None else None) for k, v in t.items()}
    return t, dict(delta_softplus=softplus)


def leaves(t, dtype=None):
    """Fresh leaf copies (optionally cast) that require grad; None stays None."""
    return {k: (v.detach().to(dtype or v.dtype).clone().requires_grad_() if v is not None else None)
            for k, v in t.items()}


def reference_in_pieces(t, kw, piece=32):
    """selective_scan_ref over time pieces chained through initial_state: the same
    function and arithmetic, but its backward (which slices the materialized
    (batch, dim, L, N) tensor once per step) costs O(L * piece) instead of O(L^2)."""
    L = t["u"].shape[-1]
    outs, h = [], None
    for s in range(0, L, piece):
        sl = slice(s, s + piece)
        out, h = selective_scan_ref(
            t["u"][..., sl], t["delta"][..., sl], t["A"], t["B"][..., sl], t["C"][..., sl], t["D"],
            None if t["z"] is None else t["z"][..., sl], t["delta_bias"], kw["delta_softplus"],
            return_last_state=True, initial_state=h)
        outs.append(out)
    return torch.cat(outs, dim=-1), h


def run(t, kw, dout, dlast, backend):
    """Forward and backward of one backend: (out, last_state, {name: grad})."""
    out, last = (selective_scan(**t, **kw, return_last_state=True, backend=backend)
                 if backend != "ref" else reference_in_pieces(t, kw))
    loss = 0
    if dout is not None:
        loss = loss + (out.to(dout.dtype) * dout).sum()
    if dlast is not None:
        loss = loss + (last.to(dlast.dtype) * dlast).sum()
    names = [k for k in GRAD_NAMES if t[k] is not None]
    grads = torch.autograd.grad(loss, [t[k] for k in names], allow_unused=True)
    return out, last, dict(zip(names, grads))


def compare_to_reference(seed, batch, dim, N, L, *, use_dout=True, use_dlast=True,
                         dtype=torch.float32, tol=(1e-4, 2e-4, 2e-5), **opts):
    t, kw = make_inputs(seed, batch, dim, N, L, dtype=dtype, **opts)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(batch, dim, L, generator=g, dtype=torch.float64) if use_dout else None
    dlast = torch.randn(batch, dim, N, generator=g, dtype=torch.float64) if use_dlast else None

    fused = leaves(t)
    out, last, grads = run(fused, kw, dout, dlast, "cpu")
    r_out, r_last, r_grads = run(leaves(t, torch.float64), kw, dout, dlast, "ref")

    assert out.dtype == dtype, f"out dtype {out.dtype} (seed={seed})"
    assert last.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol, atol, rel_rms = tol
    check_close("out", out, r_out, seed, rtol, atol, rel_rms)
    check_close("last_state", last, r_last, seed, rtol, atol, rel_rms)
    for name, ref in r_grads.items():
        got = grads[name]
        if ref is None:        # the input does not reach the loss (z with only last_state used)
            ref = torch.zeros_like(fused[name], dtype=torch.float64)
        assert got is not None and got.dtype == fused[name].dtype, f"d{name} dtype (seed={seed})"
        check_close("d" + name, got, ref, seed, rtol, atol, rel_rms)
    for name in ("D", "z", "delta_bias"):
        if t[name] is None:
            assert name not in grads


# ----------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("L", [1, 63, 130, 300])
@pytest.mark.parametrize("dim", [5, 200])
@pytest.mark.parametrize("N", [1, 16])
@pytest.mark.parametrize("all_options", [True, False], ids=["D-z-bias-softplus", "bare"])
def test_matches_reference(nan_empty, L, dim, N, all_options):
    flags = dict(D=all_options, z=all_options, bias=all_options, softplus=all_options)
    compare_to_reference(new_seed(), 2, dim, N, L, **flags)


@pytest.mark.parametrize("flags", [
    dict(D=True, z=False, bias=False, softplus=True),
    dict(D=False, z=True, bias=True, softplus=False),
    dict(D=True, z=True, bias=True, softplus=True, big_delta=True),
    dict(D=False, z=False, bias=False, softplus=True, big_delta=True),
], ids=["D-softplus", "z-bias", "big-delta", "big-delta-bare"])
def test_matches_reference_options(nan_empty, flags):
    compare_to_reference(new_seed(), 3, 37, 16, 150, **flags)


@pytest.mark.parametrize("work_items", [1, 5], ids=["one-group", "three-groups"])
def test_channel_block_groups(nan_empty, monkeypatch, work_items):
    """Backward work items that span several W-channel blocks, the last one partial:
    each item sums dB / dC over its blocks before the partials are reduced."""
    monkeypatch.setattr(cpu, "WORK_ITEMS", work_items)
    assert cpu._n_groups(2, 200) == (work_items + 1) // 2 < math.ceil(200 / cpu.W)
    compare_to_reference(new_seed(), 2, 200, 16, 130)


@pytest.mark.parametrize("use_dout,use_dlast", [(True, False), (False, True)],
                         ids=["out-only", "last-state-only"])
def test_gradient_through_one_output(nan_empty, use_dout, use_dlast):
    """Only one of (out, last_state) reaches the loss: the other gradient is None."""
    compare_to_reference(new_seed(), 2, 24, 16, 140, use_dout=use_dout, use_dlast=use_dlast)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(nan_empty, dtype):
    """Half inputs and outputs, float32 inside: close to the float64 reference run on
    the same (rounded) inputs, within half-precision output rounding."""
    rtol, atol = (4e-3, 1e-2) if dtype == torch.float16 else (2e-2, 5e-2)
    compare_to_reference(new_seed(), 2, 48, 16, 100, dtype=dtype, tol=(rtol, atol, rtol))


def test_mixed_precision_parameters(nan_empty):
    """bf16 activations with float32 A, D, delta_bias (as under autocast): grads keep
    each input's dtype."""
    seed = new_seed()
    t, kw = make_inputs(seed, 2, 16, 8, 70)
    activations = ("u", "delta", "B", "C", "z")
    t = {k: (v.to(torch.bfloat16) if k in activations else v) for k, v in t.items()}
    fused = leaves(t)
    out, _, grads = run(fused, kw, torch.randn(2, 16, 70, dtype=torch.float64), None, "cpu")
    assert out.dtype == torch.bfloat16
    for name, grad in grads.items():
        assert grad.dtype == t[name].dtype, f"d{name}: {grad.dtype} (seed={seed})"
        assert torch.isfinite(grad).all(), f"d{name} (seed={seed})"


@pytest.mark.parametrize("chunk", [64, 2], ids=["one-chunk", "chunk-2"])
def test_gradcheck_float64(monkeypatch, chunk):
    """Finite differences through the fused float64 backward, all options on. chunk=2
    makes the tiny sequence span several checkpoints (recompute + chunk boundaries)."""
    monkeypatch.setattr(cpu, "CHUNK", chunk)
    seed = new_seed()
    t, kw = make_inputs(seed, 2, 3, 2, 5, dtype=torch.float64)
    t = leaves(t)
    names = list(GRAD_NAMES)

    def f(*xs):
        out, last = selective_scan(**dict(zip(names, xs)), **kw, return_last_state=True,
                                   backend="cpu")
        return out, last

    inputs = tuple(t[k] for k in names)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5), f"seed={seed}"


# ----------------------------------------------------------------------------- properties

def assert_same_on_repeat_and_threads(seed, t, kw, runner):
    """runner(leaves, kw, dout, dlast, "cpu") -> (out, last, grads) gives bit-identical results
    twice with torch's thread count and once with one thread (batch 3, dim 200, N 16, L 300)."""
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(3, 200, 300, generator=g, dtype=torch.float64)
    dlast = torch.randn(3, 200, 16, generator=g, dtype=torch.float64)
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (max(threads, 2), max(threads, 2), 1):    # the parallel kernels, then their twins
            torch.set_num_threads(n_threads)
            results.append(runner(leaves(t), kw, dout, dlast, "cpu"))
    finally:
        torch.set_num_threads(threads)
    (out0, last0, g0) = results[0]
    for out, last, grads in results[1:]:
        assert torch.equal(out, out0) and torch.equal(last, last0), f"seed={seed}"
        for name in g0:
            assert torch.equal(grads[name], g0[name]), f"d{name} differs (seed={seed})"


def test_deterministic(nan_empty):
    """Bit-identical outputs and gradients on repeated calls, and for any thread count."""
    seed = new_seed()
    t, kw = make_inputs(seed, 3, 200, 16, 300)
    assert_same_on_repeat_and_threads(seed, t, kw, run)


def test_lanes_follow_the_machine_and_the_setting(monkeypatch):
    """The scan's lanes: two vector registers of float32 (32 with AVX-512, 16 otherwise), or
    SONATA_CPU_LANES; a value other than 16 or 32 is refused with a one-line reason (an
    ImportError: the dispatcher reports it as the reason of a fallback)."""
    expected = os.environ.get("SONATA_CPU_LANES") or ("32" if cpu_simd._vector_bits() == 512 else "16")
    assert cpu_simd.W == cpu.W == int(expected) and cpu_simd.WC == 16
    monkeypatch.setattr(cpu_simd, "LANES_OVERRIDE", "64")
    with pytest.raises(ImportError, match=r"SONATA_CPU_LANES='64': use 16 or 32"):
        cpu_simd._lanes_setting(16)


@pytest.mark.skipif(bool(os.environ.get("SONATA_CPU_LANES")), reason="already the child run")
def test_other_lane_width_matches_reference(tmp_path):
    """The scan kernels at the width this machine does not use by default (16 on an AVX-512
    host, 32 elsewhere), in a fresh process, on the model's path: the delta projection, u and
    the output's gradient time-major, 40 channels (a partial last block at either width),
    against the float64 reference. So both widths are checked on any machine (the whole file
    runs at the other width with SONATA_CPU_LANES set; one case here: it compiles the kernels
    again, about 40 s)."""
    other = "16" if cpu.W == 32 else "32"
    tests = "test_lanes_follow_the_machine_and_the_setting or test_delta_projection_matches_reference and model-like"
    env = {**os.environ, "SONATA_CPU_LANES": other, "NUMBA_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and re.search(r"\b2 passed", r.stdout), r.stdout[-3000:] + r.stderr[-2000:]


def test_saved_state_is_chunked():
    """The forward keeps one state per chunk, not the (batch, dim, L, N) states."""
    batch, dim, N, L = 2, 8, 16, 300
    t, kw = make_inputs(new_seed(), batch, dim, N, L)
    with torch.no_grad():
        _, _, saved = cpu.forward(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                  t["delta_bias"], kw["delta_softplus"])
    n_chunks = math.ceil(L / cpu.CHUNK)
    assert saved[0].shape == (batch, dim, n_chunks, N)
    assert sum(s.numel() for s in saved) <= batch * dim * N * n_chunks + 1      # + the chunk length


def test_dispatcher_does_not_fall_back():
    t, kw = make_inputs(new_seed(), 2, 8, 4, 20)
    before = fallback_count()
    for backend in ("cpu", "auto"):
        fused = leaves(t)
        out = selective_scan(**fused, **kw, backend=backend)
        out.sum().backward()
    assert fallback_count() == before


def as_time_major(t, pad=0):
    """The same values as a (batch, X, L) view of (batch, L, X + pad) memory: the layout of the
    model's activations (pad > 0: a slice of a wider projection output, like B and C)."""
    b, x, L = t.shape
    wide = torch.full((b, L, x + pad), float("nan"), dtype=t.dtype)
    wide[..., :x] = t.transpose(1, 2)
    return wide[..., :x].transpose(1, 2)


def test_time_major_strided_inputs(nan_empty):
    """Inputs and the output's gradient in the model's (batch, L, channels) layout, B and C as
    slices of a wider tensor: bit for bit the outputs and gradients of contiguous inputs (the
    layouts change only the copies into the kernels' lane buffers, never an operation on a
    value). The output and du come back in the model's layout either way (transposed views of
    C-contiguous (batch, L, dim) tensors: no copy for the projections)."""
    seed = new_seed()
    batch, dim, N, L = 3, 40, 16, 70
    t, kw = make_inputs(seed, batch, dim, N, L)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(batch, dim, L, generator=g, dtype=torch.float64)
    dlast = torch.randn(batch, dim, N, generator=g, dtype=torch.float64)
    out0, last0, g0 = run(leaves(t), kw, dout, dlast, "cpu")
    strided = {k: (as_time_major(v, pad=3 if k in ("B", "C") else 0).detach().requires_grad_()
                   if k in ("u", "delta", "z", "B", "C") else v.detach().clone().requires_grad_())
               for k, v in t.items()}
    out = selective_scan(**strided, **kw, return_last_state=True, backend="cpu")
    seen = []        # the layout of the output's gradient as it reaches the backward
    out[0].register_hook(lambda g: seen.append(g.transpose(1, 2).is_contiguous()))
    loss = (out[0].double() * as_time_major(dout)).sum() + (out[1].double() * dlast).sum()
    grads = torch.autograd.grad(loss, [strided[k] for k in GRAD_NAMES])
    assert seen == [True], "the output's gradient did not arrive time-major"
    assert torch.equal(out[0], out0) and torch.equal(out[1], last0), f"seed={seed}"
    for o in (out[0], out0, grads[0], g0["u"]):
        assert o.transpose(1, 2).is_contiguous() and not o.is_contiguous(), "not in the model's layout"
    for name, grad in zip(GRAD_NAMES, grads):
        assert torch.equal(grad, g0[name]), f"d{name} differs (seed={seed})"


# ----------------------------------------------------------------------------- delta projection

def proj_inputs(seed, batch, dim, N, L, R, dtype=torch.float64):
    """The model's call: dt, B, C as slices of one (batch, L, R + 2N) x_proj output (B, C as
    transposed views), the dt_proj weight (dim, R), and scan inputs with Mamba-like values.
    -> (tensors dict with `delta` = dt and `delta_proj`, kwargs)."""
    t, kw = make_inputs(seed, batch, dim, N, L, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 2)
    xdbl = torch.randn(batch, L, R + 2 * N, generator=g, dtype=torch.float64)
    dt, B, C = xdbl.to(dtype).split([R, N, N], dim=-1)
    t.update(delta=0.5 * dt, B=B.transpose(1, 2), C=C.transpose(1, 2),
             delta_proj=(torch.randn(dim, R, generator=g, dtype=torch.float64) * R ** -0.5).to(dtype))
    return t, kw


PROJ_NAMES = GRAD_NAMES + ("delta_proj",)


def run_proj(t, kw, dout, dlast, backend):
    """Forward and backward with the delta projection: (out, last_state, {name: grad})."""
    out, last = selective_scan(**t, **kw, return_last_state=True, backend=backend)
    loss = (out.double() * dout).sum() + (last.double() * dlast).sum()
    return out, last, dict(zip(PROJ_NAMES, torch.autograd.grad(loss, [t[k] for k in PROJ_NAMES])))


@pytest.mark.parametrize("shape", [(2, 40, 16, 130, 6), (3, 200, 4, 7, 3), (1, 5, 1, 1, 1),
                                   (2, 17, 16, 300, 2)],
                         ids=["model-like", "many-blocks", "one-step", "partial-block-chunks"])
def test_delta_projection_matches_reference(nan_empty, shape):
    """delta given as the model's low-rank dt (batch, L, R) and dt_proj's weight: the kernels
    form delta = dt @ W.T block by block and send its gradient back to dt and W. Against the
    float64 reference of the same composition (a matmul, then the scan): the outputs and every
    gradient, dt and W included, at the scan's float32 tolerances."""
    seed = new_seed()
    batch, dim, N, L, R = shape
    t, kw = proj_inputs(seed, batch, dim, N, L, R)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(batch, dim, L, generator=g, dtype=torch.float64)
    dlast = torch.randn(batch, dim, N, generator=g, dtype=torch.float64)
    out, last, grads = run_proj(leaves(t, torch.float32), kw, dout, dlast, "cpu")
    r_out, r_last, r_grads = run_proj(leaves(t), kw, dout, dlast, "reference")
    assert out.dtype == torch.float32 and grads["delta"].shape == (batch, L, R)
    check_close("out", out, r_out, seed, 1e-4, 2e-4, 2e-5)
    check_close("last_state", last, r_last, seed, 1e-4, 2e-4, 2e-5)
    for name in PROJ_NAMES:
        assert grads[name].dtype == torch.float32, f"d{name} dtype (seed={seed})"
        check_close("d" + name, grads[name], r_grads[name], seed, 1e-4, 2e-4, 2e-5)


@pytest.mark.parametrize("chunk", [64, 2], ids=["one-chunk", "chunk-2"])
def test_delta_projection_gradcheck_float64(monkeypatch, chunk):
    """Finite differences through the fused float64 backward with the delta projection."""
    monkeypatch.setattr(cpu, "CHUNK", chunk)
    seed = new_seed()
    t, kw = proj_inputs(seed, 2, 3, 2, 5, 2)
    t = {k: v.detach().clone().requires_grad_() for k, v in t.items()}   # B, C: own leaves

    def f(*xs):
        return selective_scan(**dict(zip(PROJ_NAMES, xs)), **kw, return_last_state=True,
                              backend="cpu")

    assert torch.autograd.gradcheck(f, tuple(t[k] for k in PROJ_NAMES), eps=1e-6, atol=1e-6,
                                    rtol=1e-5), f"seed={seed}"


def test_delta_projection_deterministic(nan_empty):
    """Bit-identical outputs and gradients (dt's and W's sums over channels and batch
    included) on repeated calls and for any thread count; the reference backend gets the
    same composition as a matmul."""
    seed = new_seed()
    t, kw = proj_inputs(seed, 3, 200, 16, 300, 6, dtype=torch.float32)
    assert_same_on_repeat_and_threads(seed, t, kw, run_proj)
    with torch.no_grad():      # delta_proj on the reference: the projection written independently
        t64 = {k: (v.double() if v is not None else None) for k, v in t.items()}
        delta = torch.einsum("blr,dr->bdl", t64["delta"], t64["delta_proj"])
        composed = selective_scan(t64["u"], delta, t64["A"], t64["B"], t64["C"], t64["D"], t64["z"],
                                  t64["delta_bias"], backend="reference", **kw)
        via_arg = selective_scan(**t64, **kw, backend="reference")
    assert (via_arg - composed).abs().max().item() < 1e-10, f"seed={seed}"
