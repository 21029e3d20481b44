"""The dispatcher: which backend runs, and the fallback counter that says when it was not
the one asked for; `auto` naming a Triton kernel it picks for CUDA tensors that has never
passed on a GPU (simulated on a CPU: the CUDA check answers yes and the interpreter runs the
kernels). Also the reference itself under gradcheck."""
import importlib
import warnings
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from sonata import kernels
from sonata.kernels import dispatch
from sonata.core.config import make_config
from sonata.kernels import fallback_count, selective_scan, selective_scan_ref
from sonata.lab.timing import make_inputs
from sonata.train.trainer import Trainer


def _args(dtype=torch.float32):
    t = make_inputs(2, 5, 3, 7)
    return (t["u"].to(dtype), t["delta"].to(dtype), t["A"], t["B"].to(dtype), t["C"].to(dtype), t["D"],
            t["z"].to(dtype), t["delta_bias"])


def test_reference_passes_gradcheck_in_float64():
    g = torch.Generator().manual_seed(0)
    b, d, n, L = 2, 3, 2, 5
    shapes = [(b, d, L), (b, d, L), (d, n), (b, n, L), (b, n, L), (d,), (b, d, L), (d,)]
    xs = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    with torch.no_grad():
        xs[2].copy_(-torch.rand(d, n, generator=g, dtype=torch.float64) - 0.5)

    def f(*a):
        out, last = selective_scan_ref(*a[:7], delta_bias=a[7], delta_softplus=True, return_last_state=True)
        return out, last
    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
def test_no_fallback_when_the_backend_can_run(backend):
    before = fallback_count()
    selective_scan(*_args(), delta_softplus=True, backend=backend)
    assert fallback_count() == before


def test_unsupported_dtype_falls_back_once_per_call_and_warns_once(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())
    before = fallback_count()
    u, delta, A, B, C, D, z, bias = _args()
    u_int = (u * 10).to(torch.int32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out1 = selective_scan(u_int, delta, A, B, C, D, z, bias, delta_softplus=True, backend="cpu")
        selective_scan(u_int, delta, A, B, C, D, z, bias, delta_softplus=True, backend="cpu")
    assert fallback_count() == before + 2
    msgs = [str(x.message) for x in w if "fell back" in str(x.message)]
    assert len(msgs) == 1 and "does not support dtype torch.int32" in msgs[0]
    # what ran is the reference's arithmetic (float32 for int32 input), back in int32: against
    # the same scan in float64, truncated, at most one unit off
    ref64 = selective_scan_ref(u_int.double(), delta.double(), A.double(), B.double(), C.double(),
                               D.double(), z.double(), bias.double(), delta_softplus=True)
    assert out1.dtype == torch.int32 and (out1 - ref64.to(torch.int32)).abs().max() <= 1


def test_missing_numba_falls_back_and_names_the_reason(monkeypatch):
    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "sonata.kernels.selective.cpu":
            raise ImportError("No module named 'numba'")
        return real(name, *a, **k)
    monkeypatch.setattr(dispatch.importlib, "import_module", fake)
    monkeypatch.setattr(dispatch, "_loaded", {})      # as in a process that never imported it
    assert kernels.resolve_backend("cpu", torch.zeros(1)) == (
        "reference", "cpu backend unavailable (No module named 'numba')")
    before = fallback_count()
    selective_scan(*_args(), delta_softplus=True, backend="auto")
    assert fallback_count() == before + 1


def test_compiled_triton_on_cpu_tensors_falls_back(monkeypatch):
    mod = importlib.import_module("sonata.kernels.selective.triton")
    monkeypatch.setattr(mod, "INTERPRETED", False)
    name, reason = kernels.resolve_backend("triton", torch.zeros(1))
    assert name == "reference" and "TRITON_INTERPRET=1" in reason


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown scan backend 'gpu'"):
        selective_scan(*_args(), backend="gpu")


def test_trainer_reports_the_fallback_counter_every_step(monkeypatch):
    mod = importlib.import_module("sonata.kernels.selective.triton")
    monkeypatch.setattr(mod, "INTERPRETED", False)          # triton asked for, cannot run here
    cfg = make_config(tiny_overrides(**{"model.backend": "triton", "train.max_steps": 3}))
    tr = Trainer(cfg, None, progress="none")
    summary = tr.run()
    # one scan per layer (1 layer) per micro-step, counted from the start of the run
    assert [r["fallbacks"] for r in tr.history] == [1, 2, 3]
    assert summary["backend"] == "reference" and summary["fallbacks"] >= 3


# --------------------------------------------------------------------------- Triton never run on a GPU

def _ssd_args():
    g = torch.Generator().manual_seed(0)
    b, L, h, p, n = 1, 8, 2, 4, 4
    return (torch.randn(b, L, h, p, generator=g), torch.rand(b, L, h, generator=g) * 0.5 + 0.01,
            -torch.rand(h, generator=g) - 0.5, torch.randn(b, L, 1, n, generator=g),
            torch.randn(b, L, 1, n, generator=g))


@pytest.fixture
def cuda_choice(monkeypatch):
    """`auto` takes its CUDA branch: on a GPU with CUDA tensors; without one, sonata.kernels.dispatch.on_cuda
    answers yes for CPU tensors, so the dispatchers pick (and run) the Triton kernels, which the
    interpreter runs. The once-per-process memory of the warning starts empty. Yields the device."""
    monkeypatch.setattr(dispatch, "_unverified_warned", set())
    if torch.cuda.is_available():
        yield "cuda"
        return
    pytest.importorskip("triton")
    for mod in ("sonata.kernels.selective.triton", "sonata.kernels.ssd.triton"):
        if not importlib.import_module(mod).INTERPRETED:
            pytest.skip(f"{mod} was imported compiled, without a GPU")
    monkeypatch.setattr(dispatch, "on_cuda", lambda t: True)          # the one device check
    yield "cpu"


def _unverified_warnings(w):
    return [str(x.message) for x in w if "never passed on a GPU" in str(x.message)]


def test_auto_on_cuda_names_each_unverified_triton_kernel_once(cuda_choice, monkeypatch):
    from sonata.kernels.ssd import ssd
    monkeypatch.setattr(dispatch, "GPU_VERIFIED", {})
    scan_args = [t.to(cuda_choice) for t in _args()]
    ssd_args = [t.to(cuda_choice) for t in _ssd_args()]
    before = fallback_count()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            selective_scan(*scan_args, delta_softplus=True, backend="auto")
            ssd(*ssd_args, 16, backend="auto")
    msgs = _unverified_warnings(w)
    assert len(msgs) == 2, msgs
    scan_msg, ssd_msg = msgs
    assert "Mamba-1 selective scan (sonata/kernels/selective/triton.py)" in scan_msg and "'selective_scan'" in scan_msg
    assert "SSD / Mamba-2 scan (sonata/kernels/ssd/triton.py)" in ssd_msg and "'ssd'" in ssd_msg
    for m in msgs:
        assert "only run in Triton's CPU interpreter" in m and "benchmarks/gpu_check.sh" in m
    assert fallback_count() == before                      # the Triton kernels ran: no fallback
    assert kernels.resolve_backend("auto", scan_args[0]) == ("triton", None)


def test_no_warning_for_a_verified_kernel_nor_for_other_backends(cuda_choice, monkeypatch):
    from sonata.kernels.ssd import ssd
    monkeypatch.setattr(dispatch, "GPU_VERIFIED", {"selective_scan": "abc1234, NVIDIA H100, 2026-12-07"})
    scan_args = [t.to(cuda_choice) for t in _args()]
    ssd_args = [t.to(cuda_choice) for t in _ssd_args()]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        selective_scan(*scan_args, delta_softplus=True, backend="auto")       # verified
        selective_scan(*scan_args, delta_softplus=True, backend="reference")  # not Triton
        ssd(*ssd_args, 16, backend="reference")
        ssd(*ssd_args, 16, backend="recurrent")
        selective_scan(*scan_args, delta_softplus=True, backend="triton")     # asked for by name
        ssd(*ssd_args, 16, backend="triton")
        x = scan_args[0].transpose(1, 2)
        kernels.rms_norm(x, torch.ones(x.shape[-1], device=cuda_choice), 1e-5)   # PyTorch ops, by design
    assert _unverified_warnings(w) == []


def test_no_warning_on_cpu():
    from sonata.kernels.ssd import ssd
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        selective_scan(*_args(), delta_softplus=True, backend="auto")
        ssd(*_ssd_args(), 16, backend="auto")
    assert _unverified_warnings(w) == []


def test_the_registry_and_the_docs_table_agree():
    """GPU_VERIFIED names only known Triton families, and docs/kernels.md's table of which kernels
    ran on a GPU has a row per family, saying "never" exactly for those not verified."""
    assert set(kernels.GPU_VERIFIED) <= set(kernels.TRITON_KERNELS)
    with pytest.raises(ValueError, match="unknown Triton kernel family"):
        kernels.triton_chosen("mamba9", "auto", torch.zeros(1))
    page = (Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text()
    section = page.split("## Which kernels have run on a GPU", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    for family in kernels.TRITON_KERNELS:
        mine = [r for r in rows if r.startswith(f"| `{family}`")]
        assert mine, f"docs/kernels.md has no row for the Triton family {family!r}"
        for r in mine:
            ran = [c.strip() for c in r.strip("|").split("|")][-1]
            assert ran.startswith("never") == (family not in kernels.GPU_VERIFIED), r
