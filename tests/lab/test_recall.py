"""sonata.lab.recall (notebook 10) and the steps-first run rows it shares with notebook 08
(sonata.lab.selection): every run's config, its row's steps planned and reached, the claims
checked on measured rows, and the parity explanation's numbers."""
import math

import pytest

from sonata.core.config import make_config
from sonata.lab import recall, selection


@pytest.mark.parametrize("model", recall.RECALL_MODELS)
def test_a_recall_run_is_the_cpu_grid_point_for_its_steps_with_the_cap(model):
    cfg = make_config(recall.recall_overrides(model, 32, 700, 90.0, length=128, d_model=32, vocab=512, seed=3))
    assert (cfg.task.name, cfg.task.vocab_size, cfg.data.seq_len, cfg.model.n_layers) == ("mqar", 512, 128, 2)
    assert (cfg.model.arch, cfg.model.d_model, cfg.model.d_state) == (model, 32, 32)
    assert (cfg.train.max_steps, cfg.train.max_seconds, cfg.train.seed) == (700, 90.0, 3)
    # one recipe for every model: fewer pairs mixed into training, unit-variance untied embeddings
    assert (cfg.task.mix_pairs, cfg.model.tie_embeddings, cfg.model.embed_std) == (True, False, 1.0)
    plain = make_config(recall.recall_overrides(model, 32, 700, 90.0, length=128, d_model=32, vocab=512, recipe=False))
    assert (plain.task.mix_pairs, plain.model.tie_embeddings, plain.model.embed_std) == (False, True, 0.02)
    # constant after warm-up: a cap only ends the run, it does not change the rate of a step
    assert cfg.train.min_lr_ratio == 1.0


@pytest.mark.parametrize("task", recall.TRACK_TASKS)
@pytest.mark.parametrize("model", recall.TRACK_MODELS)
def test_a_tracking_run_trains_every_prefix_at_one_length(task, model):
    cfg = make_config(recall.track_overrides(task, model, 50, 0.0, length=32, d_model=16, d_state=8, n_layers=1))
    assert (cfg.task.name, cfg.task.running, cfg.data.seq_len, cfg.model.n_layers) == (task, True, 32, 1)
    assert make_config(recall.track_overrides(task, model, 50)).model.n_layers == 2
    assert (cfg.train.max_steps, cfg.train.max_seconds) == (50, 0.0)
    assert cfg.task.curriculum == "4:300,8:300,16:300,32"
    m = cfg.model
    assert m.arch == model.split("-")[0]
    assert (m.rope_fraction == 0.0) == (model == "mamba3-no-rotation")
    assert m.trapezoid == (model != "mamba3-euler")
    assert m.bounded_angle == (4.0 if model == "mamba3-half-turn" else 0.0)


def test_the_tracking_curriculum_leaves_out_stages_shorter_than_two():
    assert recall.track_curriculum(64) == "8:300,16:300,32:300,64"
    assert recall.track_curriculum(4) == "2:300,4"
    make_config({"task.name": "parity", "data.seq_len": 4, "task.curriculum": recall.track_curriculum(4)})


def _summary(planned, steps, cap=0.0, seconds=12.34):
    return {"planned_steps": planned, "steps": steps, "cap_s": cap, "train_seconds": seconds,
            "stopped_by": "steps" if steps >= planned else "time"}


def test_a_run_that_reached_its_plan_has_no_note_and_a_short_one_says_where_it_stopped():
    assert selection.steps_fields(_summary(300, 300)) == {"steps planned": 300, "steps": 300, "train s": 12.3,
                                                          "stopped by": "steps", "note": ""}
    short = selection.steps_fields(_summary(16300, 15197, cap=600.0))
    assert short["note"] == "stopped short: 15,197 of 16,300 steps, the 600 s cap (93% of the plan)"
    assert short["stopped by"] == "time"
    assert selection.short_runs([{"model": "a", "note": ""}, {"model": "b", "note": ""}]) == \
        "every run reached its planned steps (2 runs)"
    lines = selection.short_runs([{"model": "a", "note": ""}, {"model": "b", **short}]).splitlines()
    assert lines[0] == "b: stopped short: 15,197 of 16,300 steps, the 600 s cap (93% of the plan)"
    assert len(lines) == 2 and "lower bounds" in lines[1]


def test_selection_runs_are_defined_by_their_steps():
    o = selection.run_overrides("copying", "mamba", 36000, 1800.0)
    assert (o["train.max_steps"], o["train.max_seconds"], o["train.min_lr_ratio"]) == (36000, 1800.0, 1.0)
    assert selection.run_overrides("induction", "lti", 20)["train.max_seconds"] == 0.0   # no cap
    with pytest.raises(ValueError, match="at least 1 step"):
        selection.run_overrides("induction", "mamba", 0)


def _row(model, n, acc):
    return {"model": recall.label(model), "N": n, "accuracy": acc}


def test_the_recall_claims_are_read_from_the_rows():
    rows = [_row("mamba", 16, 0.31), _row("mamba2", 16, 0.62), _row("mamba2", 64, 0.95), _row("attention", "-", 0.99)]
    v = recall.recall_verdicts(rows)
    assert [r["holds"] for r in v] == ["yes", "yes"]
    assert v[1]["measured"] == "Mamba-2 N=64 0.950, attention 0.990"
    rows[2]["accuracy"] = 0.93                           # 6 points under attention
    assert [r["holds"] for r in recall.recall_verdicts(rows)] == ["yes", "no"]
    rows[3]["accuracy"] = 0.06                           # an attention run far under Mamba-2: no match
    assert [r["holds"] for r in recall.recall_verdicts(rows)] == ["yes", "no"]
    rows[3]["accuracy"] = 0.97
    assert [r["holds"] for r in recall.recall_verdicts(rows)] == ["yes", "yes"]
    rows[1]["accuracy"] = 0.30                           # Mamba-2 under Mamba-1 at N=16
    assert recall.recall_verdicts(rows)[0]["holds"] == "no"
    assert [r["holds"] for r in recall.recall_verdicts(rows[:1])] == ["not run", "not run"]


def _acc(length_acc):
    return [{"length": L, "accuracy": a} for L, a in length_acc]


def test_the_tracking_claims_at_four_times_the_trained_length():
    acc = {("parity", "Mamba-3"): _acc([(64, 1.0), (256, 0.97)]),
           ("parity", "Mamba-2"): _acc([(64, 1.0), (256, 0.55)]),
           ("parity", "Mamba-3, rotation off"): _acc([(64, 0.9), (256, 0.75)]),
           ("modsum", "Mamba-3, trapezoid off (Euler)"): _acc([(64, 1.0), (256, 0.94)]),
           ("modsum", "Mamba-2"): _acc([(64, 1.0)]),
           ("parity", "Mamba-3, half-turn angle"): _acc([(64, 1.0), (256, 0.94)])}
    v = recall.track_verdicts(acc, 64)
    assert [r["holds"] for r in v] == ["yes", "yes", "no", "no", "not run", "no"]
    assert v[5]["claim at 4x"] == "at least 95%"                  # the half-turn angle rotates: the paper's claim
    assert v[1]["claim at 4x"] == "near chance (50% +- 10%)" and v[3]["claim at 4x"] == "at least 95%"
    assert v[4]["measured"] == "-"
    assert recall.chance("modsum") == pytest.approx(0.2)
    table = recall.track_table(acc, 64)
    assert table[0] == {"task": "parity", "model": "Mamba-3", "64 (trained)": "100.0", "256 (4x)": "97.0"}


def test_the_seed_spread_counts_the_seeds_that_hold_at_four_times_and_leads_with_the_main_run():
    track = {("parity", "Mamba-3"): _acc([(64, 1.0), (256, 0.97)]), ("modsum", "Mamba-3"): _acc([(64, 1.0)])}
    spread = {("Mamba-3", 1): _acc([(64, 1.0), (256, 0.52)]), ("Mamba-3", 2): _acc([(64, 1.0), (256, 0.95)]),
              ("Mamba-3, half-turn angle", 1): _acc([(64, 1.0), (128, 0.99)])}
    by_seed = recall.with_seed(track, spread, "parity", ["mamba3", "mamba3-half-turn"], seed=0)
    assert list(by_seed) == [("Mamba-3", 0), ("Mamba-3", 1), ("Mamba-3", 2), ("Mamba-3, half-turn angle", 1)]
    v = recall.seed_verdicts(by_seed, 64)
    assert v == [{"model": "Mamba-3", "seeds at 95% or more at 4x": "2 of 3", "by seed": "0: 97.0%, 1: 52.0%, 2: 95.0%"},
                 {"model": "Mamba-3, half-turn angle", "seeds at 95% or more at 4x": "not run", "by seed": "-"}]
    assert recall.seed_table(by_seed, 64)[1] == {"model": "Mamba-3", "seed": 1, "64 (trained)": "100.0",
                                                 "256 (4x)": "52.0"}
    assert recall.seed_verdicts({}, 64) == []


def test_a_rotating_state_reads_parity_at_any_length_and_a_decaying_sum_never_flips():
    bits = [1, 0, 1, 1, 0, 0, 1, 1, 1, 0] * 30
    rows = recall.parity_states(bits, decay=0.9)
    assert [r["parity"] for r in rows[:4]] == [1, 1, 0, 1]
    assert all(math.isclose(r["rotating state cos"], 1 - 2 * r["parity"]) for r in rows)
    assert all(r["real state (0.9)"] >= 0 for r in rows)


@pytest.mark.slow
def test_the_runs_return_one_row_per_run_with_its_steps_and_accuracy(tmp_path):
    rows = recall.recall_runs(["mamba2", "attention"], [4, 8], 2, 0.0, length=16, d_model=16, vocab=16, n_test=4,
                              out_dir=tmp_path)
    assert [(r["model"], r["N"], r["steps planned"], r["steps"], r["note"]) for r in rows] == \
        [("Mamba-2", 4, 2, 2, ""), ("Mamba-2", 8, 2, 2, ""), ("attention (RoPE)", "-", 2, 2, "")]
    assert all(0 <= r["accuracy"] <= 1 for r in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mqar-attention", "mqar-mamba2-n4", "mqar-mamba2-n8"]
    # the ablation: one more attention row, without the recipe; none when attention is not run
    rows = recall.recall_runs(["attention"], [4], 2, 0.0, length=16, d_model=16, vocab=16, n_test=4, ablation=True)
    assert [(r["model"], r["N"], r["steps"]) for r in rows] == [("attention (RoPE)", "-", 2),
                                                                 ("attention (RoPE), no recipe", "-", 2)]
    assert len(recall.recall_runs(["mamba2"], [4], 1, 0.0, length=16, d_model=16, vocab=16, n_test=4, ablation=True)) == 1
    runs, acc = recall.track_runs(["parity"], ["mamba3-euler"], 2, 0.0, length=8, test_lengths=[8, 32],
                                  d_model=16, d_state=4, n_test=4)
    assert [(r["task"], r["model"], r["steps"]) for r in runs] == [("parity", "Mamba-3, trapezoid off (Euler)", 2)]
    assert [r["length"] for r in acc[("parity", "Mamba-3, trapezoid off (Euler)")]] == [8, 32]
    runs, acc = recall.seed_runs("parity", ["mamba3-half-turn"], [3, 5], 2, 0.0, length=8, test_lengths=[8],
                                 d_model=16, d_state=4, n_test=4, out_dir=tmp_path)
    assert [(r["model"], r["seed"], r["steps"]) for r in runs] == [("Mamba-3, half-turn angle", 3, 2),
                                                                   ("Mamba-3, half-turn angle", 5, 2)]
    assert list(acc) == [("Mamba-3, half-turn angle", 3), ("Mamba-3, half-turn angle", 5)]
    from sonata.core import checkpoint as ckpt
    c = ckpt.load(tmp_path / "parity-mamba3-half-turn-seed5" / "checkpoint.pt")["config"]
    assert (c["train"]["seed"], c["model"]["bounded_angle"]) == (5, 4.0)


def test_notebook_10s_parameters_out_of_range_are_one_line():
    from sonata.lab.notebook import ParameterError, check
    with pytest.raises(ParameterError) as e:
        check("10_recall_and_state", {"mqar_states": [16, 2]})
    assert str(e.value) == ("parameter mqar_states = [16, 2] holds 2, which is out of range; allowed: 1 to 4 values, "
                            "each range 4..128")
    with pytest.raises(ParameterError, match=r"^parameter mqar_d_model = 48 is not allowed; allowed: one of 16 \| 32"):
        check("10_recall_and_state", {"mqar_d_model": 48})
    check("10_recall_and_state", {"mqar_vocab": 8, "mqar_length": 8})          # 3 keys for 2 pairs
    check("10_recall_and_state", {"mqar_vocab": 8192, "mqar_length": 256})
    check("10_recall_and_state", {"spread_models": [], "spread_seeds": []})     # no spread: allowed
    with pytest.raises(ParameterError, match=r"^parameter spread_seeds = \[-1\] holds -1, which is out of range"):
        check("10_recall_and_state", {"spread_seeds": [-1]})
