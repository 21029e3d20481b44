"""Every notebook runs under papermill with tiny parameters, and says what it produced."""
import json

import pytest

from conftest import REPO

papermill = pytest.importorskip("papermill")

NOTEBOOKS = REPO / "notebooks"

TINY = {
    "00_selective_scan_kernels.ipynb": dict(
        batch=2, d_inner=5, d_state=4, seq_len=9, time_sizes=["small"], time_repeat=1, threads=1),
    "01_train_tinystories.ipynb": dict(
        d_model=32, n_layers=1, d_state=4, vocab_size=300, seq_len=32, max_steps=8,
        micro_batch=4, effective_batch=8, eval_every=4, max_stories=60, n_samples=2,
        sample_tokens=12, warmup_steps=2),
    "02_autotuning.ipynb": dict(
        candidates="1,2,4,8", effective_batch=4, sustained_steps=6, peak_micro=8, peak_steps=4,
        eval_every=3, d_model=32, n_layers=1, d_state=4, seq_len=32, max_stories=60,
        scaling_processes=[1, 2], scaling_steps=4),
    "03_memory_leak_reproduction.ipynb": dict(
        steps=20, micro_batch=8, headroom_mb=24, guarded_steps=80, d_model=64, n_layers=1, d_state=4,
        seq_len=64, max_stories=60),
    "04_benchmark_correction.ipynb": dict(
        steps=20, micro_batch=8, d_model=64, n_layers=1, d_state=4, seq_len=64, max_stories=60),
    "05_contracting_dynamics.ipynb": dict(
        lrs=[0.01, 1.0], max_steps=12, micro_batch=4, seq_len=32, d_model=32, n_layers=1, d_state=4,
        max_stories=60),
}


def notebook_parameters(path):
    return set(papermill.inspect_notebook(str(path)).keys())


def test_every_notebook_has_tiny_parameters():
    assert sorted(TINY) == sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_parameters_exist_in_the_notebook(name):
    # papermill only warns about unknown parameters; a renamed one would silently run the default
    missing = set(TINY[name]) - notebook_parameters(NOTEBOOKS / name)
    assert not missing, f"{name} has no parameters {sorted(missing)}"


def _run(name, tmp_path, **extra):
    out_nb = tmp_path / name
    params = dict(TINY[name], **extra)
    if "out_dir" in notebook_parameters(NOTEBOOKS / name):
        params["out_dir"] = str(tmp_path / "run")
    papermill.execute_notebook(str(NOTEBOOKS / name), str(out_nb), parameters=params,
                               kernel_name="python3", cwd=str(REPO), progress_bar=False)
    nb = json.loads(out_nb.read_text())
    text = "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                     for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))
    return nb, text


def _html(nb):
    return "\n".join("".join(o.get("data", {}).get("text/html", "")) for c in nb["cells"]
                     if c["cell_type"] == "code" for o in c.get("outputs", []))


def _images(nb):
    return sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))


@pytest.mark.notebook
def test_notebook_01_trains_and_reports(tmp_path):
    nb, text = _run("01_train_tinystories.ipynb", tmp_path)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    summary = json.loads((run / "summary.json").read_text())
    assert f"validation bits per byte: {summary['val_bpb']:.4f}" in text
    assert text.count("--- sample") == 2
    assert "parameters: " in text and "coverage" in text
    assert _images(nb) >= 1
    assert (run / "checkpoint.pt").exists()


@pytest.mark.notebook
def test_notebook_00_checks_every_backend(tmp_path):
    nb, text = _run("00_selective_scan_kernels.ipynb", tmp_path)
    assert "all backends agree with the float64 reference: True" in text
    assert '"triton_interpreter": true' in text or "cuda" in text
    html = _html(nb)
    assert "<td>triton</td>" in html and "<td>cpu</td>" in html and "<td>mambapy</td>" in html


@pytest.mark.notebook
def test_notebook_05_finds_divergence_and_the_fixes(tmp_path):
    nb, text = _run("05_contracting_dynamics.ipynb", tmp_path)
    assert "smallest learning rate at which direct A diverges or loses contraction: 1.0" in text
    assert "direct + constraint at lr 1.0: stayed finite" in text
    assert "log (A_log) at lr 1.0: stayed finite" in text
    assert text.count("(never above 1: no direction of the state grows)") == 2


@pytest.mark.notebook
def test_notebook_02_autotunes_and_compares_sustained_with_peak(tmp_path):
    nb, text = _run("02_autotuning.ipynb", tmp_path)
    assert "chosen: micro-batch " in text and "x accumulation" in text
    assert "the trainer is back at step 0" in text
    assert "MemoryBudgetExceeded after 0 steps: budget 64 MiB, in use above it: True" in text
    html = _html(nb)
    assert "sustained (profile default)" in html and "peak micro-benchmark (fixed micro-batch 8)" in html
    assert html.count("&lt;- chosen") == 1
    assert "same final loss in every run (within 0.1%): True" in text
    assert "2 processes x 1 thread(s):" in text
    assert _images(nb) >= 1


@pytest.mark.notebook
def test_notebook_03_reproduces_the_leak_and_the_guard_stops_it(tmp_path):
    nb, text = _run("03_memory_leak_reproduction.ipynb", tmp_path)
    assert "leaky: LEAK" in text and "fixed: flat" in text
    assert "guard tripped: True" in text and "stopped before step 80: True" in text
    assert "memory budget exceeded" in text
    assert "checkpoint loads: True" in text and "== the last completed step: True" in text
    assert _images(nb) == 2


@pytest.mark.notebook
def test_notebook_04_marks_the_leaky_benchmark_invalid(tmp_path):
    nb, text = _run("04_benchmark_correction.ipynb", tmp_path)
    assert "before: INVALID" in text and "after: VALID" in text
    assert "memory leak: memory after each step grows" in text
    assert "the harness rejects the leaky run" in text
    html = _html(nb)
    for row in ("Throughput (median window)", "Peak memory", "Stability", "Reproducibility",
                "Memory safety", "Verdict"):
        assert f"<td>{row}</td>" in html
