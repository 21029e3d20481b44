"""The SSD (Mamba-2) CPU path and its dispatcher against the float64 recurrence.

`sonata.kernels.ssd.cpu` (and the dispatcher's backends) are compared with
`ssd_recurrent_ref` run in float64 on the same inputs: the output, the final state and
every gradient (x, dt, A, B, C, D, z, dt_bias, initial state), by relative RMS
||a - b|| / ||b||, at odd sizes (L 1, 63, 65, 300; chunk 16..256; groups 1 and 2; headdim
4..64), with and without each option. Tolerances, float32: 1e-5, except dA and ddt_bias
(5e-5: sums over the whole batch and sequence whose terms cancel; the float32 recurrence
itself lands near 1e-6 there); float64: 1e-11 (1e-8). bfloat16 inputs or autocast:
against the oracle on the same rounded inputs, 1e-2 (the output is rounded to bfloat16);
with bfloat16 matmul operands forced (what a CPU with native bfloat16 runs), 3e-2, and 0.2
for dA and ddt_bias, whose cancellation amplifies the operands' rounding. Also: packed sequences equal the sequences run apart, a sequence in pieces equals
the whole, the decoding step iterated equals the sequence, NaN-poisoned buffers never leak,
two runs are bit-identical, bad shapes raise ValueError. The CPU path has two forms, the
fused recurrence (`cpu_recurrent.py`) and the chunked form (`cpu.py`): each of these checks
runs on both (`form`), and the rule that picks one is tested on its own.

Each random case draws a fresh seed (reproduce one with SONATA_TEST_SEED=<seed>); every
failure message names it.
"""
from __future__ import annotations

import math
import os
import random
import warnings

import pytest
import torch

from sonata import kernels
from sonata.kernels import dispatch
from sonata.kernels import ssd as ssd_pkg
from sonata.kernels.ssd import cpu as cpu_mod
from sonata.kernels.ssd import cpu_recurrent
from sonata.kernels.ssd import ssd, ssd_step, ssd_step_ref
from sonata.kernels.ssd import step as step_mod
from sonata.kernels.ssd.cpu import ssd_cpu
from sonata.kernels.ssd.reference import ssd_recurrent_ref

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
LOOSE = ("dA", "ddt_bias")   # sums over the whole batch and sequence whose terms cancel
# the recurrence twice: its explicit vector steps (where d_state is a multiple of the lanes)
# and the numba loops beside them
FORMS = ("recurrent", "recurrent-loops", "chunked")


def _form(form):
    """ssd_cpu pinned to one of its two forms ("recurrent-loops": the recurrence with its vector
    steps off; the forward records the choice, so the backward follows it)."""
    if form == "recurrent-loops":
        def loops(*a, **k):
            saved, cpu_recurrent.VECTOR = cpu_recurrent.VECTOR, False
            try:
                return ssd_cpu(*a, form="recurrent", **k)
            finally:
                cpu_recurrent.VECTOR = saved
        return loops
    return lambda *a, **k: ssd_cpu(*a, form=form, **k)


def _seed():
    return int(os.environ.get("SONATA_TEST_SEED") or random.randrange(2**31))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(seed, b, L, h, p, g, n, D=None, z=False, bias=False, init=False, a_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    t = {"x": r(b, L, h, p), "dt": r(b, L, h) * 0.5 - 1.0,
         "A": -torch.exp(torch.rand(h, generator=gen, dtype=torch.float64) * math.log(16)) * a_scale,
         "B": r(b, L, g, n), "C": r(b, L, g, n)}
    if D == "h":
        t["D"] = r(h)
    elif D == "hp":
        t["D"] = r(h, p)
    if z:
        t["z"] = r(b, L, h, p)
    if bias:
        t["dt_bias"] = r(h) * 0.5
    if init:
        t["initial_states"] = r(b, h, p, n)
    return t


def _packed(b, L, cuts):
    """seq_idx (b, L): row k starts new sequences at the positions in cuts (shifted by k)."""
    seq = torch.zeros(b, L, dtype=torch.int32)
    for k in range(b):
        for i, c in enumerate(cuts):
            seq[k, min(L, c + k):] = i + 1
    return seq


def _run(fn, t, dtype, chunk, seq_idx=None, softplus=False, limit=(0.0, math.inf), seed=0, cot=None, **extra):
    """[out, final, grads of every given input] for loss <out, W> + <final, V>.

    cot: the dtypes (out's, final's) to round W and V to first. A bfloat16 run's kernels receive
    W rounded so (a gradient takes its tensor's dtype), and an oracle given the same W and V
    solves the same problem; without it, the sums that cancel (dA, ddt_bias) differ by the
    rounding of W itself (seed 346006867: ddt_bias 1.0e-2 against 2.1e-3 with it)."""
    leaf = {k: v.to(dtype).requires_grad_() for k, v in t.items()}
    out, final = fn(leaf["x"], leaf["dt"], leaf["A"], leaf["B"], leaf["C"], chunk, D=leaf.get("D"),
                    z=leaf.get("z"), dt_bias=leaf.get("dt_bias"), initial_states=leaf.get("initial_states"),
                    seq_idx=seq_idx, dt_softplus=softplus, dt_limit=limit, return_final_states=True, **extra)
    gen = torch.Generator().manual_seed(seed + 1)
    W = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    V = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    if cot is not None:
        W, V = W.to(cot[0]).double(), V.to(cot[1]).double()
    loss = (out.double() * W).sum() + (final.double() * V).sum()
    names = [k for k in NAMES if k in leaf]
    grads = torch.autograd.grad(loss, [leaf[k] for k in names])
    return dict(zip(["out", "final"] + [f"d{k}" for k in names], [out, final, *grads]))


def _compare(got, want, seed, tol=1e-5, loose=5e-5, what=""):
    for k, b in want.items():
        a = got[k]
        assert a.shape == b.shape, (k, a.shape, b.shape)
        assert torch.isfinite(a).all(), f"{what} {k} not finite (seed {seed})"
        err = _rel(a, b)
        assert err < (loose if k in LOOSE else tol), f"{what} {k}: rel err {err:.2e} (seed {seed})"


CASES = [  # b, L, chunk, h, p, g, n, options
    (2, 1, 16, 2, 4, 1, 8, dict(D="h", bias=True, softplus=True)),
    (2, 63, 64, 4, 8, 2, 16, dict(D="hp", z=True, bias=True, softplus=True, init=True)),
    (2, 65, 16, 4, 16, 1, 16, dict(softplus=True, bias=True, limit=(0.05, 1.5), seq=[20, 40])),
    (2, 300, 256, 2, 64, 2, 16, dict(D="h", z=True, init=True, softplus=True, bias=True, seq=[100, 237])),
    (1, 300, 64, 4, 4, 2, 32, dict(limit=(0.0, 0.5), init=True, seq=[64, 65])),
    (2, 130, 32, 4, 8, 1, 8, dict(D="hp", z=True, init=True, softplus=True, bias=True, strong=True)),
    (2, 200, 128, 4, 8, 2, 16, dict(init=True, softplus=True, bias=True, seq=[10])),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-L{c[1]}-Q{c[2]}-h{c[3]}-p{c[4]}-g{c[5]}-n{c[6]}")
def test_every_output_state_and_gradient_matches_the_float64_recurrence(case, form):
    b, L, chunk, h, p, g, n, opt = case
    seed = _seed()
    t = _inputs(seed, b, L, h, p, g, n, D=opt.get("D"), z=opt.get("z", False), bias=opt.get("bias", False),
                init=opt.get("init", False), a_scale=30.0 if opt.get("strong") else 1.0)
    kw = dict(seq_idx=_packed(b, L, opt["seq"]) if "seq" in opt else None, softplus=opt.get("softplus", False),
              limit=opt.get("limit", (0.0, math.inf)), seed=seed)
    want = _run(ssd_recurrent_ref, t, torch.float64, chunk, **kw)
    _compare(_run(_form(form), t, torch.float32, chunk, **kw), want, seed, what=f"cpu {form} fp32")
    _compare(_run(_form(form), t, torch.float64, chunk, **kw), want, seed, tol=1e-11, loose=1e-8,
             what=f"cpu {form} fp64")


def test_the_recurrence_runs_up_to_its_largest_state_and_the_chunked_form_beyond(monkeypatch):
    x = torch.zeros(1, 4, 2, 8)
    for n, form in [(16, "recurrent"), (cpu_mod.RECURRENT_MAX_N, "recurrent"),
                    (cpu_mod.RECURRENT_MAX_N + 1, "chunked")]:
        assert cpu_mod.prefer_recurrent(x, torch.zeros(1, 4, 1, n)) == (form == "recurrent"), n
    ran = []
    real_rec, real_chunked = cpu_recurrent.ssd_cpu_recurrent, cpu_mod.SSDFunction

    class Chunked:
        @staticmethod
        def apply(*a):
            ran.append("chunked")
            return real_chunked.apply(*a)
    monkeypatch.setattr(cpu_recurrent, "ssd_cpu_recurrent", lambda *a: (ran.append("recurrent"), real_rec(*a))[1])
    monkeypatch.setattr(cpu_mod, "SSDFunction", Chunked)
    t = {k: v.float() for k, v in _inputs(0, 1, 20, 2, 4, 1, 8).items()}
    args = [t[k] for k in ("x", "dt", "A", "B", "C")]
    ssd(*args, 8, backend="cpu")
    ssd_cpu(*args, 8, block=8)
    ssd_cpu(*args, 8, form="chunked")
    assert ran == ["recurrent", "chunked", "chunked"]
    with pytest.raises(ValueError, match="form"):
        ssd_cpu(*args, 8, form="parallel")


def test_the_block_plans_cover_factored_halved_and_explicit_decays():
    a = torch.full((1, 256, 2), -0.5, dtype=torch.float64)        # 0.5 e-folds a step
    assert cpu_mod.plan(a, 256, 256) == (64, False)                 # 64 steps span 31.5 < R_MAX
    assert cpu_mod.plan(a * 6, 256, 256) == (32, False)             # 3 a step: 64 steps too many
    assert cpu_mod.plan(a * 20, 256, 256) == (64, True)             # 10 a step: explicit decays
    assert cpu_mod.plan(a, 50, 64) == (50, False)


@pytest.mark.parametrize("block", [16, 40, 64])
def test_any_block_length_gives_the_same_result(block):
    seed = _seed()
    t = _inputs(seed, 2, 150, 4, 8, 2, 16, D="h", z=True, bias=True, init=True)
    kw = dict(seq_idx=_packed(2, 150, [50]), softplus=True, seed=seed)
    want = _run(ssd_recurrent_ref, t, torch.float64, 64, **kw)
    _compare(_run(ssd_cpu, t, torch.float32, 256, block=block, **kw), want, seed, what=f"block {block}")


@pytest.mark.parametrize("backend", ["auto", "cpu", "reference", "recurrent"])
def test_the_dispatcher_backends_match_the_oracle(backend):
    seed = _seed()
    t = _inputs(seed, 2, 65, 4, 8, 2, 8, D="h", z=True, bias=True, init=True)
    kw = dict(seq_idx=_packed(2, 65, [30]), softplus=True, limit=(0.0, 3.0), seed=seed)
    want = _run(ssd_recurrent_ref, t, torch.float64, 16, **kw)
    before = kernels.fallback_count()
    _compare(_run(lambda *a, **k: ssd(*a, backend=backend, **k), t, torch.float32, 16, **kw), want, seed,
             what=backend)
    assert kernels.fallback_count() == before


def test_triton_without_a_gpu_or_the_interpreter_falls_back_to_cpu_and_counts(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = _inputs(0, 1, 20, 2, 4, 1, 4)
    before = kernels.fallback_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = ssd(*(t[k].float() for k in ("x", "dt", "A", "B", "C")), 8, backend="triton")
    assert kernels.fallback_count() == before + 1
    assert torch.equal(got, ssd(*(t[k].float() for k in ("x", "dt", "A", "B", "C")), 8, backend="cpu"))
    real = dispatch.load_backend
    monkeypatch.setattr(dispatch, "load_backend", lambda name, label=None: (
        (None, "ssd triton backend unavailable (test)") if name == "ssd.triton" else real(name, label)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ssd_pkg.resolve_backend("triton", t["x"]) == ("cpu", "ssd triton backend unavailable (test)")
    with pytest.raises(ValueError, match="unknown ssd backend"):
        ssd(*(t[k].float() for k in ("x", "dt", "A", "B", "C")), backend="gpu")


@pytest.mark.parametrize("form", FORMS)
def test_packed_sequences_equal_the_sequences_run_apart(form):
    seed = _seed()
    cuts, L = [0, 37, 90, 120], 120
    t = _inputs(seed, 1, L, 4, 8, 2, 16, D="h", z=True, bias=True, init=True)
    f = {k: v.float().requires_grad_() for k, v in t.items()}
    seq = _packed(1, L, cuts[1:-1])
    kw = dict(D=f["D"], dt_bias=f["dt_bias"], dt_softplus=True, return_final_states=True)
    packed, final = _form(form)(f["x"], f["dt"], f["A"], f["B"], f["C"], 32, z=f["z"], seq_idx=seq,
                            initial_states=f["initial_states"], **kw)
    gx_packed, = torch.autograd.grad(packed.sum(), f["x"])
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        sl = slice(a, b)
        x = f["x"].detach()[:, sl].clone().requires_grad_()
        apart, last = _form(form)(x, f["dt"][:, sl], f["A"], f["B"][:, sl], f["C"][:, sl], 32, z=f["z"][:, sl],
                              initial_states=f["initial_states"] if i == 0 else None, **kw)
        gx, = torch.autograd.grad(apart.sum(), x)
        assert _rel(packed[:, sl], apart) < 1e-6, f"piece {i} (seed {seed})"
        assert _rel(gx_packed[:, sl], gx) < 1e-6, f"piece {i} dx (seed {seed})"
    assert _rel(final, last) < 1e-6, f"final state (seed {seed})"


@pytest.mark.parametrize("form", FORMS)
def test_a_long_sequence_in_pieces_equals_the_whole_with_gradients(form):
    seed = _seed()
    t = _inputs(seed, 2, 500, 2, 16, 1, 16, D="h", bias=True, init=True)
    f = {k: v.float() for k, v in t.items()}
    kw = dict(D=f["D"], dt_bias=f["dt_bias"], dt_softplus=True, return_final_states=True)
    x_whole, h_whole = f["x"].clone().requires_grad_(), f["initial_states"].clone().requires_grad_()
    whole, s_whole = _form(form)(x_whole, f["dt"], f["A"], f["B"], f["C"], 64, initial_states=h_whole, **kw)
    (whole.sum() + s_whole.square().sum()).backward()
    x_p, h_p = f["x"].clone().requires_grad_(), f["initial_states"].clone().requires_grad_()
    state, outs = h_p, []
    for a in range(0, 500, 137):
        sl = slice(a, min(a + 137, 500))
        y, state = _form(form)(x_p[:, sl], f["dt"][:, sl], f["A"], f["B"][:, sl], f["C"][:, sl], 64,
                               initial_states=state, **kw)
        outs.append(y)
    (torch.cat(outs, 1).sum() + state.square().sum()).backward()
    for what, a, b in [("out", torch.cat(outs, 1), whole), ("final", state, s_whole),
                       ("dx", x_p.grad, x_whole.grad), ("dinit", h_p.grad, h_whole.grad)]:
        assert _rel(a, b) < 1e-5, f"{what} {_rel(a, b):.2e} (seed {seed})"


@pytest.mark.parametrize("fused", [True, False])
def test_the_decoding_step_iterated_equals_the_sequence(fused, monkeypatch):
    seed = _seed()
    b, L, h, p, g, n = 2, 40, 4, 8, 2, 16
    t = {k: v.float() for k, v in _inputs(seed, b, L, h, p, g, n, D="hp", z=True, bias=True, init=True).items()}
    if not fused:
        monkeypatch.setattr(step_mod, "_step_kernel", None)
    monkeypatch.setattr(step_mod, "POISON", True)
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=(0.01, 1.0))
    want, want_state = ssd_recurrent_ref(*(t[k].double() for k in ("x", "dt", "A", "B", "C")), z=t["z"].double(),
                                         initial_states=t["initial_states"].double(), return_final_states=True,
                                         **{k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()})
    state = t["initial_states"].clone()
    ys = [ssd_step(state, t["x"][:, i], t["dt"][:, i], t["A"], t["B"][:, i], t["C"][:, i], z=t["z"][:, i], **kw)
          for i in range(L)]
    assert _rel(torch.stack(ys, 1), want) < 1e-5, f"outputs (seed {seed})"
    assert _rel(state, want_state) < 1e-5, f"state (seed {seed})"
    s2 = t["initial_states"].clone()
    y2 = ssd_step_ref(s2, t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0], z=t["z"][:, 0], **kw)
    assert _rel(ys[0], y2) < 1e-6


@pytest.mark.parametrize("form", FORMS)
def test_poisoned_buffers_never_reach_an_output(form, monkeypatch):
    monkeypatch.setattr(cpu_mod, "POISON", True)
    seed = _seed()
    for L, chunk, g in [(65, 16, 2), (64, 64, 1), (7, 4, 1)]:     # padded, exact, tiny blocks
        t = _inputs(seed, 2, L, 4, 8, g, 8, D="h", z=True, bias=True, init=True)
        kw = dict(seq_idx=_packed(2, L, [L // 2]), softplus=True, seed=seed)
        _compare(_run(_form(form), t, torch.float32, chunk, **kw),
                 _run(ssd_recurrent_ref, t, torch.float64, chunk, **kw),
                 seed, what=f"poisoned L{L}")


@pytest.mark.parametrize("form", FORMS)
def test_two_runs_are_bit_identical(form):
    seed = _seed()
    t = _inputs(seed, 2, 200, 4, 16, 2, 16, D="hp", z=True, bias=True, init=True)
    kw = dict(seq_idx=_packed(2, 200, [77]), softplus=True, seed=seed)
    one, two = _run(_form(form), t, torch.float32, 64, **kw), _run(_form(form), t, torch.float32, 64, **kw)
    for k in one:
        assert torch.equal(one[k], two[k]), f"{k} differs between runs (seed {seed})"


def test_the_fused_passes_equal_the_torch_ops(monkeypatch):
    if cpu_mod.cpu_fused.njit is None:
        pytest.skip("numba missing: only the torch passes exist")
    seed = _seed()
    t = _inputs(seed, 2, 90, 4, 8, 2, 16, D="hp", z=True, bias=True, init=True)
    kw = dict(seq_idx=_packed(2, 90, [33]), softplus=True, seed=seed)
    fused = _run(_form("chunked"), t, torch.float32, 32, **kw)
    monkeypatch.setattr(cpu_mod.cpu_fused, "njit", None)
    _compare(_run(_form("chunked"), t, torch.float32, 32, **kw), fused, seed, tol=1e-6, loose=1e-5, what="torch passes")


@pytest.mark.parametrize("mode", ["autocast", "inputs", "bf16-matmuls", "recurrent-autocast", "recurrent-inputs"])
def test_bfloat16_runs_against_the_oracle_on_rounded_inputs(mode):
    seed = _seed()
    t = _inputs(seed, 2, 70, 4, 8, 2, 16, D="h", z=True, bias=True, init=True)
    rounded = {k: v.to(torch.bfloat16).double() for k, v in t.items()}
    kw = dict(softplus=True, seed=seed)
    recurrent = mode.startswith("recurrent")
    fn = _form("recurrent" if recurrent else "chunked")
    mode = mode.removeprefix("recurrent-")
    if mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _run(fn, rounded, torch.float32, 32, **kw)
    elif mode == "inputs":
        got = _run(fn, rounded, torch.bfloat16, 32, **kw)
    else:
        got = _run(ssd_cpu, rounded, torch.float32, 32, mm_dtype=torch.bfloat16, **kw)
    if mode == "inputs":
        assert got["out"].dtype == torch.bfloat16 and got["dx"].dtype == torch.bfloat16
    want = _run(ssd_recurrent_ref, rounded, torch.float64, 32, cot=(got["out"].dtype, got["final"].dtype), **kw)
    # the chunked form multiplies in bfloat16 where the CPU does so natively (autocast and
    # bfloat16 inputs too, there); the recurrence computes in float32 on the rounded inputs
    bf16_mm = mode == "bf16-matmuls" or (not recurrent and cpu_mod.native_bf16())
    tol, loose = (3e-2, 0.2) if bf16_mm else (1e-2, 1e-2)
    _compare(got, want, seed, tol=tol, loose=loose, what=mode)


@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_in_float64(form):
    # d_state 8: one float64 vector with AVX-512, two with AVX2 (the recurrence's vector steps)
    t = _inputs(1, 1, 9, 2, 3, 1, 8, D="h", z=True, bias=True, init=True)
    leaves = [t[k].clone().requires_grad_() for k in NAMES]
    seq = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]])

    def f(x, dt, A, B, C, D, z, bias, h0):
        return _form(form)(x, dt, A, B, C, 4, D=D, z=z, dt_bias=bias, initial_states=h0, seq_idx=seq,
                           dt_softplus=True, return_final_states=True)
    assert torch.autograd.gradcheck(f, leaves)


def _bad(**change):
    t = {k: v.float() for k, v in _inputs(0, 2, 10, 4, 8, 2, 16).items()}
    args = dict(x=t["x"], dt=t["dt"], A=t["A"], B=t["B"], C=t["C"], chunk_size=8)
    args.update(change)
    return args


@pytest.mark.parametrize("n, D, autocast", [(16, "h", False), (64, "hp", False), (32, None, True), (160, "h", False)],
                         ids=["n16", "n64-Dhp", "n32-autocast", "n160-chunked"])
def test_the_packed_entry_equals_the_parts_split_off(n, D, autocast):
    """ssd_packed over [x | B | C] (the Mamba-2 block's conv output) against ssd on the three
    parts split off: the output and every gradient, the packed input's as one tensor. The
    fused recurrence runs in place on the packed layout (n <= 128); beyond, the parts go to
    ssd (the chunked form)."""
    seed = _seed()
    b, L, h, p, g = 2, 70, 4, 8, 2
    gen = torch.Generator().manual_seed(seed)
    xBC = torch.randn(b, L, h * p + 2 * g * n, generator=gen)
    dt = torch.randn(b, L, h, generator=gen) * 0.5 - 1.0
    A = -torch.rand(h, generator=gen).mul(3).exp()
    Dv = None if D is None else torch.randn(h if D == "h" else (h, p), generator=gen)
    bias = torch.randn(h, generator=gen) * 0.5
    W = torch.randn(b, L, h, p, generator=gen)

    def run(packed):
        leaves = [t.clone().requires_grad_() for t in (xBC, dt, A, bias)] + ([] if Dv is None else [Dv.clone().requires_grad_()])
        xl, dtl, Al, bl = leaves[:4]
        Dl = leaves[4] if Dv is not None else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if packed:
                out = ssd_pkg.ssd_packed(xl, dtl, Al, p, g, n, chunk_size=32, D=Dl, dt_bias=bl, dt_softplus=True,
                                         backend="cpu")
            else:
                x, B, C = xl.split([h * p, g * n, g * n], dim=-1)
                out = ssd(x.reshape(b, L, h, p), dtl, Al, B.reshape(b, L, g, n), C.reshape(b, L, g, n), 32, D=Dl,
                          dt_bias=bl, dt_softplus=True, backend="cpu")
        return [out, *torch.autograd.grad((out.double() * W).sum(), leaves)]

    got, want = run(True), run(False)
    assert got[0].shape == (b, L, h, p) and got[1].shape == xBC.shape
    for name, a, w in zip(["out", "dxBC", "ddt", "dA", "ddt_bias", "dD"], got, want):
        assert a.dtype == w.dtype, name
        assert torch.equal(a, w), f"{name} differs: {(a - w).abs().max():.2e} (seed {seed})"


@pytest.mark.parametrize("form", ["recurrent", "recurrent-loops", "chunked"])
@pytest.mark.parametrize("g, dtype, autocast", [(1, torch.float32, False), (2, torch.float32, False),
                                                (2, torch.float64, False), (1, torch.float32, True)],
                         ids=["g1", "g2", "g2-float64", "g1-autocast"])
def test_the_packed_entry_with_the_gated_norm_equals_the_norm_after_it(g, dtype, autocast, form, monkeypatch):
    """ssd_packed(norm=(z, weight, eps)), the Mamba-2 block's SSD and gated norm in one (fused
    into the recurrence's kernels; the chunked form and every other path run rms_norm_gated
    after ssd), against ssd_packed then rms_norm_gated's reference: the output and the
    gradients of xBC, dt, A, D, dt_bias, z and the weight; z read in place from a wider
    projection (strided rows), as the block slices it from in_proj's output."""
    if form == "chunked":       # the recurrence's size limit is what sends the block to the chunked form
        monkeypatch.setattr(cpu_mod, "RECURRENT_MAX_N", 0)
    if form == "recurrent-loops":
        monkeypatch.setattr(cpu_recurrent, "VECTOR", False)
    from sonata.kernels import rms_norm_gated_ref
    seed = _seed()
    b, L, h, p, n = 2, 70, 4, 8, 16
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, k=1.0: (torch.randn(*s, generator=gen, dtype=torch.float64) * k).to(dtype)
    xBC, dt, proj = r(b, L, h * p + 2 * g * n), r(b, L, h, k=0.5) - 1.0, r(b, L, h * p + 9, k=2.0)
    A = -torch.rand(h, generator=gen, dtype=torch.float64).mul(3).exp().to(dtype)
    Dv, bias, w = r(h), r(h, k=0.5), 1 + r(h * p, k=0.3)
    cot = torch.randn(b, L, h * p, generator=gen, dtype=torch.float64)

    def run(fused):
        leaves = [t.clone().requires_grad_() for t in (xBC, dt, A, Dv, bias, proj, w)]
        xl, dtl, Al, Dl, bl, pl, wl = leaves
        z = pl[..., 4:4 + h * p]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            zz = z.bfloat16() if autocast else z
            kw = dict(chunk_size=32, D=Dl, dt_bias=bl, dt_softplus=True, backend="cpu")
            if fused:
                out = ssd_pkg.ssd_packed(xl, dtl, Al, p, g, n, norm=(zz, wl, 1e-5), **kw)
            else:
                y = ssd_pkg.ssd_packed(xl, dtl, Al, p, g, n, **kw).reshape(b, L, h * p)
                out = rms_norm_gated_ref(y.to(dtype), wl, zz.to(dtype), 1e-5, h * p // g, False)
        return [out, *torch.autograd.grad((out.double() * cot).sum(), leaves)]

    got, want = run(True), run(False)
    tol = 1e-11 if dtype == torch.float64 else (1e-2 if autocast else 1e-5)
    for name, a, w_ in zip(["out", "dxBC", "ddt", "dA", "dD", "ddt_bias", "dproj", "dweight"], got, want):
        assert a.shape == w_.shape, name
        assert _rel(a, w_) < (10 * tol if name in ("dA", "ddt_bias") else tol), \
            f"{name}: rel err {_rel(a, w_):.2e} (seed {seed})"


def test_the_packed_entry_checks_its_width():
    with pytest.raises(ValueError, match="not h\\*8"):
        ssd_pkg.ssd_packed(torch.zeros(1, 4, 8 * 3 + 2 * 16 + 1), torch.zeros(1, 4, 3), -torch.ones(3), 8, 1, 16)


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(2, 10, 32)), "x must be"),
    (dict(dt=torch.zeros(2, 10, 3)), "dt must be"),
    (dict(A=torch.zeros(5)), "A must be"),
    (dict(B=torch.zeros(2, 10, 3, 16), C=torch.zeros(2, 10, 3, 16)), "cannot share"),
    (dict(C=torch.zeros(2, 10, 2, 8)), "C must have"),
    (dict(D=torch.zeros(4, 7)), "D must be"),
    (dict(z=torch.zeros(2, 10, 4, 7)), "z must be"),
    (dict(dt_bias=torch.zeros(2)), "dt_bias must be"),
    (dict(initial_states=torch.zeros(2, 4, 8, 15)), "initial_states must be"),
    (dict(seq_idx=torch.zeros(2, 10)), "seq_idx must hold integers"),
    (dict(seq_idx=torch.zeros(2, 9, dtype=torch.int64)), "seq_idx must be"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(dt_limit=(1.0, 0.5)), "dt_limit"),
])
def test_bad_shapes_raise_a_clear_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        ssd(**_bad(**change))


def test_the_step_checks_its_shapes():
    s = torch.zeros(1, 4, 8, 16)
    with pytest.raises(ValueError, match="B must be"):
        ssd_step(s, torch.zeros(1, 4, 8), torch.zeros(1, 4), torch.zeros(4), torch.zeros(1, 3, 16),
                 torch.zeros(1, 3, 16))
    with pytest.raises(ValueError, match="dt must be"):
        ssd_step(s, torch.zeros(1, 4, 8), torch.zeros(1, 8), torch.zeros(4), torch.zeros(1, 2, 16),
                 torch.zeros(1, 2, 16))


def test_the_fused_step_runs_under_no_grad_for_parameters(monkeypatch):
    """Decoding reads parameters (and views of them: transformers' D[:, None].expand) that ask
    for gradients; under no_grad the fused step must still run (before, the torch step did)."""
    calls = []
    kernel = step_mod._step_kernel
    if kernel is None:
        pytest.skip("numba not installed")
    monkeypatch.setattr(step_mod, "_step_kernel", lambda *a: (calls.append(1), kernel(*a))[1])
    b, h, p, n = 2, 4, 8, 16
    g = torch.Generator().manual_seed(0)
    A = torch.nn.Parameter(-torch.rand(h, generator=g) - 0.5)
    D = torch.nn.Parameter(torch.ones(h))
    x, dt = torch.randn(b, h, p, generator=g), torch.randn(b, h, generator=g)
    B, C = torch.randn(b, 1, n, generator=g), torch.randn(b, 1, n, generator=g)
    state, ref_state = torch.zeros(b, h, p, n), torch.zeros(b, h, p, n)
    with torch.no_grad():
        y = ssd_step(state, x, dt, A, B, C, D=D[:, None].expand(h, p), dt_softplus=True)
        want = ssd_step_ref(ref_state, x, dt, A, B, C, D=D, dt_softplus=True)
    assert calls == [1] and _rel(y, want) < 1e-6 and _rel(state, ref_state) < 1e-6
    y = ssd_step(torch.zeros(b, h, p, n), x, dt, A, B, C, D=D, dt_softplus=True)   # grad mode: the reference
    assert calls == [1] and y.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_vector_steps_run_where_d_state_fills_whole_vectors(dtype):
    """The recurrence takes its explicit vector steps when d_state is a multiple of the lanes
    (so the default form above tests them at those sizes) and its loops otherwise; both
    against the float64 oracle at a d_state of one vector, two, and one vector plus a lane."""
    from sonata.kernels.cpu_simd import vector_lanes
    lanes = vector_lanes(torch.empty(0, dtype=dtype).numpy().dtype)
    seed = _seed()
    for n, vec, hp in [(lanes, True, 8), (2 * lanes, True, 6), (lanes + 1, False, 8)]:
        # headdim 6: the vector steps' four-row blocks and the rows left after them
        t = _inputs(seed, 2, 70, 4, hp, 2, n, D="hp", z=True, bias=True, init=True)
        x, dt, A, B, C = (t[k].to(dtype) for k in ("x", "dt", "A", "B", "C"))
        out, _ = cpu_recurrent.SSDRecurrentFunction.apply(x.requires_grad_(), dt, A, B, C, None, None, None, None,
                                                           None, (False, (0.0, math.inf)))
        assert out.grad_fn.vec is vec, (n, lanes)
        kw = dict(seq_idx=_packed(2, 70, [33]), softplus=True, seed=seed)
        want = _run(ssd_recurrent_ref, t, torch.float64, 64, **kw)
        tol = dict(tol=1e-5, loose=5e-5) if dtype == torch.float32 else dict(tol=1e-11, loose=1e-8)
        _compare(_run(_form("recurrent"), t, dtype, 64, **kw), want, seed, what=f"n {n}", **tol)


def test_the_recurrence_is_bit_identical_serial_and_in_parallel():
    """One torch thread runs the serial kernels (numba's pool never starts), more run the
    parallel ones: the same sums in the same order."""
    seed = _seed()
    t = _inputs(seed, 3, 70, 4, 8, 2, 16, D="hp", z=True, bias=True, init=True)
    kw = dict(seq_idx=_packed(3, 70, [33]), softplus=True, seed=seed)
    from sonata.kernels import cpu_simd
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpu_simd.workers() == 1      # the serial twins run: numba's pool never starts
        one = _run(_form("recurrent"), t, torch.float32, 64, **kw)
        torch.set_num_threads(2)
        assert cpu_simd.workers() == min(2, cpu_simd.numba.config.NUMBA_NUM_THREADS)
        two = _run(_form("recurrent"), t, torch.float32, 64, **kw)
    finally:
        torch.set_num_threads(threads)
    for k in one:
        assert torch.equal(one[k], two[k]), f"{k} differs serial / parallel (seed {seed})"
