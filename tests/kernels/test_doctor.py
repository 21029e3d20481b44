"""`python -m sonata doctor` (sonata.kernels.doctor): a line per kernel family and device saying
which backend runs and why, read from the one dispatch module, including where numba is missing
and where auto chooses Triton kernels that have never run on a GPU."""
import torch

from conftest import run_cli
from sonata.kernels import dispatch, doctor


def test_the_command_names_every_family_and_its_backend_on_this_machine():
    r = run_cli("doctor")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("sonata ") and "torch " in lines[0] and "numba " in lines[0]
    assert lines[1].startswith("cpu: ") and "vector extensions" in lines[1]
    for fam in ("selective_scan", "layers", "ssd", "mamba3", "gdn"):
        line = next(ln for ln in lines if ln.startswith(f"{fam} on cpu: "))
        assert line.startswith(f"{fam} on cpu: cpu (auto picks cpu for CPU tensors): "), line
    assert len([ln for ln in lines if " on cpu: " in ln]) == len(doctor.FAMILY_MODULES)


def test_a_missing_fused_backend_is_named_with_what_runs_instead(monkeypatch):
    monkeypatch.setattr(dispatch, "load_backend",
                        lambda name, label=None: (None, f"{label or name} backend unavailable (No module named 'numba')"))
    rows = {r["family"]: r for r in doctor.rows([torch.device("cpu")])}
    assert rows["selective_scan"]["runs"] == "reference"
    assert rows["selective_scan"]["why"] == "cpu backend unavailable (No module named 'numba')"
    assert rows["selective_scan"]["what"].startswith("the PyTorch loop")
    assert rows["gdn"]["runs"] == "reference" and "gdn cpu backend unavailable" in rows["gdn"]["why"]
    assert rows["ssd"]["runs"] == "cpu"                  # its cpu path is checked by the family itself


def test_triton_chosen_for_cuda_tensors_says_it_never_ran_on_a_gpu(monkeypatch):
    monkeypatch.setattr(dispatch, "on_cuda", lambda t: True)
    monkeypatch.setattr(dispatch, "GPU_VERIFIED", {"ssd": "abc1234, H100, 2026-12-07"})
    rows = {r["family"]: r for r in doctor.rows([torch.device("cpu")])}
    scan = rows["selective_scan"]
    assert (scan["runs"], scan["why"]) == ("triton", "auto picks triton for CUDA tensors")
    assert scan["gpu"].startswith("never run on a GPU")
    assert rows["ssd"]["gpu"] == "passed on a GPU: abc1234, H100, 2026-12-07"
    gdn = rows["gdn"]                                    # no Triton kernels: PyTorch ops by design
    assert (gdn["runs"], gdn["gpu"]) == ("reference", "")
    assert gdn["why"] == "gdn has no triton kernels: PyTorch ops, by design"
