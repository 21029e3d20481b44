"""Every notebook runs under papermill with tiny parameters, and says what it produced;
at the smallest allowed values it still finishes, and a value outside its range stops
it with one line naming the parameter, its value and the range."""
import json
import re

import pytest

from conftest import REPO
from sonata.core.checkpoint import load as load_checkpoint
from sonata.lab.notebook import RANGES, CommaInts, Curriculum, ListOf, OneOf, ParameterError, Range, Text, check

papermill = pytest.importorskip("papermill")

NOTEBOOKS = REPO / "notebooks"

TINY = {
    "00_selective_scan_kernels.ipynb": dict(
        batch=2, d_inner=5, d_state=4, seq_len=9, time_sizes=["small"], time_repeat=1, threads=1,
        step_batches=[1], step_rounds=1, step_steps=1),
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
    "06_generate.ipynb": dict(max_new_tokens=20, n_samples=2, fallback_steps=2),
    "07_ten_minute_speedrun.ipynb": dict(budget_s=2, data_source="embedded", configs=["sonata", "gpt2-lr3e-3"],
                                         curve_points=2),
    # copying: more steps than its 1 s cap allows (each copying run stops short and says so)
    "08_selection.ipynb": dict(task_cap_s=600, induction_steps=20, induction_curriculum="8:10,16", long_steps=3,
                               long_curriculum="32:2,64", long_cap_s=600, archs=["mamba", "lti", "attention"],
                               ablations=["default-dt", "fixed-64"], test_lengths=[16, 32], long_lengths=[64],
                               n_test=4, n_long=2, attention_eval_s=5, copy_region=16, copy_steps=1_000_000,
                               copy_cap_s=1),
    "10_recall_and_state.ipynb": dict(mqar_models=["mamba", "mamba2", "mamba3", "attention"], mqar_states=[4, 8],
                                      mqar_length=16, mqar_vocab=16, mqar_d_model=16, mqar_steps=3,
                                      track_tasks=["parity", "modsum"], track_length=8, track_lengths=[8, 32],
                                      track_d_model=16, track_d_state=4, track_steps=3, spread_seeds=[1], n_test=4),
    "11_state_tracking_table.ipynb": dict(models=["mamba2", "mamba3-mimo4", "gdn-neg", "attention"], steps=3,
                                          length=8, test_lengths=[8, 16], d_model=16, d_state=8, n_test=4,
                                          spread_seeds=[1]),
    "09_mamba2_ssd.ipynb": dict(duality_length=40, block_length=32, block_chunk=8, lengths=[32, 64],
                                time_repeat=1, states=[8, 16], cost_length=32, race_steps=3, race_d_model=16,
                                race_seq_len=16, race_batch=2),
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


def _run(name, tmp_path, tiny=True, **extra):
    out_nb = tmp_path / name
    params = dict(TINY[name] if tiny else {}, **extra)
    if "out_dir" in notebook_parameters(NOTEBOOKS / name):
        params["out_dir"] = str(tmp_path / "run")
    if "checkpoint" in notebook_parameters(NOTEBOOKS / name):
        params.setdefault("checkpoint", str(tmp_path / "missing.pt"))
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
def test_notebook_01_takes_the_defaults_of_real_text(tmp_path):
    """Parameters left at 0 on real text (any source but the embedded corpus): notebook
    07's race winner (vocabulary 2048, lr 6e-3, weight decay 0.3, 4 windows of 512 tokens,
    precision fast: bf16 where the CPU multiplies it natively, a time budget with no step cap)."""
    from sonata.core.device import cpu_bf16_native
    stories = tmp_path / "stories.txt"
    stories.write_text((REPO / "data" / "stories.txt").read_text())
    nb, text = _run("01_train_tinystories.ipynb", tmp_path, data_source=str(stories), vocab_size=0, lr=0.0,
                    max_steps=0, max_seconds=1.0, eval_every=0, n_samples=0, seq_len=0, effective_batch=0,
                    micro_batch=0)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "vocabulary 2,048, peak lr 0.006, a 1 s time budget" in text
    assert (summary["max_seconds"], summary["stopped_by"]) == (1.0, "time")
    assert summary["plan"]["precision"] == ("bf16" if cpu_bf16_native() else "fp32")
    cfg = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["config"]
    assert (cfg["data"]["vocab_size"], cfg["data"]["seq_len"], cfg["train"]["effective_batch"], cfg["train"]["lr"],
            cfg["train"]["weight_decay"], cfg["train"]["max_steps"], cfg["train"]["precision"]) == \
        (2048, 512, 4, 6e-3, 0.3, 0, "fast")


@pytest.mark.notebook
def test_notebook_01_defaults_print_the_committed_outputs(tmp_path):
    """Notebook 01 at its defaults, but a 1 s budget: the cells tagged nbval-check-output
    (the corpus summary and the model with its parameter count) print what the committed
    notebook shows. nbval does not run notebook 01 (its default is 1,500 steps of training)."""
    name = "01_train_tinystories.ipynb"
    nb, _ = _run(name, tmp_path, tiny=False, max_seconds=1.0)

    def checked(nb):
        return ["".join(o.get("text", "")) for c in nb["cells"]
                if "nbval-check-output" in c.get("metadata", {}).get("tags", [])
                for o in c.get("outputs", []) if o.get("output_type") == "stream"]

    committed = checked(json.loads((NOTEBOOKS / name).read_text()))
    assert len(committed) == 2 and "parameters: " in committed[1]
    assert checked(nb) == committed
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["max_seconds"] == 1.0


@pytest.mark.notebook
def test_notebook_00_checks_every_backend(tmp_path):
    nb, text = _run("00_selective_scan_kernels.ipynb", tmp_path)
    assert "all backends agree with the float64 reference: True" in text
    env = json.loads(next(ln for ln in text.splitlines() if ln.startswith('{"python"')))
    assert env["triton_interpreter"] is True or env["device"] != "cpu"   # triton ran, not fell back
    html = _html(nb)
    assert "<td>triton</td>" in html and "<td>cpu</td>" in html and "<td>mambapy</td>" in html
    # the training-step table: the peer against itself is 1.00x; sonata's row has its own ratio
    ratios = dict(re.findall(r"<td>(cpu|peer-free)</td>(?:<td>[^<]*</td>)*?<td>([\d.]+)x</td>", html))
    assert ratios.get("peer-free") == "1.00" and 0 < float(ratios["cpu"]) < 20, ratios


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


@pytest.mark.notebook
def test_notebook_06_trains_a_fallback_and_prints_samples(tmp_path):
    nb, text = _run("06_generate.ipynb", tmp_path)
    assert f"{tmp_path / 'missing.pt'} is missing (notebook 01 and `make train` write it): training a small model" in text
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    samples = re.findall(r"--- sample (\d) \(seed (\d)\)\n(.*)", text)
    assert [(n, s) for n, s, _ in samples] == [("1", "0"), ("2", "1")]
    assert samples[0][2].startswith("Once upon a time") and samples[1][2].startswith("One day, a little girl")
    assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                   for c in nb["cells"] for o in c.get("outputs", []))


@pytest.mark.notebook
def test_notebook_07_races_sonata_against_the_gpt_under_the_budget(tmp_path):
    nb, text = _run("07_ten_minute_speedrun.ipynb", tmp_path)
    assert "data: the embedded corpus (data/stories.txt)" in text
    html = _html(nb)
    for name in ("sonata", "gpt2-lr3e-3"):
        assert f"<td>{name}</td>" in html
        summary = json.loads((tmp_path / "run" / name / "summary.json").read_text())
        assert summary["max_seconds"] == 2 and summary["stopped_by"] == "time" and summary["steps"] > 0
        assert f"<td>{summary['val_bpb']:.4f}".rstrip("0") in html
    assert "<th>train bpb</th>" in html and "<th>gap</th>" in html and "<th>epochs</th>" in html
    assert "<th>positions 0-7</th>" in html and "<th>positions 32-127</th>" in html
    line = re.search(r"best sonata: sonata (\d\.\d{4}) bits per byte .* best GPT-2: gpt2-lr3e-3 (\d\.\d{4}) .*: "
                     r"(sonata|GPT-2) wins by (\d\.\d{4}) bits per byte", text)
    assert line, text[-2000:]
    ours, gpt, margin = float(line.group(1)), float(line.group(2)), float(line.group(4))
    assert line.group(3) == ("sonata" if ours < gpt else "GPT-2") and abs(margin - abs(ours - gpt)) < 2e-4
    assert _images(nb) == 2                       # the curve and the loss by position


@pytest.mark.notebook
def test_notebook_09_shows_the_duality_the_blocks_the_times_and_the_race(tmp_path):
    nb, text = _run("09_mamba2_ssd.ipynb", tmp_path)
    for form in ("recurrence (float64, the oracle)", "masked quadratic form, M x (float64)",
                 "chunked, Q=64 (the paper's listing, float64)", "chunked, Q=64 (sonata's CPU fast path, float32)"):
        assert form in text, form
    worst = float(re.search(r"every form is within (\S+) of the recurrence", text).group(1))
    assert worst < 1e-4
    m = re.search(r"the (\d+) blocks below the diagonal have rank at most (\d+) \(N = 4\)", text)
    assert m and int(m.group(1)) == 6 and int(m.group(2)) <= 4          # 4 chunks: 6 blocks below
    assert "at L = 64 the chunked form takes" in text
    for n in (8, 16):
        assert f"N = {n}: Mamba-1 " in text
    for row in ("mamba1-n16", "mamba2-n16", "mamba2-n64", "hybrid-n64"):
        assert row in text, row
    assert "mamba2,attention" in text and "after 3 steps of 2 x 16 tokens: lowest validation bits per byte" in text


def test_speedrun_falls_back_to_the_embedded_corpus_and_says_so(monkeypatch):
    from sonata.lab.race import speedrun_source
    monkeypatch.delenv("SONATA_TINYSTORIES", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")        # no local copy of the hub dataset either
    monkeypatch.setenv("HF_DATASETS_CACHE", "/nonexistent-hf-home/datasets")
    source, note = speedrun_source("tinystories")
    assert source == "embedded"
    assert note.startswith("data: TinyStories is not available here (cannot load roneneldan/TinyStories from "
                           "the Hugging Face hub (offline)") and note.endswith("using the embedded corpus instead")
    monkeypatch.setenv("SONATA_TINYSTORIES", str(REPO / "data" / "stories.txt"))
    assert speedrun_source("tinystories") == ("tinystories", f"data: TinyStories ({REPO / 'data' / 'stories.txt'})")
    assert speedrun_source("embedded") == ("embedded", "data: the embedded corpus (data/stories.txt)")


def test_speedrun_budget_range_ends():
    for ok in (1, 1.0, 600, 7200):
        check("07_ten_minute_speedrun", {"budget_s": ok})
    for bad in (0.99, 7200.5, -1):
        with pytest.raises(ParameterError, match=rf"^parameter budget_s = {bad} is out of range; "
                                                 r"allowed: range 1\.\.7200$"):
            check("07_ten_minute_speedrun", {"budget_s": bad})
    with pytest.raises(ParameterError, match=r"^parameter configs = \['default', 'huge'\] holds 'huge', "
                                             r"which is not allowed"):
        check("07_ten_minute_speedrun", {"configs": ["default", "huge"]})
    check("07_ten_minute_speedrun", {"configs": ["sonata", "gpt2-lr1e-2", "default"]})   # both studies' names
    with pytest.raises(ParameterError, match=r"^parameter data_source = 'hub' is not allowed; "
                                             r"allowed: one of embedded \| tinystories$"):
        check("07_ten_minute_speedrun", {"data_source": "hub"})


@pytest.mark.notebook
def test_notebook_08_trains_each_architecture_and_scores_it_by_length(tmp_path):
    nb, text = _run("08_selection.ipynb", tmp_path)
    assert "induction heads (length 48; S = 15):" in text and "answers at the markers:" in text
    for name in ("Mamba (selective)", "time-invariant (lti)", "attention (RoPE)", "MHA-RoPE (paper)",
                 "Mamba after the second phase", "S6 (selective), paper", "state precision",
                 "Mamba, no curriculum: every step at length 64", "delta A/noise, best channel"):
        assert name in text, name
    assert "second phase: 3 of 3 steps" in text
    assert "selective copying, Mamba (selective):" in text
    # the induction runs, the second phase and the ablations reached their plan; each copying run
    # stopped short of its 1,000,000 steps on its 1 s cap, and says so in its row and at the end
    assert "every run reached its planned steps (3 runs)" in text
    for name in ("Mamba (selective)", "time-invariant (lti)", "attention (RoPE)"):
        assert re.search(rf"{re.escape(name)}: stopped short: [\d,]+ of 1,000,000 steps, the 1 s cap", text), name
    assert "Mamba, second phase" in text and "steps planned" in text
    for run in ("induction-mamba", "induction-mamba-long", "induction-mamba-fixed-64"):
        assert json.loads((tmp_path / "run" / run / "summary.json").read_text())["steps"] == (3 if "long" in run else 20)
    assert _images(nb) == 3                      # accuracy by length, delta and write heatmaps
    for run in ("induction-mamba", "induction-lti", "induction-attention", "induction-mamba-long",
                "induction-mamba-default-dt", "induction-mamba-fixed-64", "copying-mamba"):
        assert (tmp_path / "run" / run / "checkpoint.pt").exists(), run


@pytest.mark.notebook
def test_notebook_10_trains_recall_against_n_and_state_tracking_by_length(tmp_path):
    nb, text = _run("10_recall_and_state.ipynb", tmp_path)
    # MQAR: Mamba-1, -2, -3 at N 4 and 8, attention once; 3 steps each, all reached
    for run in ("mqar-mamba-n4", "mqar-mamba2-n8", "mqar-mamba3-n4", "mqar-attention", "mqar-attention-no-recipe",
                "parity-mamba2", "modsum-mamba3-euler", "parity-mamba3-no-rotation"):
        assert json.loads((tmp_path / "run" / run / "summary.json").read_text())["steps"] == 3, run
    from sonata.core import checkpoint as ckpt
    for run, recipe in (("mqar-attention", True), ("mqar-attention-no-recipe", False)):
        c = ckpt.load(tmp_path / "run" / run / "checkpoint.pt")["config"]
        assert (c["task"]["mix_pairs"], c["model"]["tie_embeddings"], c["model"]["embed_std"]) == \
            ((True, False, 1.0) if recipe else (False, True, 0.02)), run
    assert "every run reached its planned steps (8 runs)" in text          # the MQAR table, the ablation too
    assert "attention (RoPE), no recipe" in text
    assert "every run reached its planned steps (20 runs)" in text         # the end: 8 + 10 + the spread's 2
    for run in ("parity-mamba3-half-turn", "parity-mamba3-seed1", "parity-mamba3-half-turn-seed1"):
        assert json.loads((tmp_path / "run" / run / "summary.json").read_text())["steps"] == 3, run
    assert re.search(r"parity at 4x the trained length across seeds, Mamba-3, half-turn angle: at least 95% at "
                     r"[0-2] of 2 seeds \(0: \d+\.\d%, 1: \d+\.\d%\)", text)
    for line in ("Mamba-2 above Mamba-1 at N=16", "far above Mamba-1 at N=16", "8 (trained)", "32 (4x)",
                 "Mamba-3, trapezoid off (Euler)", "rotating state cos", "steps planned"):
        assert line in text, line
    # N=16 was not run: the claim that needs it says so; the 4x claims are read at 32
    assert "MQAR, Mamba-2 above Mamba-1 at N=16: not run (-)" in text
    assert re.search(r"parity, Mamba-3, at 4x the trained length: at least 95%\? (yes|no) \(\d+\.\d%\)", text)
    assert _images(nb) == 3                     # accuracy against N; parity and modsum by length


@pytest.mark.notebook
def test_notebook_11_runs_the_state_tracking_table_beside_the_papers(tmp_path):
    nb, text = _run("11_state_tracking_table.ipynb", tmp_path)
    # 3 tasks x 4 models at seed 0, then parity again at seed 1: 16 runs of 3 steps, all reached
    for run in ("parity-mamba2-seed0", "arith-mamba3-mimo4-seed0", "arith_brackets-gdn-neg-seed0",
                "arith_brackets-attention-seed0", "parity-gdn-neg-seed1"):
        assert json.loads((tmp_path / "run" / run / "summary.json").read_text())["steps"] == 3, run
    assert "every run reached its planned steps (16 runs)" in text
    assert "scaled accuracy (%) at length 16, trained at 8" in text
    for line in ("Mamba-3 MIMO R=4", "Gated DeltaNet [-1, 1]", "arith. w/ brackets", "Mamba-3 w/ standard RoPE",
                 "98.51", "2 seeds)"):
        assert line in text, line
    assert re.search(r"parity, Gated DeltaNet \[-1, 1\]: at least 90 scaled at 16\? (yes|no) \(-?\d+\.\d\)", text)
    assert "parity, Mamba-3 SISO: at least 90 scaled at 16? not run (-)" in text
    assert _images(nb) == 3                     # accuracy by length, one plot per task


# ---- parameters: ranges stated, checked, and every value inside them runs

def _smallest(spec):
    if isinstance(spec, Range):
        return spec.lo
    if isinstance(spec, OneOf):
        return spec.choices[0]
    if isinstance(spec, CommaInts):
        return ",".join([str(_smallest(spec.item))] * spec.min_len)
    if isinstance(spec, Curriculum):
        return "4"                                  # one stage: the shortest sequence a task has
    if isinstance(spec, ListOf):
        return [_smallest(spec.item)] * spec.min_len
    return None


def _parameter_lines(path):
    nb = json.loads(path.read_text())
    i = next(i for i, c in enumerate(nb["cells"]) if "parameters" in c["metadata"].get("tags", []))
    # a notebook saved by papermill with parameters has their cell next: the check follows it
    j = i + 1 + ("injected-parameters" in nb["cells"][i + 1]["metadata"].get("tags", []))
    return "".join(nb["cells"][i]["source"]).splitlines(), "".join(nb["cells"][j]["source"])


@pytest.mark.parametrize("name", sorted(TINY))
def test_parameters_cell_states_every_range_and_the_check_follows_it(name):
    lines, next_cell = _parameter_lines(NOTEBOOKS / name)
    ranges = RANGES[name[:-len(".ipynb")]]
    seen = set()
    for ln in lines:
        m = re.fullmatch(r"(\w+): (\w+) = (.+?)  # (.+)", ln)
        assert m, f"{name}: {ln!r} is not `name: type = value  # help`"
        seen.add(m.group(1))
        spec = ranges[m.group(1)]
        if not isinstance(spec, Text):
            assert m.group(4).endswith(f"({spec.describe()})"), ln
    assert seen == set(ranges)
    assert f'check("{name[:-len(".ipynb")]}", globals())' in next_cell


def test_the_notebooks_page_states_the_ranges():
    readme = (REPO / "docs" / "notebooks.md").read_text()
    for nb, ranges in RANGES.items():
        row = next((ln for ln in readme.splitlines() if ln.startswith(f"| `{nb}` |")), "").replace("\\|", "|")
        for pname, spec in ranges.items():
            if not isinstance(spec, Text):
                assert f"`{pname}` {spec.describe()}" in row, (nb, pname)


@pytest.mark.parametrize("values, line", [
    (dict(max_steps=-1), "parameter max_steps = -1 is out of range; allowed: 0 or range 1..1000000"),
    (dict(max_steps=1_000_001), "parameter max_steps = 1000001 is out of range; allowed: 0 or range 1..1000000"),
    (dict(max_steps=2.5), "parameter max_steps = 2.5 is not an integer; allowed: 0 or range 1..1000000"),
    (dict(max_steps=True), "parameter max_steps = True is not an integer; allowed: 0 or range 1..1000000"),
    (dict(lr=2.0), "parameter lr = 2.0 is out of range; allowed: 0 or range 1e-06..1"),
    (dict(max_seconds=0.5), "parameter max_seconds = 0.5 is out of range; allowed: 0 or range 1..86400"),
    (dict(vocab_size=65537), "parameter vocab_size = 65537 is out of range; allowed: 0 or range 258..65536"),
    (dict(max_stories=1), "parameter max_stories = 1 is out of range; allowed: 0 or range 2..10000000"),
    (dict(backend="gpu"), "parameter backend = 'gpu' is not allowed; allowed: one of auto | reference | cpu | triton"),
    (dict(micro_batch=3, effective_batch=16, data_source="embedded"),
     "parameter micro_batch = 3 does not divide effective_batch = 16 (0, or a divisor of effective_batch; "
     "effective_batch 0 is the data's: 16 on the embedded corpus, 4 on real text)"),
    (dict(micro_batch=8, effective_batch=0, data_source="tinystories"),
     "parameter micro_batch = 8 does not divide effective_batch = 0 (0, or a divisor of effective_batch; "
     "effective_batch 0 is the data's: 16 on the embedded corpus, 4 on real text)"),
])
def test_check_names_the_parameter_its_value_and_the_range(values, line):
    with pytest.raises(ParameterError) as e:
        check("01_train_tinystories", values)
    assert str(e.value) == line
    assert e.value._render_traceback_() == [f"error: {line}"]     # what Jupyter shows: no traceback


def test_check_lists_and_comma_lists():
    with pytest.raises(ParameterError, match=r"^parameter lrs = \[0\.1, 20\] holds 20, which is out of range; "
                                             r"allowed: 1 to 10 values, each range 1e-06\.\.10$"):
        check("05_contracting_dynamics", dict(lrs=[0.1, 20]))
    with pytest.raises(ParameterError, match=r"^parameter lrs = \[\] has the wrong number of values"):
        check("05_contracting_dynamics", dict(lrs=[]))
    with pytest.raises(ParameterError, match=r"^parameter candidates = '1,x' is not a comma-separated list"):
        check("02_autotuning", dict(candidates="1,x"))
    with pytest.raises(ParameterError, match=r"^parameter scaling_processes = \[1, 3\] has a process count that "
                                             r"does not divide effective_batch = 16"):
        check("02_autotuning", dict(scaling_processes=[1, 3], effective_batch=16))
    with pytest.raises(ParameterError) as e:
        check("02_autotuning", dict(candidates="3,64", effective_batch=16, profile="cpu"))
    assert str(e.value) == ("parameter candidates = '3,64' has no micro-batch that divides effective_batch = 16 "
                            "within the cap of profile 'cpu' (1 always does)")
    check("02_autotuning", dict(candidates="3,8", effective_batch=16, profile="laptop-8gb"))
    for name, ranges in RANGES.items():      # the smallest and the defaults pass
        check(name, {k: _smallest(s) for k, s in ranges.items() if _smallest(s) is not None})


# The smallest allowed value of every parameter, except max_stories (0 means all the
# stories: its smallest positive value is used) and paths (into tmp_path).
SMALLEST = {nb: {k: (2 if k == "max_stories" else _smallest(s)) for k, s in r.items() if _smallest(s) is not None}
            for nb, r in RANGES.items()}
# What each notebook says when its runs are too short to judge something.
TOO_SHORT = {
    "01_train_tinystories": ["sustained tokens/s: too few steps to judge: need at least 3"],
    "02_autotuning": ["of which batch size alone (steps only, peak vs sustained): too few steps to judge: need at least 3",
                      "one process count measured: nothing to compare"],
    "03_memory_leak_reproduction": ["leaky: too few steps to judge: need at least 18",
                                    "growth over a 1,000-step run: too few steps to judge: need at least 18"],
    "04_benchmark_correction": ["before: INVALID", "after: INVALID",
                                " - memory leak: too few steps to judge: need at least 18 (1 done)"],
}


@pytest.mark.notebook
@pytest.mark.parametrize("name", sorted(RANGES))
def test_smallest_allowed_values_run_to_the_end(name, tmp_path):
    params = dict(SMALLEST[name])
    if "out_dir" in RANGES[name]:
        params["out_dir"] = str(tmp_path / "run")
    if name == "06_generate":
        params["checkpoint"] = str(tmp_path / "missing.pt")
    out = tmp_path / f"{name}.ipynb"
    papermill.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out), parameters=params,
                               kernel_name="python3", cwd=str(REPO), progress_bar=False)
    nb = json.loads(out.read_text())
    text = "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                     for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))
    for line in TOO_SHORT.get(name, []):
        assert line in text, line


# One value outside its range per notebook, and the exact line it stops with.
OUT_OF_RANGE = {
    "00_selective_scan_kernels": ("seq_len", 0, "parameter seq_len = 0 is out of range; allowed: range 1..8192"),
    "01_train_tinystories": ("max_steps", -1, "parameter max_steps = -1 is out of range; allowed: 0 or range 1..1000000"),
    "02_autotuning": ("candidates", "0,2", "parameter candidates = '0,2' holds 0, which is out of range; allowed: "
                                           "comma-separated, 1 to 16 values, each range 1..256"),
    "03_memory_leak_reproduction": ("leak", "none", "parameter leak = 'none' is not allowed; allowed: one of "
                                                    "keep_graph | keep_activations"),
    "04_benchmark_correction": ("window", 0, "parameter window = 0 is out of range; allowed: range 1..1000"),
    "05_contracting_dynamics": ("lrs", [0.1, 20.0], "parameter lrs = [0.1, 20.0] holds 20.0, which is out of "
                                                    "range; allowed: 1 to 10 values, each range 1e-06..10"),
    "06_generate": ("temperature", 6.0, "parameter temperature = 6.0 is out of range; allowed: range 0..5"),
    "07_ten_minute_speedrun": ("budget_s", 0.5, "parameter budget_s = 0.5 is out of range; allowed: range 1..7200"),
    "09_mamba2_ssd": ("race_models", ["mamba2-n16", "mamba3"], "parameter race_models = ['mamba2-n16', 'mamba3'] "
                      "holds 'mamba3', which is not allowed; allowed: 1 to 4 values, each one of mamba1-n16 | "
                      "mamba2-n16 | mamba2-n64 | hybrid-n64"),
    "10_recall_and_state": ("mqar_vocab", 16, "parameter mqar_vocab = 16 has too few keys for mqar_length = 64: "
                            "its mqar_length / 4 pairs need distinct keys, mqar_vocab / 2 - 1 of them"),
    "11_state_tracking_table": ("models", ["mamba3", "mamba"], "parameter models = ['mamba3', 'mamba'] holds "
                                "'mamba', which is not allowed; allowed: 1 to 7 values, each one of mamba2 | mamba3 | "
                                "mamba3-mimo4 | mamba3-dt1 | gdn | gdn-neg | attention"),
    "08_selection": ("long_curriculum", "64,128", "parameter long_curriculum = '64,128' is not length:steps pairs "
                                                  "then a last length; allowed: length:steps pairs, then a last length"),
}


@pytest.mark.notebook
@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_a_value_out_of_range_stops_with_one_line(name, tmp_path):
    pname, value, line = OUT_OF_RANGE[name]
    out = tmp_path / f"{name}.ipynb"
    with pytest.raises(papermill.PapermillExecutionError) as e:
        papermill.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out), parameters={pname: value},
                                   kernel_name="python3", cwd=str(REPO), progress_bar=False)
    assert (e.value.ename, e.value.evalue) == ("ParameterError", line)
    errors = [o for c in json.loads(out.read_text())["cells"] for o in c.get("outputs", [])
              if o["output_type"] == "error"]
    assert [o["traceback"] for o in errors] == [[f"error: {line}"]]     # one line, no traceback


def test_live_loss_curve_redraws_at_most_every_interval_and_ends_with_the_validation_points():
    from sonata.lab.plots import LiveLossCurve

    class Run:
        history = []
    live = LiveLossCurve(every_s=3600, live=True)
    rows = [{"step": i, "loss": 5.0 - 0.1 * i} for i in range(1, 7)]
    for r in rows:
        live(Run, r)
        Run.history.append(r)
    assert live.draws == 1                    # the first step, then nothing for an hour
    rows[2]["val_loss"], rows[5]["val_loss"] = 4.5, 4.2
    fig = live.close(rows)
    assert live.draws == 2
    train, smooth, val = fig.axes[0].get_lines()
    assert list(train.get_xdata()) == [1, 2, 3, 4, 5, 6] and list(val.get_ydata()) == [4.5, 4.2]
    assert LiveLossCurve(live=False).live is False


def test_generation_panel_streams_the_story_of_its_settings():
    import html as html_mod

    from conftest import tiny_overrides
    from sonata.core.config import make_config
    from sonata.lab.generate import stream_text
    from sonata.lab.notebook import generation_panel, interactive_frontend
    from sonata.train.trainer import Trainer

    tr = Trainer(make_config(tiny_overrides()), None, progress="none")
    panel = generation_panel(tr.model, tr.corpus.vocab, "Once upon", max_new_tokens=15, temperature=0.0, top_k=0)
    panel.generate()
    expected = "".join(stream_text(tr.model, tr.corpus.vocab, "Once upon", 15, 0.0, 0, 0))
    assert panel.story.value == (f"<div style='white-space: pre-wrap'><b>Once upon</b>"
                                 f"{html_mod.escape(expected)}</div>")
    assert panel.status.value.startswith("done: ") and panel.status.value.endswith(", seed 0")
    assert interactive_frontend() is False        # no person's frontend under pytest


def test_progress_line_in_jupyter_is_plain_text_updated_in_place(monkeypatch):
    import IPython.display
    from sonata.core.progress import Progress
    shown = []

    class Handle:
        def update(self, obj, **kw):
            shown.append((obj, kw))

    def display(obj, **kw):
        shown.append((obj, kw))
        return Handle()
    monkeypatch.setattr(IPython.display, "display", display)
    p = Progress(4, "train", mode="display")
    for _ in range(4):
        p.update(1, loss=3.25)
    p.close()
    # raw text/plain: a str would be shown as its repr, in quotes
    assert all(kw.get("raw") is True and set(obj) == {"text/plain"} for obj, kw in shown)
    # the first update and the last are shown; those in between wait DISPLAY_EVERY_S
    assert shown[0][1]["display_id"] is True and len(shown) == 3
    assert re.fullmatch(r"train: 4/4 \(100%\) +[\d.]+s  loss 3\.25", shown[-1][0]["text/plain"])
    shown.clear()
    p = Progress(1000, "train", mode="display")
    for _ in range(600):                       # stopped early: close shows where it stopped
        p.update(1)
    p.close()
    assert 2 <= len(shown) < 50 and shown[-1][0]["text/plain"].startswith("train: 600/1000 ")
