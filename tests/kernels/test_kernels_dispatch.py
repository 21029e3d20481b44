"""The dispatcher: which backend runs, and the fallback counter that says when it was not
the one asked for. Also the reference itself under gradcheck."""
import importlib
import warnings

import pytest
import torch

from conftest import tiny_overrides
from sonata import kernels
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
    monkeypatch.setattr(kernels, "_warned", set())
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
        if name == "sonata.kernels.cpu":
            raise ImportError("No module named 'numba'")
        return real(name, *a, **k)
    monkeypatch.setattr(kernels.importlib, "import_module", fake)
    monkeypatch.setattr(kernels, "_loaded", {})      # as in a process that never imported it
    assert kernels.resolve_backend("cpu", torch.zeros(1)) == (
        "reference", "cpu backend unavailable (No module named 'numba')")
    before = fallback_count()
    selective_scan(*_args(), delta_softplus=True, backend="auto")
    assert fallback_count() == before + 1


def test_compiled_triton_on_cpu_tensors_falls_back(monkeypatch):
    mod = importlib.import_module("sonata.kernels.triton")
    monkeypatch.setattr(mod, "INTERPRETED", False)
    name, reason = kernels.resolve_backend("triton", torch.zeros(1))
    assert name == "reference" and "TRITON_INTERPRET=1" in reason


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown scan backend 'gpu'"):
        selective_scan(*_args(), backend="gpu")


def test_trainer_reports_the_fallback_counter_every_step(monkeypatch):
    mod = importlib.import_module("sonata.kernels.triton")
    monkeypatch.setattr(mod, "INTERPRETED", False)          # triton asked for, cannot run here
    cfg = make_config(tiny_overrides(**{"model.backend": "triton", "train.max_steps": 3}))
    tr = Trainer(cfg, None, progress="none")
    summary = tr.run()
    # one scan per layer (1 layer) per micro-step, counted from the start of the run
    assert [r["fallbacks"] for r in tr.history] == [1, 2, 3]
    assert summary["backend"] == "reference" and summary["fallbacks"] >= 3
