"""The Triton selective-scan kernels against the float64 reference.

Two kinds of case, chosen by the `device` of each test:

* "cpu": small odd sizes on CPU tensors under the Triton interpreter
  (TRITON_INTERPRET=1). Always runs where the kernels were imported in
  interpreter mode; this file switches the interpreter on for itself when no GPU
  is present (see below).
* "cuda" -- the GPU-size tests: larger shapes (batch 8, d_inner up to 1536,
  L up to 1000) run by the compiled kernels. They run only when CUDA is present
  and the interpreter is off, i.e. `pytest tests/kernels/test_kernels_triton.py` on a GPU
  machine; there the "cpu" cases skip (a process cannot both compile and
  interpret the same kernels). Run `TRITON_INTERPRET=1 pytest ...` on the GPU
  machine for the interpreter cases instead.

Interpreter mode is fixed when `triton` is imported (triton.language's own jit
functions are decorated then) and when `sonata.kernels.selective.triton` is imported. So,
without a GPU and with TRITON_INTERPRET unset, this module sets it before importing
either, and sets it again around its own tests only: other test modules keep the
environment they started with. If triton was already imported in compiled mode by
an earlier module of the same pytest process, the "cpu" cases cannot run in this
process: they skip, and `test_interpreter_suite_in_subprocess` re-runs this file
in a fresh interpreter-mode process instead.

Every random case draws a fresh seed (reproduce one with SONATA_TEST_SEED=<seed>);
each failure message names it.
"""
from __future__ import annotations

import functools
import importlib
import os
import random
import subprocess
import sys
import types

import pytest  # noqa: E402
import torch  # noqa: E402

CUDA = torch.cuda.is_available()
_set_interpreter = "TRITON_INTERPRET" not in os.environ and not CUDA
if _set_interpreter:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    tri = importlib.import_module("sonata.kernels.selective.triton")
finally:
    if _set_interpreter:
        del os.environ["TRITON_INTERPRET"]

import sonata.kernels as kernels  # noqa: E402
from sonata.kernels.selective.autograd import fused_scan  # noqa: E402
from sonata.kernels.selective.reference import selective_scan_ref  # noqa: E402

# Interpreted end to end: our kernels and triton.language's own jit functions.
INTERPRETED = (not isinstance(tri._scan_fwd_kernel, triton.runtime.JITFunction)
               and not isinstance(triton.language.zeros, triton.runtime.JITFunction))


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    """TRITON_INTERPRET=1 while this module's tests run (the dispatcher reads it per call)."""
    if not INTERPRETED:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output and partial starts as NaN, so an unwritten element cannot pass."""
    monkeypatch.setattr(tri, "POISON_OUTPUTS", True)


def need(device: str) -> torch.device:
    if device == "cpu" and not INTERPRETED:
        pytest.skip("triton / sonata.kernels.selective.triton were imported in compiled mode earlier in "
                    "this process; CPU tensors need TRITON_INTERPRET=1 before those imports")
    if device == "cuda":
        if not CUDA:
            pytest.skip("CUDA (GPU-size) case: needs a GPU")
        if INTERPRETED:
            pytest.skip("CUDA (GPU-size) case: needs the compiled kernels (TRITON_INTERPRET unset)")
    return torch.device(device)


def fresh_seed() -> int:
    env = os.environ.get("SONATA_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


# --------------------------------------------------------------------------- inputs and comparison

FLAGS = {  # name: (has D, has z, has delta_bias, softplus)
    "all": (True, True, True, True),
    "none": (False, False, False, False),
    "D": (True, False, False, False),
    "z": (False, True, False, False),
    "bias_softplus": (False, False, True, True),
    "softplus": (False, False, False, True),
    "D_z": (True, True, False, False),
}
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def make_inputs(batch, d_inner, N, L, flags, seed, dtype=torch.float32, device="cpu"):
    """Mamba-like inputs: decays in (0, 1), dt ~ 0.001..1 after softplus."""
    has_D, has_z, has_bias, softplus = FLAGS[flags]
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift

    u = rn(batch, d_inner, L)
    if softplus:
        delta = rn(batch, d_inner, L, scale=0.5, shift=-1.0 if not has_bias else 0.0)
    else:
        delta = torch.rand(batch, d_inner, L, generator=g, dtype=torch.float64) * 0.5 + 0.01
    A = -torch.exp(rn(d_inner, N, scale=0.5))
    B, C = rn(batch, N, L), rn(batch, N, L)
    D = rn(d_inner) if has_D else None
    z = rn(batch, d_inner, L) if has_z else None
    bias = rn(d_inner, scale=0.5, shift=-1.0) if has_bias else None
    ts = (u, delta, A, B, C, D, z, bias)
    return [None if t is None else t.to(device=device, dtype=dtype) for t in ts], softplus


def run_scan(scan, inputs, softplus, gout, glast):
    """Forward, then gradients of <out, gout> + <last_state, glast> (None: that output unused)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    out, last = scan(*leaves, delta_softplus=softplus)
    loss = (out.double() * gout).sum() if gout is not None else 0.0
    if glast is not None:
        loss = loss + (last.double() * glast).sum()
    wrt = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, wrt, allow_unused=True, materialize_grads=True))
    return out.detach(), last.detach(), [None if t is None else next(grads) for t in leaves]


def triton_scan(*args, delta_softplus):
    return kernels.selective_scan(*args, delta_softplus=delta_softplus, return_last_state=True,
                                  backend="triton")


def ref_scan(*args, delta_softplus):
    return selective_scan_ref(*args, delta_softplus=delta_softplus, return_last_state=True)


def check_close(name, got, want, msg, dtype, rms, rtol, atol):
    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}; {msg}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected " \
        f"{tuple(want.shape)}; {msg}"
    assert torch.isfinite(got).all(), f"{name}: NaN/Inf in the result; {msg}"
    g, w = got.double().cpu(), want.double().cpu()
    err = (g - w).norm() / w.norm().clamp_min(1e-30)
    assert err <= rms, f"{name}: relative RMS error {err:.2e} > {rms:.0e}; {msg}"
    worst = ((g - w).abs() - rtol * w.abs()).max()
    assert torch.allclose(g, w, rtol=rtol, atol=atol), (
        f"{name}: not allclose (rtol {rtol}, atol {atol}; worst excess {worst:.2e}); {msg}")


def compare(inputs, softplus, seed, *, with_last=True, scan=triton_scan,
            rms=1e-5, rtol=6e-4, atol=2e-3, label=""):
    """The fused scan vs the float64 reference on the same (rounded) inputs."""
    device = inputs[0].device
    batch, d_inner, L = inputs[0].shape
    N = inputs[2].shape[1]
    g = torch.Generator().manual_seed(seed + 1)
    # dout arrives in out's dtype: round it so the reference sees the same cotangent
    gout = torch.randn(batch, d_inner, L, generator=g).to(device, inputs[0].dtype).double()
    glast = (torch.randn(batch, d_inner, N, generator=g, dtype=torch.float64).to(device)
             if with_last else None)
    out, last, grads = run_scan(scan, inputs, softplus, gout, glast)
    ref64 = [None if t is None else t.double() for t in inputs]
    r_out, r_last, r_grads = run_scan(ref_scan, ref64, softplus, gout, glast)

    msg = f"seed={seed} {label}"
    u = inputs[0]
    acc = torch.float64 if u.dtype == torch.float64 else torch.float32
    check_close("out", out, r_out, msg, u.dtype, rms, rtol, atol)
    check_close("last_state", last, r_last, msg, acc, rms, rtol, atol)
    for name, t, gt, gr in zip(NAMES, inputs, grads, r_grads):
        if t is None:
            assert gt is None
            continue
        check_close("d" + name, gt, gr, msg, t.dtype, rms, rtol, atol)
    return out, last, grads


# --------------------------------------------------------------------------- cases

# (batch, d_inner, N, L, flags, dlast used)
CPU_CASES = [
    (2, 5, 16, 63, "all", True),
    (2, 37, 1, 130, "all", True),
    (1, 200, 16, 130, "none", True),
    (2, 37, 16, 1, "D", True),
    (1, 5, 16, 300, "bias_softplus", False),
    (2, 37, 16, 63, "z", True),
    (1, 37, 3, 64, "softplus", True),
    (1, 5, 1, 1, "all", False),
]
GPU_CASES = [  # the GPU-size tests
    (8, 192, 16, 128, "all", True),
    (8, 1536, 16, 1000, "all", True),
    (8, 200, 16, 300, "none", True),
    (4, 1536, 16, 1000, "D_z", False),
    (3, 37, 64, 257, "bias_softplus", True),
    (2, 100, 1, 63, "all", True),
]
SIZE_CASES = [pytest.param(dev, *c, id=f"{dev}-{c[0]}x{c[1]}x{c[2]}x{c[3]}-{c[4]}")
              for dev, cases in (("cpu", CPU_CASES), ("cuda", GPU_CASES)) for c in cases]


@pytest.mark.parametrize("device,batch,d_inner,N,L,flags,with_last", SIZE_CASES)
def test_matches_reference_fp32(device, batch, d_inner, N, L, flags, with_last):
    dev = need(device)
    seed = fresh_seed()
    inputs, softplus = make_inputs(batch, d_inner, N, L, flags, seed, device=dev)
    compare(inputs, softplus, seed, with_last=with_last,
            label=f"{device} {batch}x{d_inner}x{N}x{L} {flags}")


def _fixed_config_impl(block_d, chunk_l):
    """The triton module with its tile sizes forced (forward and backward must agree)."""
    return types.SimpleNamespace(
        forward=functools.partial(tri.forward, block_d=block_d, chunk_l=chunk_l),
        backward=functools.partial(tri.backward, block_d=block_d, chunk_l=chunk_l))


@pytest.mark.parametrize("device,batch,d_inner,N,L,block_d,chunk_l", [
    pytest.param("cpu", 1, 13, 16, 23, 4, 4, id="cpu-4blocks-6chunks"),
    pytest.param("cpu", 2, 9, 5, 16, 8, 16, id="cpu-tail-block-one-full-chunk"),
    pytest.param("cuda", 8, 1536, 16, 1000, 64, 16, id="cuda-block64-chunk16"),
    pytest.param("cuda", 8, 1531, 16, 999, 4, 256, id="cuda-block4-chunk256"),
])
def test_forced_tiles(device, batch, d_inner, N, L, block_d, chunk_l):
    """Several channel blocks (partials summed across blocks) and several chunks (checkpoints)."""
    dev = need(device)
    seed = fresh_seed()
    inputs, softplus = make_inputs(batch, d_inner, N, L, "all", seed, device=dev)
    impl = _fixed_config_impl(block_d, chunk_l)

    def scan(*args, delta_softplus):
        return fused_scan(impl, *args, delta_softplus=delta_softplus)

    compare(inputs, softplus, seed, scan=scan, label=f"block_d={block_d} chunk_l={chunk_l}")


@pytest.mark.parametrize("device,shape", [
    pytest.param("cpu", (2, 37, 16, 63), id="cpu"),
    pytest.param("cuda", (8, 192, 16, 128), id="cuda"),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(device, shape, dtype):
    """Half inputs: outputs and gradients keep their dtypes and match the float64 scan of
    the same rounded inputs up to half-precision rounding of the results."""
    dev = need(device)
    seed = fresh_seed()
    inputs, softplus = make_inputs(*shape, "all", seed, dtype=dtype, device=dev)
    # one rounding of each result to half precision (fp16 2^-11, bf16 2^-8 relative at worst)
    tol = dict(rms=1.5e-3, rtol=2e-3, atol=1e-3) if dtype == torch.float16 else \
        dict(rms=1e-2, rtol=1e-2, atol=1e-2)
    compare(inputs, softplus, seed, label=str(dtype), **tol)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float64_gradcheck(device):
    """float64 in, float64 arithmetic inside: the analytic backward passes gradcheck."""
    dev = need(device)
    seed = fresh_seed()
    inputs, softplus = make_inputs(1, 3, 2, 5, "all", seed, dtype=torch.float64, device=dev)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def f(*ts):
        return triton_scan(*ts, delta_softplus=softplus)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5), f"seed={seed}"
    compare(inputs, softplus, seed, rms=1e-12, rtol=1e-10, atol=1e-10, label="float64")


@pytest.mark.parametrize("device,shape", [
    pytest.param("cpu", (2, 37, 16, 40), id="cpu"),
    pytest.param("cuda", (8, 1536, 16, 1000), id="cuda"),
])
def test_deterministic(device, shape):
    """Same inputs, bit-identical outputs and gradients (no atomics anywhere)."""
    dev = need(device)
    seed = fresh_seed()
    inputs, softplus = make_inputs(*shape, "all", seed, device=dev)
    g = torch.Generator().manual_seed(seed + 1)
    gout = torch.randn(*shape[:2], shape[3], generator=g, dtype=torch.float64).to(dev)
    glast = torch.randn(*shape[:3], generator=g, dtype=torch.float64).to(dev)
    first = run_scan(triton_scan, inputs, softplus, gout, glast)
    second = run_scan(triton_scan, inputs, softplus, gout, glast)
    a = [first[0], first[1], *[t for t in first[2] if t is not None]]
    b = [second[0], second[1], *[t for t in second[2] if t is not None]]
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"two identical calls differ; seed={seed}"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_fallback(device):
    """backend="triton" runs the kernels (and "auto" on CUDA picks them): the counter stays put."""
    dev = need(device)
    inputs, softplus = make_inputs(1, 5, 4, 7, "all", fresh_seed(), device=dev)
    before = kernels.fallback_count()
    assert kernels.resolve_backend("triton", inputs[0]) == ("triton", None)
    kernels.selective_scan(*inputs, delta_softplus=softplus, backend="triton")
    if dev.type == "cuda":
        kernels.selective_scan(*inputs, delta_softplus=softplus, backend="auto")
    assert kernels.fallback_count() == before


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_checkpoints_not_full_states(device):
    """The saved tensors are one state per chunk, never (batch, d_inner, L, N)."""
    dev = need(device)
    batch, d_inner, N, L = 2, 5, 4, 100
    inputs, softplus = make_inputs(batch, d_inner, N, L, "all", fresh_seed(), device=dev)
    out, last, saved = tri.forward(*inputs, softplus)
    cfg = tri.launch_config(batch, d_inner, N, L, dev)
    assert cfg.chunk_l > 1
    assert [tuple(t.shape) for t in saved] == [(batch, d_inner, triton.cdiv(L, cfg.chunk_l), N)]
    assert sum(t.numel() for t in saved) < batch * d_inner * L * N / 4


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_extreme_values_stay_finite(device):
    """Large |delta| (softplus threshold both ways), large |z|, a padded channel tail: no NaN."""
    dev = need(device)
    seed = fresh_seed()
    inputs, _ = make_inputs(2, 7, 3, 20, "all", seed, device=dev)
    u, delta, A, B, C, D, z, bias = inputs
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(delta.shape, generator=g) < 0.5, -1.0, 1.0).to(dev)
    delta = sign * (30.0 + 20 * torch.rand(delta.shape, generator=g).to(dev))
    z = z * 40.0
    compare([u, delta, A, B, C, D, z, bias], True, seed, label="extreme")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_non_contiguous_and_unused_outputs(device):
    """B, C as transposed views (as x_proj produces them); only `out` used (dlast None)."""
    dev = need(device)
    seed = fresh_seed()
    inputs, softplus = make_inputs(2, 6, 4, 11, "all", seed, device=dev)
    inputs[3] = inputs[3].transpose(1, 2).contiguous().transpose(1, 2)
    inputs[4] = inputs[4].transpose(1, 2).contiguous().transpose(1, 2)
    assert not inputs[3].is_contiguous()
    compare(inputs, softplus, seed, with_last=False, label="non-contiguous")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_only_last_state_used(device):
    """Gradient through last_state alone: the kernel gets dout None."""
    dev = need(device)
    seed = fresh_seed()
    inputs, softplus = make_inputs(2, 6, 4, 19, "all", seed, device=dev)
    glast = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64).to(dev)
    _, last, grads = run_scan(triton_scan, inputs, softplus, None, glast)
    _, r_last, r_grads = run_scan(ref_scan, [t.double() for t in inputs], softplus, None, glast)
    msg = f"seed={seed} last_state only"
    check_close("last_state", last, r_last, msg, torch.float32, 1e-5, 6e-4, 2e-3)
    for name, t, gt, gr in zip(NAMES, inputs, grads, r_grads):
        check_close("d" + name, gt, gr, msg, t.dtype, 1e-5, 6e-4, 2e-3)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_empty_sequence(device):
    """L == 0: empty output, zero state, zero parameter gradients."""
    dev = need(device)
    inputs, softplus = make_inputs(2, 5, 4, 0, "all", 0, device=dev)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, last = triton_scan(*leaves, delta_softplus=softplus)
    assert out.shape == (2, 5, 0) and torch.equal(last, torch.zeros_like(last))
    (last.sum() + out.sum()).backward()
    for name, t in zip(NAMES, leaves):
        assert torch.equal(t.grad, torch.zeros_like(t)), name


@pytest.mark.skipif(INTERPRETED or CUDA, reason="not needed: the interpreter cases run in this "
                    "process, or a GPU is present (then they run with TRITON_INTERPRET=1)")
def test_interpreter_suite_in_subprocess():
    """Without a GPU, when triton was imported in compiled mode before this module
    (by another test module), run this file's interpreter cases in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.abspath(__file__)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
