"""The fused layer ops' numba CPU kernels (sonata/kernels/layers/: conv + SiLU, Mamba-2's conv over
x, B, C, RMSNorm, the gated RMSNorm, the cross-entropy loss) against their float64 references.

Inputs are fresh random draws every run. Each test draws its seed from the OS and
puts it in every assertion message; set SONATA_TEST_SEED=<seed> to replay a failure.
"""
from __future__ import annotations

import pytest
import torch

import cpu_helpers
from cpu_helpers import check_close, new_seed
from sonata.kernels import (causal_conv_silu, conv_silu, conv_silu_ref, cross_entropy,  # noqa: E402
                            cross_entropy_ref, fallback_count, rms_norm, rms_norm_gated, rms_norm_gated_ref)

nan_empty = cpu_helpers.nan_empty           # the fixture


# ----------------------------------------------------------------------------- conv + SiLU

def conv_inputs(seed, batch, L, dim, K, bias, dtype=torch.float64):
    """xz as the model passes it: a (batch, L, 2 dim) projection, conv input then gate."""
    g = torch.Generator().manual_seed(seed)
    xz = torch.randn(batch, L, 2 * dim, generator=g, dtype=dtype)
    w = torch.randn(dim, 1, K, generator=g, dtype=dtype) * 0.7
    b = torch.randn(dim, generator=g, dtype=dtype) if bias else None
    dout = torch.randn(batch, L, 2 * dim, generator=g, dtype=torch.float64)   # for u, then z
    return xz, w, b, dout


def conv_run(xz, w, b, dout, backend, dtype, du_layout="model"):
    """-> (u, z, dxz, dweight, dbias or None). u's gradient reaches the backward in the model's
    (batch, L, dim) layout, or as a C-contiguous (batch, dim, L) tensor with du_layout="scan"."""
    dim = w.shape[0]
    xz_, w_ = xz.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    b_ = None if b is None else b.detach().to(dtype).requires_grad_()
    u, z = conv_silu(xz_, w_, b_, backend=backend)
    leaves_ = [xz_, w_] + ([] if b is None else [b_])
    du = dout[..., :dim] if du_layout == "model" else dout[..., :dim].transpose(1, 2).contiguous().transpose(1, 2)
    loss = (u.double() * du).sum() + (z.double() * dout[..., dim:]).sum()
    grads = torch.autograd.grad(loss, leaves_)
    return (u, z, *grads) + (() if b is not None else (None,))


CONV_NAMES = ("u", "z", "dxz", "dweight", "dbias")


@pytest.mark.parametrize("shape", [(3, 70, 40, 4, True), (2, 2, 17, 4, True), (1, 1, 5, 3, False),
                                   (2, 9, 33, 1, True), (2, 5, 16, 6, True)],
                         ids=["K4", "L<K", "L1-no-bias", "K1", "K6"])
def test_conv_silu_matches_reference(nan_empty, shape):
    """The fused depthwise conv + SiLU and gate split against the float64 reference: u, z and
    the gradients of the projection output (both halves), weight and bias, for the usual kernel
    (K = 4) and the general path (other K), sequences shorter than the kernel and channel
    counts that are not a multiple of W. u comes back C-contiguous in the model's (batch, L,
    dim) layout (read in place by x_proj and the scan), z in the scan's: a transposed view of a
    C-contiguous (batch, dim, L) tensor."""
    seed = new_seed()
    batch, L, dim, K, bias = shape
    xz, w, b, dout = conv_inputs(seed, batch, L, dim, K, bias)
    got = conv_run(xz, w, b, dout, "cpu", torch.float32)
    ref = conv_run(xz, w, b, dout, "reference", torch.float64)
    assert got[0].is_contiguous() and got[1].transpose(1, 2).is_contiguous(), f"seed={seed}"
    assert torch.equal(got[1].double(), ref[1].float().double()), f"z is a copy (seed={seed})"
    for label, g_, r_ in zip(CONV_NAMES, got, ref):
        if r_ is None:
            assert g_ is None, label
            continue
        assert g_.dtype == torch.float32, label
        check_close(label, g_, r_, seed, 1e-4, 2e-5, 2e-5)
    exact = conv_run(xz, w, b, dout, "cpu", torch.float64)       # float64 kernels: to rounding
    for label, g_, r_ in zip(CONV_NAMES, exact, ref):
        if r_ is not None:
            check_close(label + " (float64)", g_, r_, seed, 1e-12, 1e-12, 1e-12)


@pytest.mark.parametrize("K", [4, 3])
def test_conv_silu_gradcheck_float64(K):
    """Finite differences through the fused float64 conv + SiLU and gate backward."""
    seed = new_seed()
    xz, w, b, _ = conv_inputs(seed, 2, 6, 5, K, True)
    inputs = tuple(t.detach().requires_grad_() for t in (xz, w, b))
    assert torch.autograd.gradcheck(lambda x, w_, b_: conv_silu(x, w_, b_, backend="cpu"), inputs,
                                    eps=1e-6, atol=1e-6, rtol=1e-5), f"seed={seed}"


def test_conv_silu_deterministic(nan_empty):
    """Bit-identical output and gradients on repeated calls, for any thread count (the weight
    and bias gradients are per-sequence partials summed in batch order) and with u's gradient
    in either layout (read in place or from the scan's)."""
    seed = new_seed()
    xz, w, b, dout = conv_inputs(seed, 5, 130, 200, 4, True)
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (max(threads, 2), max(threads, 2), 1):    # the parallel kernels, then their twins
            torch.set_num_threads(n_threads)
            results.append(conv_run(xz, w, b, dout, "cpu", torch.float32))
        results.append(conv_run(xz, w, b, dout, "cpu", torch.float32, du_layout="scan"))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for label, a, b_ in zip(CONV_NAMES, results[0], other):
            assert torch.equal(a, b_), f"{label} differs (seed={seed})"


# ----------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("shape", [(3, 70, 96), (5, 33), (1, 1, 7)])
def test_rms_norm_matches_reference(nan_empty, shape):
    """The fused RMSNorm against the float64 reference: output, dx and dweight."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64)
    dout = torch.randn(*shape, generator=g, dtype=torch.float64)
    results = {}
    for name, dtype in (("cpu", torch.float32), ("reference", torch.float64)):
        x_, w_ = (t.detach().to(dtype).requires_grad_() for t in (x, w))
        out = rms_norm(x_, w_, 1e-5, backend=name)
        results[name] = (out, *torch.autograd.grad((out.double() * dout).sum(), [x_, w_]))
    for label, got, ref in zip(("out", "dx", "dweight"), results["cpu"], results["reference"]):
        assert got.dtype == torch.float32 and got.shape == ref.shape, label
        check_close(label, got, ref, seed, 1e-4, 2e-4, 2e-5)


# ----------------------------------------------------------------------------- Mamba-2: conv over x, B, C

def causal_conv_run(x, w, b, dout, backend, dtype):
    """-> (u, dx, dweight, dbias or None) of causal_conv_silu (cpu) or conv_silu_ref (reference)."""
    x_, w_ = x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    b_ = None if b is None else b.detach().to(dtype).requires_grad_()
    u = causal_conv_silu(x_, w_, b_, backend=backend) if backend == "cpu" else conv_silu_ref(x_, w_, b_)
    leaves_ = [x_, w_] + ([] if b is None else [b_])
    grads = torch.autograd.grad((u.double() * dout).sum(), leaves_)
    return (u, *grads) + (() if b is not None else (None,))


@pytest.mark.parametrize("shape", [(3, 70, 40, 24, 4, True), (2, 2, 33, 5, 4, True), (1, 1, 5, 1, 3, False),
                                   (2, 9, 50, 7, 6, True)],
                         ids=["K4", "L<K", "L1-no-bias", "K6"])
def test_causal_conv_silu_matches_reference(nan_empty, shape):
    """Mamba-2's convolution (the fused conv of conv_silu without the gate, over a slice of a
    wider projection as the block passes xBC: no equal-width gate beside it) against the
    float64 reference: u and the gradients of the input slice, weight and bias; channel counts
    not a multiple of the lane width; float64 kernels to rounding."""
    seed = new_seed()
    batch, L, dim, extra, K, bias = shape
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(batch, L, extra + dim + 3, generator=g, dtype=torch.float64)
    x = proj[..., extra:extra + dim]                                   # a strided slice, as xBC is
    w = torch.randn(dim, 1, K, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(dim, generator=g, dtype=torch.float64) if bias else None
    dout = torch.randn(batch, L, dim, generator=g, dtype=torch.float64)
    got = causal_conv_run(x, w, b, dout, "cpu", torch.float32)
    ref = causal_conv_run(x, w, b, dout, "reference", torch.float64)
    assert got[0].is_contiguous(), f"seed={seed}"
    for label, g_, r_ in zip(("u", "dx", "dweight", "dbias"), got, ref):
        if r_ is None:
            assert g_ is None, label
            continue
        assert g_.dtype == torch.float32, label
        check_close(label, g_, r_, seed, 1e-4, 2e-5, 2e-5)
    exact = causal_conv_run(x, w, b, dout, "cpu", torch.float64)
    for label, g_, r_ in zip(("u", "dx", "dweight", "dbias"), exact, ref):
        if r_ is not None:
            check_close(label + " (float64)", g_, r_, seed, 1e-12, 1e-12, 1e-12)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_causal_conv_silu_hands_on_float32_when_asked(backend):
    """out_dtype=float32 on bfloat16 input (the Mamba-2 block under autocast): the fused
    kernel's float32 result is the float32 convolution of the rounded input (the reference
    computes in bfloat16: within its rounding), the default bfloat16 output is its rounding,
    and the input's gradient comes back in bfloat16."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(2, 40, 3 + 30 + 5, generator=g).to(torch.bfloat16)
    x = proj[..., 3:33].detach().requires_grad_()
    w = (torch.randn(30, 1, 4, generator=g) * 0.5).to(torch.bfloat16)
    b = torch.randn(30, generator=g).to(torch.bfloat16)
    u32 = causal_conv_silu(x, w, b, backend=backend, out_dtype=torch.float32)
    assert u32.dtype == torch.float32, seed
    want = conv_silu_ref(x.detach().float(), w.float(), b.float())
    tol = 1e-5 if backend == "cpu" else 2e-2
    check_close("u", u32, want, seed, tol, tol, tol)
    u16 = causal_conv_silu(x, w, b, backend=backend)
    assert u16.dtype == torch.bfloat16 and torch.equal(u16, u32.to(torch.bfloat16)), seed
    (dx,) = torch.autograd.grad(u32.sum(), [x])
    assert dx.dtype == torch.bfloat16 and dx.shape == x.shape, seed


def test_causal_conv_silu_gradcheck_and_mamba1_path_unchanged():
    """Finite differences through the float64 kernel; and conv_silu (Mamba-1's gate-moving
    form of the same kernels) still equals its reference."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    inputs = tuple(t.requires_grad_() for t in (torch.randn(2, 6, 5, generator=g, dtype=torch.float64),
                                                torch.randn(5, 1, 4, generator=g, dtype=torch.float64),
                                                torch.randn(5, generator=g, dtype=torch.float64)))
    assert torch.autograd.gradcheck(lambda x, w_, b_: causal_conv_silu(x, w_, b_, backend="cpu"), inputs,
                                    eps=1e-6, atol=1e-6, rtol=1e-5), f"seed={seed}"
    xz, w, b, dout = conv_inputs(seed, 2, 20, 17, 4, True)
    for label, g_, r_ in zip(CONV_NAMES, conv_run(xz, w, b, dout, "cpu", torch.float64),
                             conv_run(xz, w, b, dout, "reference", torch.float64)):
        check_close(label, g_, r_, seed, 1e-12, 1e-12, 1e-12)


# ----------------------------------------------------------------------------- Mamba-2: gated RMSNorm

@pytest.mark.parametrize("before", [False, True], ids=["gate-first", "norm-first"])
@pytest.mark.parametrize("case", [(3, 70, 96, 96, True), (2, 33, 48, 16, True), (1, 1, 7, 7, True),
                                  (4, 9, 24, 8, False)],
                         ids=["one-group", "3-groups", "L1-d7", "no-z"])
def test_rms_norm_gated_matches_reference(nan_empty, case, before):
    """The fused gated, grouped RMSNorm against the float64 reference (rms_norm_gated_ref):
    output and the gradients of x, weight and z, for both orders of norm and gate, groups of
    the last dimension, no gate; z read in place from a wider projection (strided rows)."""
    seed = new_seed()
    rows, L, d, gs, has_z = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, L, d, generator=g, dtype=torch.float64) * 3
    proj = torch.randn(rows, L, d + 11, generator=g, dtype=torch.float64) * 2
    w = torch.randn(d, generator=g, dtype=torch.float64)
    dout = torch.randn(rows, L, d, generator=g, dtype=torch.float64)
    results = {}
    for name, dtype in (("cpu", torch.float32), ("cpu64", torch.float64), ("reference", torch.float64)):
        x_, w_ = (t.detach().to(dtype).requires_grad_() for t in (x, w))
        p_ = proj.detach().to(dtype).requires_grad_()
        z_ = p_[..., 5:5 + d] if has_z else None
        backend = "reference" if name == "reference" else "cpu"
        out = rms_norm_gated(x_, w_, z_, 1e-5, gs, before, backend=backend)
        leaves = [x_, w_] + ([p_] if has_z else [])
        results[name] = (out, *torch.autograd.grad((out.double() * dout).sum(), leaves))
    labels = ("out", "dx", "dweight", "dz")
    for label, got, ref in zip(labels, results["cpu"], results["reference"]):
        assert got.dtype == torch.float32 and got.shape == ref.shape, label
        check_close(label, got, ref, seed, 1e-4, 2e-4, 2e-5)
    for label, got, ref in zip(labels, results["cpu64"], results["reference"]):
        check_close(label + " (float64)", got, ref, seed, 1e-12, 1e-12, 1e-12)


def test_rms_norm_gated_bf16_and_bad_group():
    """bfloat16 in, bfloat16 out (float32 arithmetic, as the reference), equal to the reference
    within bfloat16 rounding; a group size that does not divide the channels is refused."""
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    x, z = (torch.randn(2, 5, 32, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(32, generator=g)
    got = rms_norm_gated(x, w, z, 1e-5, 16, False, backend="cpu")
    ref = rms_norm_gated_ref(x, w, z, 1e-5, 16, False)
    assert got.dtype == torch.bfloat16
    check_close("bf16 out", got, ref, seed, 2e-2, 2e-2, 1e-2)
    with pytest.raises(ValueError):
        rms_norm_gated(x, w, z, 1e-5, 5, False, backend="cpu")


# ----------------------------------------------------------------------------- cross-entropy

def ce_inputs(seed, shape, spread=3.0):
    """Logits (..., V) in float64 (spread: their standard deviation) and targets in [0, V)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g, dtype=torch.float64) * spread
    target = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return logits, target


def ce_run(logits, target, backend, dtype, dloss=0.7):
    """(loss, dlogits) of one backend for logits cast to dtype, with upstream gradient dloss."""
    x = logits.detach().to(dtype).requires_grad_()
    loss = cross_entropy(x, target, backend=backend)
    loss.backward(torch.tensor(dloss, dtype=loss.dtype))
    return loss, x.grad


@pytest.mark.parametrize("shape,spread", [((3, 70, 512), 3.0), ((2, 33, 17), 30.0), ((5, 16), 3.0),
                                          ((1, 1), 3.0), ((4, 1), 3.0)],
                         ids=["model-like", "wide-logits", "one-lane-block", "one-row", "one-class"])
def test_cross_entropy_matches_reference(nan_empty, shape, spread):
    """The fused loss against the float64 reference: the mean loss and dlogits, for an upstream
    gradient other than 1, from a single class to the model's vocabulary (V not a multiple of
    the kernel's 16 lanes too), logits spread wide enough that the row maximum matters."""
    seed = new_seed()
    logits, target = ce_inputs(seed, shape, spread)
    got = ce_run(logits, target, "cpu", torch.float32)
    ref = ce_run(logits, target, "reference", torch.float64)
    for label, g, r in zip(("loss", "dlogits"), got, ref):
        assert g.dtype == torch.float32, label
        check_close(label, g, r, seed, 1e-4, 2e-4, 2e-5)
    assert got[0].shape == ()


def test_cross_entropy_gradcheck_float64():
    logits, target = ce_inputs(new_seed(), (3, 7, 21))
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a: cross_entropy(a, target, backend="cpu"), (x,))


def test_cross_entropy_deterministic(nan_empty):
    """Bit-identical loss and gradient on repeated calls and for any thread count."""
    seed = new_seed()
    logits, target = ce_inputs(seed, (8, 128, 512))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (max(threads, 2), max(threads, 2), 1):
            torch.set_num_threads(n)
            results.append(ce_run(logits, target, "cpu", torch.float32))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for label, a, b_ in zip(("loss", "dlogits"), results[0], other):
            assert torch.equal(a, b_), f"{label} differs (seed={seed})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cross_entropy_half_precision(dtype):
    """Half logits: float32 arithmetic inside, the loss and dlogits in the logits' dtype."""
    seed = new_seed()
    logits, target = ce_inputs(seed, (2, 40, 64))
    loss, grad = ce_run(logits, target, "cpu", dtype)
    ref_loss, ref_grad = ce_run(logits.to(dtype).double(), target, "reference", torch.float64)
    assert loss.dtype == dtype and grad.dtype == dtype
    check_close("loss", loss, ref_loss, seed, 1e-2, 1e-2, 1e-2)
    check_close("dlogits", grad, ref_grad, seed, 1e-2, 1e-2, 1e-2)


@pytest.mark.parametrize("bad", [512, -1])
def test_cross_entropy_target_out_of_range(bad):
    """A target outside [0, V) is an IndexError that says so, as PyTorch's loss raises one, not
    a read outside the row."""
    logits, target = ce_inputs(new_seed(), (2, 10, 512))
    target[1, 3] = bad
    with pytest.raises(IndexError, match=r"out of range: targets must lie in \[0, 512\)"):
        cross_entropy(logits.float(), target, backend="cpu")
    with pytest.raises(IndexError):
        cross_entropy_ref(logits.reshape(-1, 512), target.reshape(-1))


def test_cross_entropy_nan_logit_gives_nan():
    """A NaN logit makes the loss NaN (as in the reference), not a finite number that skipped it."""
    logits, target = ce_inputs(new_seed(), (4, 33))
    logits[2, 5] = float("nan")
    assert torch.isnan(cross_entropy(logits.float(), target, backend="cpu"))
    assert torch.isnan(cross_entropy(logits, target, backend="reference"))


def test_cross_entropy_dispatch():
    """`cpu` and `auto` run the fused loss on CPU tensors without a fallback; `reference` is
    PyTorch's loss exactly."""
    logits, target = ce_inputs(new_seed(), (2, 9, 40))
    before = fallback_count()
    for backend in ("cpu", "auto"):
        loss = cross_entropy(logits.float().requires_grad_(), target, backend=backend)
        assert loss.grad_fn is not None and "sonata_cross_entropy" in type(loss.grad_fn).__name__
    assert fallback_count() == before
    x = logits.double().reshape(-1, 40)             # the mean of logsumexp minus the target's logit
    want = (torch.logsumexp(x, -1) - x.gather(1, target.reshape(-1, 1))[:, 0]).mean()
    assert cross_entropy(x, target.reshape(-1), backend="reference").item() == pytest.approx(want.item(), abs=1e-12)


def test_cross_entropy_large_logits_anywhere(nan_empty):
    """A logit of 500 (exp overflows float32 from 88.7) at every column in turn, the lane blocks'
    and the tail's: the row maximum finds it wherever it is, and the loss and gradient stay
    finite and right."""
    seed = new_seed()
    V = 37
    logits = torch.randn(V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    logits += 500.0 * torch.eye(V, dtype=torch.float64)
    target = torch.arange(V).roll(1)                     # never the large logit: loss about 500
    got = ce_run(logits, target, "cpu", torch.float32)
    ref = ce_run(logits, target, "reference", torch.float64)
    for label, g, r in zip(("loss", "dlogits"), got, ref):
        check_close(label, g, r, seed, 1e-4, 2e-4, 2e-5)
