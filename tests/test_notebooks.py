"""Every notebook runs under papermill with tiny parameters, and says what it produced."""
import json

import pytest

from conftest import REPO

papermill = pytest.importorskip("papermill")

NOTEBOOKS = REPO / "notebooks"

TINY = {
    "01_train_tinystories.ipynb": dict(
        d_model=32, n_layers=1, d_state=4, vocab_size=300, seq_len=32, max_steps=8,
        micro_batch=4, effective_batch=8, eval_every=4, max_stories=60, n_samples=2,
        sample_tokens=12, warmup_steps=2),
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
    assert "out_dir" in notebook_parameters(NOTEBOOKS / name)


def _run(name, tmp_path, **extra):
    out_nb = tmp_path / name
    params = dict(TINY[name], out_dir=str(tmp_path / "run"), **extra)
    papermill.execute_notebook(str(NOTEBOOKS / name), str(out_nb), parameters=params,
                               kernel_name="python3", cwd=str(REPO), progress_bar=False)
    nb = json.loads(out_nb.read_text())
    text = "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                     for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))
    return nb, text


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
    assert any("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))
    assert (run / "checkpoint.pt").exists()
