"""The Triton SSD (Mamba-2) kernels against the float64 sequential recurrence.

Every case runs at small, deliberately odd sizes, on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1), or compiled on CUDA tensors where a GPU is present and the interpreter
is off (`benchmarks/gpu_check.sh` runs this file so): L 1, 63, 65, 300 (a last partial
chunk), chunk 16..64, one that is not a power of two and one above MAX_CHUNK (256, run as
64-step chunks), groups 1 and 2, head dims 4..32 (padded to the tile), with and without
initial state, z, D of either shape, dt_bias / softplus, dt_limit and seq_idx (packed
sequences, including a sequence id that comes back). The output, the final state and every
gradient are compared with `ssd_recurrent_ref` in float64 on the same (rounded) inputs (on
the CPU), by relative RMS; every buffer the wrapper allocates starts as NaN.

Under the interpreter these tests say nothing about a GPU, and no GPU has run this file
compiled yet (sonata.kernels.GPU_VERIFIED, docs/kernels.md's table).

The log-decay gradients (dA, ddt_bias) are also held to the CPU recurrence's own float32 error
on the same inputs (`test_log_decay_gradients_as_close_as_the_cpu_recurrence`).

Interpreter mode is fixed when `triton` is imported. Without a GPU and with
TRITON_INTERPRET unset, this module sets it before importing triton and the kernels (the
conftest normally has already). If triton was imported compiled earlier in the same
process and there is no GPU, the cases skip and `test_interpreter_suite_in_subprocess` re-runs
this file in a fresh interpreter-mode process.

Each random case draws a fresh seed (reproduce one with SONATA_TEST_SEED=<seed>); every
failure message names it. The precision test's seeds are fixed (its bound is a statistic).
"""
from __future__ import annotations

import importlib
import math
import os
import random
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
_set_interpreter = "TRITON_INTERPRET" not in os.environ and not CUDA
if _set_interpreter:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    tri = importlib.import_module("sonata.kernels.ssd.triton")
finally:
    if _set_interpreter:
        del os.environ["TRITON_INTERPRET"]

from sonata.kernels.ssd.reference import ssd_recurrent_ref

INTERPRETED = tri.INTERPRETED and not isinstance(triton.language.zeros, triton.runtime.JITFunction)
# Where the kernels run: CPU tensors in the interpreter, else CUDA tensors compiled.
DEVICE = "cpu" if INTERPRETED else "cuda"
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    if not INTERPRETED:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output and intermediate starts as NaN, so an unwritten element cannot pass."""
    monkeypatch.setattr(tri, "POISON_OUTPUTS", True)


def need_interpreter():
    """Skip unless the kernels can run here: in the interpreter, or compiled on a GPU."""
    if not INTERPRETED and not CUDA:
        pytest.skip("triton / sonata.kernels.ssd.triton were imported in compiled mode earlier in "
                    "this process; CPU tensors need TRITON_INTERPRET=1 before those imports")


def fresh_seed() -> int:
    env = os.environ.get("SONATA_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


# --------------------------------------------------------------------------- inputs and comparison

def make_inputs(b, L, h, p, g, n, flags, seed, dtype=torch.float32):
    """Mamba-2-like inputs. flags: a set of "D", "Dp" (D of shape (h, p)), "z", "bias",
    "softplus", "init", "limit", "seq"."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift

    if "softplus" in flags:
        dt = rn(b, L, h, scale=0.5, shift=-1.0 if "bias" not in flags else -0.5)
    else:
        dt = torch.rand(b, L, h, generator=gen, dtype=torch.float64) * 0.5 + 0.01
    t = {"x": rn(b, L, h, p), "dt": dt, "A": -torch.exp(rn(h, scale=0.5)),
         "B": rn(b, L, g, n), "C": rn(b, L, g, n),
         "D": rn(h, p) if "Dp" in flags else rn(h) if "D" in flags else None,
         "z": rn(b, L, h, p) if "z" in flags else None,
         "dt_bias": rn(h, scale=0.5) if "bias" in flags else None,
         "initial_states": rn(b, h, p, n) if "init" in flags else None}
    t = {k: None if v is None else v.to(dtype) for k, v in t.items()}
    opts = {"dt_softplus": "softplus" in flags, "seq_idx": None,
            "dt_limit": (0.05, 0.6) if "limit" in flags else (0.0, math.inf)}
    if "seq" in flags:   # runs of ids; an id may come back ([.., 1, 2, 1, ..] is two resets)
        ids = torch.randint(0, 3, (b, L), generator=gen)
        keep = torch.rand(b, L, generator=gen) < 0.93
        for i in range(1, L):
            ids[:, i] = torch.where(keep[:, i], ids[:, i - 1], ids[:, i])
        opts["seq_idx"] = ids.to(torch.int32)
    return t, opts


def run_ssd(fn, inputs, opts, chunk, gout, gfinal, device="cpu", **kw):
    """out, final state and the gradients of <out, gout> + <final, gfinal> (final state
    not requested when gfinal is None), fn run on `device`, everything returned on the CPU."""
    leaves = {k: None if v is None else v.detach().to(device).clone().requires_grad_()
              for k, v in inputs.items()}
    opts = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    res = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
             D=leaves["D"], z=leaves["z"], dt_bias=leaves["dt_bias"],
             initial_states=leaves["initial_states"], return_final_states=gfinal is not None,
             **opts, **kw)
    out, final = res if gfinal is not None else (res, None)
    loss = (out.double() * gout.to(device)).sum()
    if gfinal is not None:
        loss = loss + (final.double() * gfinal.to(device)).sum()
    loss.backward()
    grads = {k: None if v is None else v.grad.cpu() for k, v in leaves.items()}
    return out.detach().cpu(), None if final is None else final.detach().cpu(), grads


def rel_rms(got, want) -> float:
    """|got - want| / |want| over all elements (relative RMS error), in float64."""
    g, w = got.double(), want.double()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


def check_close(name, got, want, dtype, rms, msg):
    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}; {msg}"
    assert got.shape == want.shape, \
        f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}; {msg}"
    assert torch.isfinite(got).all(), f"{name}: NaN/Inf in the result; {msg}"
    err = rel_rms(got, want)
    assert err <= rms, f"{name}: relative RMS error {err:.2e} > {rms:.0e}; {msg}"


# Sums over every step of every sequence (dA, dt_bias, and D of shape (h,)) cancel: their
# float32 error is that of the float32 reference itself (~1e-5), hence the looser bound.
REDUCED = ("A", "D", "dt_bias")


def compare(inputs, opts, chunk, seed, *, with_final=True, rms=1e-5, rms_reduced=1e-4,
            label="", **kw):
    x = inputs["x"]
    b, L, h, p = x.shape
    n = inputs["B"].shape[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    gout = torch.randn(b, L, h, p, generator=gen).to(x.dtype).double()   # rounded like dout
    gfinal = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64) if with_final else None
    out, final, grads = run_ssd(tri.ssd_triton, inputs, opts, chunk, gout, gfinal, DEVICE, **kw)
    ref64 = {k: None if v is None else v.double() for k, v in inputs.items()}
    r_out, r_final, r_grads = run_ssd(ssd_recurrent_ref, ref64, opts, chunk, gout, gfinal)
    msg = f"seed={seed} chunk={chunk} {label}"
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    check_close("out", out, r_out, x.dtype, rms, msg)
    if with_final:
        check_close("final_states", final, r_final, acc, rms, msg)
    for name in NAMES:
        if inputs[name] is None:
            assert grads[name] is None
            continue
        check_close("d" + name, grads[name], r_grads[name], inputs[name].dtype,
                    rms_reduced if name in REDUCED else rms, msg)
    return out, final, grads


# --------------------------------------------------------------------------- cases

ALL = {"Dp", "z", "bias", "softplus", "init", "limit", "seq"}
CASES = [  # (b, L, h, p, g, n, chunk, flags)
    (2, 1, 2, 4, 1, 4, 16, {"D", "z", "bias", "softplus", "init"}),
    (2, 63, 4, 8, 2, 16, 16, ALL),
    (1, 65, 2, 32, 1, 8, 32, set()),
    (2, 65, 4, 5, 2, 3, 64, {"D", "softplus", "seq"}),
    (1, 65, 2, 16, 2, 16, 24, {"z", "init", "limit"}),           # chunk not a power of two
    (1, 300, 2, 8, 1, 16, 256, ALL - {"Dp"} | {"D"}),          # runs as 64-step chunks
]


@pytest.mark.parametrize("b,L,h,p,g,n,chunk,flags", CASES,
                         ids=[f"L{c[1]}-h{c[2]}p{c[3]}g{c[4]}n{c[5]}-Q{c[6]}-"
                              + "_".join(sorted(c[7])) for c in CASES])
def test_matches_recurrence_fp32(b, L, h, p, g, n, chunk, flags):
    need_interpreter()
    seed = fresh_seed()
    inputs, opts = make_inputs(b, L, h, p, g, n, flags, seed)
    compare(inputs, opts, chunk, seed, label=f"{b}x{L}x{h}x{p} g={g} n={n} {sorted(flags)}")


# The log-decay gradients against the CPU recurrence's own float32 error on the same inputs.
# dA and ddt_bias sum d Loss / d a_k over every step; the backward chunk kernel once formed
# a_k's gradient with prefix sums and one reverse cumulative sum, which subtracts long sums
# that cancel in float32. Measured under the interpreter over 16 seeds (relative RMS error
# against the float64 oracle, the RMS over seeds; Triton before the fix / after / the CPU
# recurrence / the CPU chunked form):
#   L65  h2 p32 g1 n8  Q32               dA      2.0e-6 / 3.7e-7 / 5.3e-7 / 3.2e-6
#   L65  h4 p5  g2 n3  Q64  (seq)        dA      3.7e-6 / 2.3e-7 / 1.1e-7 / 1.5e-6
#   L300 h2 p8  g1 n16 Q256 (all flags)  dA      9.7e-6 / 8.6e-7 / 2.9e-7 / 1.1e-5
#                                        ddt_bias 1.4e-6 / 2.3e-7 / 2.6e-7 / 1.3e-6
# Per seed, Triton's error over the recurrence's: before the fix a median of 8x, 30x, 15x
# and 7x on these rows; after it 0.9-1.7x. Both are errors of a few float32 roundings,
# so a ratio varies from seed to seed: the bound is on the geometric mean of the ratio over
# six fixed seeds, which the fixed kernel kept at or under 2.4x in every six-seed window
# of the sixteen (the old one at 3.3x and over on these rows). Seeds 0-5: before 7.2x, 33x,
# 17x, 5.8x (ddt_bias); now 1.9x, 2.1x, 1.2x, 0.7x.
PRECISION_CASES = [CASES[2], CASES[3], CASES[5]]
PRECISION_SEEDS = range(6)
PRECISION_RATIO = 3.0


@pytest.mark.slow
@pytest.mark.parametrize("b,L,h,p,g,n,chunk,flags", PRECISION_CASES,
                         ids=[f"L{c[1]}-h{c[2]}p{c[3]}g{c[4]}n{c[5]}-Q{c[6]}" for c in PRECISION_CASES])
def test_log_decay_gradients_as_close_as_the_cpu_recurrence(b, L, h, p, g, n, chunk, flags):
    """float32 dA and ddt_bias: Triton's error against the float64 oracle within
    PRECISION_RATIO of the CPU recurrence's error on the same inputs (geometric mean over
    PRECISION_SEEDS; errors floored at 1e-9, far under one float32 rounding)."""
    need_interpreter()
    pytest.importorskip("numba")
    from sonata.kernels.ssd.cpu import ssd_cpu

    def recurrence(*a, **k):
        return ssd_cpu(*a, form="recurrent", **k)

    ratios, rows = {}, []
    for seed in PRECISION_SEEDS:
        inputs, opts = make_inputs(b, L, h, p, g, n, flags, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        gout = torch.randn(b, L, h, p, generator=gen).double()
        gfinal = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64)
        ref64 = {k: None if v is None else v.double() for k, v in inputs.items()}
        want = run_ssd(ssd_recurrent_ref, ref64, opts, chunk, gout, gfinal)[2]
        got = run_ssd(tri.ssd_triton, inputs, opts, chunk, gout, gfinal, DEVICE)[2]
        cpu = run_ssd(recurrence, inputs, opts, chunk, gout, gfinal)[2]
        for name in ("A", "dt_bias"):
            if inputs[name] is None:
                continue
            e_tri = max(rel_rms(got[name], want[name]), 1e-9)
            e_cpu = max(rel_rms(cpu[name], want[name]), 1e-9)
            ratios.setdefault(name, []).append(e_tri / e_cpu)
            rows.append(f"seed {seed} d{name}: triton {e_tri:.1e}, cpu recurrence {e_cpu:.1e}")
    geo = {name: math.exp(sum(math.log(v) for v in r) / len(r)) for name, r in ratios.items()}
    assert max(geo.values()) <= PRECISION_RATIO, (
        "Triton's float32 error over the CPU recurrence's (geometric mean over seeds "
        f"{list(PRECISION_SEEDS)}, bound {PRECISION_RATIO}x): "
        + ", ".join(f"d{name} {v:.1f}x" for name, v in geo.items()) + "\n" + "\n".join(rows))


def test_chunk_cap():
    """Chunks longer than the kernels tile run as shorter ones (the function is the same:
    the L 300, chunk 256 case above checks it); wide states get shorter chunks."""
    assert tri.chunk_cap(16) == tri.MAX_CHUNK == 64
    assert tri.chunk_cap(128) == 32 and tri.chunk_cap(1024) == 16


def test_channel_blocks_and_output_only():
    """Two channel blocks (block_p 16 < p 32: dG partials summed over blocks); the final
    state not requested, so its gradient arrives as zeros."""
    need_interpreter()
    seed = fresh_seed()
    inputs, opts = make_inputs(2, 40, 2, 32, 1, 16, ALL, seed)
    compare(inputs, opts, 16, seed, with_final=False, block_p=16, label="block_p=16")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(dtype):
    """Half inputs keep their dtypes out and in the gradients, and match the float64
    recurrence on the same rounded inputs up to one rounding of each result."""
    need_interpreter()
    seed = fresh_seed()
    inputs, opts = make_inputs(1, 37, 2, 8, 1, 16, ALL, seed, dtype=dtype)
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2
    compare(inputs, opts, 16, seed, rms=tol, rms_reduced=tol, label=str(dtype))


def test_float64_gradcheck():
    """float64 in, float64 arithmetic inside: the analytic backward passes gradcheck (fast
    mode: random projections; the full comparison with the oracle follows at 1e-12)."""
    need_interpreter()
    seed = fresh_seed()
    inputs, opts = make_inputs(1, 5, 2, 2, 1, 2, ALL, seed, dtype=torch.float64)
    names = [k for k, v in inputs.items() if v is not None]
    leaves = [inputs[k].detach().to(DEVICE).clone().requires_grad_() for k in names]
    opts = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}

    def f(*ts):
        kw = dict(zip(names, ts))
        out, final = tri.ssd_triton(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 16,
                                    D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"],
                                    initial_states=kw["initial_states"],
                                    return_final_states=True, **opts)
        return out, final

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5,
                                    fast_mode=True), f"seed={seed}"
    opts = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    compare(inputs, opts, 16, seed, rms=1e-12, rms_reduced=1e-12, label="float64")


def test_extreme_dt_stays_finite():
    """|dt + dt_bias| of 25..35: softplus is the identity above 20 and exp(raw) below -20,
    both ways through the gradient; nothing overflows or turns NaN."""
    need_interpreter()
    seed = fresh_seed()
    inputs, opts = make_inputs(1, 33, 2, 4, 1, 4, {"D", "z", "bias", "softplus", "init"}, seed)
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(inputs["dt"].shape, generator=gen) < 0.5, -1.0, 1.0)
    inputs["dt"] = sign * (25.0 + 10.0 * torch.rand(inputs["dt"].shape, generator=gen))
    inputs["A"] = inputs["A"] * 0.01                 # decays of large steps stay visible
    compare(inputs, opts, 16, seed, label="extreme dt")


def test_deterministic():
    """The same inputs give bit-identical outputs, final state and gradients (no atomics)."""
    need_interpreter()
    seed = fresh_seed()
    inputs, opts = make_inputs(2, 40, 2, 8, 2, 16, ALL, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    gout = torch.randn(2, 40, 2, 8, generator=gen, dtype=torch.float64)
    gfinal = torch.randn(2, 2, 8, 16, generator=gen, dtype=torch.float64)
    first = run_ssd(tri.ssd_triton, inputs, opts, 16, gout, gfinal, DEVICE)
    second = run_ssd(tri.ssd_triton, inputs, opts, 16, gout, gfinal, DEVICE)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1]), f"seed={seed}"
    for name in NAMES:
        assert torch.equal(first[2][name], second[2][name]), f"d{name} differs; seed={seed}"


def test_empty_sequence():
    """L == 0: empty output, the final state is the initial one, gradients flow to it."""
    need_interpreter()
    inputs, opts = make_inputs(2, 0, 2, 4, 1, 4, {"D", "z", "bias", "softplus", "init"}, 0)
    gfinal = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    out, final, grads = run_ssd(tri.ssd_triton, inputs, opts, 16,
                                torch.zeros(2, 0, 2, 4, dtype=torch.float64), gfinal, DEVICE)
    assert out.shape == (2, 0, 2, 4) and torch.equal(final, inputs["initial_states"])
    assert torch.allclose(grads["initial_states"].double(), gfinal)
    for name in ("A", "D", "dt_bias"):
        assert torch.equal(grads[name], torch.zeros_like(inputs[name])), name


@pytest.mark.skipif(INTERPRETED or CUDA, reason="not needed: the interpreter cases run in this "
                    "process, or a GPU is present (then they run with TRITON_INTERPRET=1)")
def test_interpreter_suite_in_subprocess():
    """Without a GPU, when triton was imported in compiled mode before this module (by
    another test module), run this file's interpreter cases in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.abspath(__file__)],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_mamba3_siso_runs_on_the_triton_kernels_and_matches_its_oracle():
    """Mamba-3's SISO scan (sonata.kernels.mamba3.ssd_form) on the SSD's Triton kernels: its
    output, final state and the gradients of q, k, x, dt, A and trap against the float64
    token-by-token oracle, at a length past two chunks; the Triton backend ran (no fallback)."""
    need_interpreter()
    from sonata.kernels import dispatch
    from sonata.kernels.mamba3 import mamba3_ref, mamba3_siso_ssd
    g = torch.Generator().manual_seed(5)
    b, L, h, n, p, m = 2, 37, 2, 8, 4, 2
    base = [torch.randn(b, L, 1, h, n, generator=g), torch.randn(b, L, 1, h, n, generator=g),
            torch.randn(b, L, h, p, generator=g), torch.rand(b, L, h, generator=g) * 0.5 + 0.01,
            -(torch.rand(b, L, h, generator=g) * 2 + 0.1), torch.rand(b, L, h, generator=g),
            torch.randn(b, L, h, m, generator=g)]
    D = torch.randn(h, generator=g)
    state = (torch.randn(b, h, m, generator=g).double(), torch.randn(b, h, p, n, generator=g),
             torch.randn(b, 1, h, n, generator=g), torch.randn(b, h, p, generator=g))
    f32 = [t.clone().requires_grad_(True) for t in base]
    f64 = [t.double().requires_grad_(True) for t in base]
    before = dispatch.fallback_count()
    y, st = mamba3_siso_ssd(*f32, D, "adjacent", state, chunk_size=16, backend="triton")
    assert dispatch.fallback_count() == before
    y_ref, st_ref = mamba3_ref(*f64, D.double(), None, "adjacent", tuple(t.double() for t in state))

    def rel(a, b):
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())
    assert rel(y, y_ref) < 1e-5 and rel(st[1], st_ref[1]) < 1e-5
    w = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad((y * w).sum(), f32[:6])
    ref = torch.autograd.grad((y_ref * w.double()).sum(), f64[:6])
    for name, a, r in zip("q k x dt A trap".split(), got, ref):
        assert rel(a, r) < 1e-4, name
