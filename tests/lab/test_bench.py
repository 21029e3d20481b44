"""The benchmark harness's verdicts (issue 6): every failed check is named."""
import json

import pytest

from conftest import run_cli, tiny_overrides
from sonata.lab.bench import ratio, run_bench
from sonata.train.memory import too_few_steps

# big enough that one kept graph is MiBs per step (the leak detector's threshold is 256 KiB)
LEAKY_SIZE = {"model.d_model": 64, "data.seq_len": 64, "train.micro_batch": 8, "train.effective_batch": 8}


def test_clean_run_is_valid_and_keep_graph_is_invalid_for_its_memory_slope():
    clean = run_bench(tiny_overrides(**LEAKY_SIZE), steps=22)
    assert clean.verdict == "VALID", clean.reasons
    assert clean.reproducible is True and clean.nonfinite == 0 and not clean.leak
    assert clean.tok_per_s > 0 and clean.peak_mem_bytes > 0 and clean.fallbacks == 0
    assert clean.h2d_bytes_in_steps == 0
    assert len(clean.runs) == 2 and clean.runs[0]["losses"] == clean.runs[1]["losses"]
    # windows: (22 - 3 warm-up) // 5 = 3, and the figure is their median
    w = clean.runs[0]["windows_tok_per_s"]
    assert len(w) == 3 and clean.tok_per_s == sorted(w)[1]

    leaky = run_bench(tiny_overrides(**LEAKY_SIZE, **{"debug.leak": "keep_graph"}), steps=22)
    assert leaky.verdict == "INVALID" and leaky.leak
    assert leaky.mem_slope_bytes_per_step > 1 * 2**20
    assert any(r.startswith("memory leak: memory after each step grows") for r in leaky.reasons)
    assert any("debug.leak=keep_graph" in r for r in leaky.reasons)


def test_a_run_with_non_finite_losses_is_invalid():
    # direct A at a large learning rate really diverges (notebook 05): no injection needed
    rec = run_bench(tiny_overrides(**{"model.a_param": "direct", "train.lr": 1.0,
                                      "train.warmup_steps": 0}), steps=24)
    assert rec.verdict == "INVALID" and rec.nonfinite >= 1
    assert any("non-finite" in r for r in rec.reasons)
    assert any(r.startswith("run stopped early: TrainingDiverged") for r in rec.reasons)


def test_different_seeds_are_flagged_not_reproducible_where_it_is_required():
    rec = run_bench(tiny_overrides(), steps=18, seeds=(0, 1))
    assert rec.reproducible is False and rec.verdict == "INVALID"
    assert any("not reproducible" in r and "seeds 0 and 1" in r for r in rec.reasons)
    relaxed = run_bench(tiny_overrides(), steps=18, seeds=(0, 1), require_reproducible=False)
    assert relaxed.reproducible is False and relaxed.verdict == "VALID", relaxed.reasons


def test_too_few_steps_cannot_be_valid():
    rec = run_bench(tiny_overrides(), steps=4)
    assert rec.verdict == "INVALID" and rec.tok_per_s is None
    assert any("too few steps" in r for r in rec.reasons)
    # the readings notebook 04 divides: a missing one gives no ratio rather than an error
    assert ratio(rec.tok_per_s_best_window, rec.tok_per_s) is None
    assert ratio(rec.tok_per_s_with_warmup, rec.tok_per_s) is None


def test_ratio_divides_two_readings_and_is_none_when_one_is_missing_or_zero():
    assert ratio(6, 4) == 1.5 and ratio(2.0, 8) == 0.25
    for a, b in ((None, 4), (4, None), (too_few_steps(3), 4), (4, too_few_steps(3)), (4, 0), (0, 4),
                 (-1, 4), (True, 1)):
        assert ratio(a, b) is None, (a, b)


def test_step_speed_rotates_the_order_and_takes_each_ratio_within_a_round(monkeypatch):
    """The training-step study (sonata.lab.speed.step_speed, benchmarks/train_speed.py): every
    model runs once a round, the first one rotating, and a ratio is the median of the
    per-round ratios, not the ratio of the median rounds (which the machine's drift between
    rounds would move). A fake clock gives known step times."""
    from sonata.lab import speed
    seconds = {"cpu": [1.0, 2.0, 4.0], "peer-free": [1.0, 1.0, 8.0]}     # per round
    order, now = [], [0.0]

    def fake_step(name, x, y):
        def step():
            order.append(name)
            now[0] += seconds[name][sum(n == name for n in order) - 1]
        return step
    monkeypatch.setattr(speed, "step_model", lambda name, dev: name)
    monkeypatch.setattr(speed, "train_step", fake_step)
    monkeypatch.setattr(speed, "saved_bytes_per_token", lambda m, x, y: 7.0)
    monkeypatch.setattr(speed.time, "perf_counter", lambda: now[0])
    recs = speed.step_speed((2,), ("cpu", "peer-free"), rounds=3, steps=1, warmup=0)
    assert order == ["cpu", "peer-free", "peer-free", "cpu", "cpu", "peer-free"]
    tokens = 2 * speed.STEP_SEQ_LEN
    cpu, peer = recs
    assert (cpu["model"], cpu["micro_batch"], peer["model"]) == ("cpu", 2, "peer-free")
    # per-round ratios 1/1, 1/2, 8/4 -> median 1.0 (the ratio of the median rounds is 0.5)
    assert cpu["vs_peer_free"] == 1.0 and peer["vs_peer_free"] == 1.0
    assert cpu["tok_per_s"] == tokens / 2.0 and peer["tok_per_s"] == tokens / 1.0
    assert cpu["range"] == (tokens / 4.0, tokens / 1.0)
    assert cpu["vs_mambapy"] is None and cpu["saved_bytes_per_token"] == 7.0


def test_cli_bench_json_names_the_leak():
    r = run_cli("bench", "debug.leak=keep_graph", "--json",
                *tiny_overrides(**LEAKY_SIZE), "--steps", "20")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    for key in ("tok_per_s", "peak_mem_bytes", "mem_slope_bytes_per_step", "nonfinite",
                "reproducible", "verdict", "reasons"):
        assert key in rec
    assert rec["verdict"] == "INVALID"
    assert any("memory leak" in x for x in rec["reasons"])


@pytest.mark.parametrize("args, fragment", [
    (["--steps", "0"], "--steps and --window must be >= 1"),
    (["debug.leak=sometimes"], "debug.leak must be one of"),
])
def test_cli_bench_bad_input_is_one_error_line(args, fragment):
    from conftest import _assert_one_error_line
    _assert_one_error_line(run_cli("bench", *args), fragment)


@pytest.mark.parametrize("command", ["bench", "autotune"])
def test_single_process_commands_refuse_torchrun(command):
    import os
    import subprocess
    import sys

    from conftest import REPO
    from conftest import _assert_one_error_line
    r = subprocess.run([sys.executable, "-m", "sonata", command], capture_output=True, text=True,
                       cwd=REPO, timeout=120, env={**os.environ, "WORLD_SIZE": "2"})
    _assert_one_error_line(r, f"'{command}' runs in one process, not under torchrun")


def test_the_bench_judges_leaks_by_the_trainers_rule():
    """Issue 42 item 9: the bench judged growth by a fixed 256 KiB per step while the trainer
    scales its allowance with the step's tokens; a big step's memory growth within the
    trainer's allowance was a leak for the bench. One rule now: the trainer's."""
    from sonata.lab.bench import replay_leak
    from sonata.train.leak import LeakDetector, leak_threshold
    tokens = 32768                                      # notebook 08's steps: 2 MiB allowed
    rows = [{"mem_bytes": 500 * 2**20 + i * 400 * 1024 + (i % 3) * 1024, "step_tokens": tokens}
            for i in range(80)]                         # +400 KiB per step, very steady
    trainer = LeakDetector()
    for r in rows:
        trainer.follow(r["mem_bytes"], r["step_tokens"])
    bench = replay_leak(rows)
    assert leak_threshold(tokens) > 400 * 1024
    assert bench.leaking() == trainer.leaking() is False
    leaky = [dict(r, mem_bytes=r["mem_bytes"] + i * 4 * 2**20) for i, r in enumerate(rows)]
    assert replay_leak(leaky).leaking()                 # +4.4 MiB per step is a leak either way


MIB = 2**20


def _bench_heap(r, leak_per_step: float, steps: int):
    """A clean bench run's resident set as 11 configurations measured it (seed model, tiny
    models, Mamba-2, Mamba-3, attention; 24 steps each): one level jump of 4 to 17 MiB at the
    first steps, then one to three allocator jumps of 0.5 to 6 MiB at any step, and within
    +-16 KiB between them; plus `leak_per_step` bytes a step."""
    import numpy as np
    y = 600 * MIB + r.uniform(-16 * 1024, 16 * 1024, steps)
    y[1:] += r.uniform(4, 16) * MIB
    k = int(r.integers(1, 4))
    for at, jump in zip(r.integers(3, steps, k), r.uniform(0.5, 6, k)):
        y[at:] += jump * MIB
    return [{"mem_bytes": int(m), "step_tokens": 2048} for m in y + leak_per_step * np.arange(steps)]


def test_the_bench_judges_its_measured_steps_at_the_stated_threshold():
    """At the bench's default length the trainer's detector is still in its first window, where
    it allows 4x the threshold (a training run's heap settles over its first steps): the bench
    called a 0.55 MiB-per-step leak flat at 24 steps (a leak at 70) and printed 0.25 MiB as the
    threshold. The bench judges at the stated threshold: a 0.3 MiB-per-step leak is a leak in
    each of 1,000 replays of a bench run's heap, the same heap without it in none, and flat
    swings of +-20 MiB (a non-glibc heap) in none either."""
    import numpy as np

    from sonata.lab.bench import DEFAULT_STEPS, replay_leak
    from sonata.train.leak import LeakDetector
    r = np.random.default_rng(0)
    missed, false = [], []
    for i in range(1000):
        leaky = replay_leak(_bench_heap(r, 0.3 * MIB, DEFAULT_STEPS))
        assert leaky.allowance() == leaky.report()["leak_threshold_bytes_per_step"] == 256 * 1024
        if not leaky.leaking():
            missed.append(i)
        if replay_leak(_bench_heap(r, 0.0, DEFAULT_STEPS)).leaking():
            false.append(i)
        swings = 600 * MIB + r.uniform(-20, 20, DEFAULT_STEPS) * MIB
        if replay_leak([{"mem_bytes": int(m), "step_tokens": 2048} for m in swings]).leaking():
            false.append(i)
    assert missed == [] and false == [], (len(missed), len(false))
    trainer = LeakDetector()                            # the trainer keeps its settling allowance
    for row in _bench_heap(np.random.default_rng(1), 0.3 * MIB, DEFAULT_STEPS):
        trainer.follow(row["mem_bytes"], row["step_tokens"])
    assert not trainer.leaking() and trainer.allowance() == 4 * 256 * 1024


def test_a_small_real_leak_is_invalid_at_the_default_length():
    """keep_activations at micro-batch 8 x 32 tokens x 300 entries keeps 0.29 MiB of logits a
    step (the issue's case, 0.55 MiB a step, was flat for the bench at 24 steps): the memory
    reason names it and the 0.25 MiB threshold it was judged at, as the record does."""
    from sonata.lab.bench import DEFAULT_STEPS
    rec = run_bench(tiny_overrides(**{"train.micro_batch": 8, "train.effective_batch": 8,
                                      "debug.leak": "keep_activations"}), steps=DEFAULT_STEPS)
    assert rec.verdict == "INVALID" and 0.2 * MIB < rec.mem_slope_bytes_per_step < 0.4 * MIB
    assert rec.leak, rec.reasons
    assert any(r.startswith("memory leak: memory after each step grows") and r.endswith("(leak detector "
               "threshold 0.25 MiB)") for r in rec.reasons), rec.reasons
    assert rec.leak_threshold_bytes_per_step == 256 * 1024
    assert all(run["leak_threshold_bytes_per_step"] == 256 * 1024 for run in rec.runs)
