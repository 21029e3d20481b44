"""sonata.lab.table5b (notebook 11): every (task, model) run's config is the paper's protocol at
CPU size and builds a valid model; the scaled accuracy, the table's medians and ranges over
seeds, and the claims, checked on made-up rows; one real run end to end."""
import pytest

from sonata.core.config import make_config
from sonata.lab import table5b
from sonata.model import families


@pytest.mark.parametrize("task", table5b.TASKS)
@pytest.mark.parametrize("model", table5b.MODELS)
def test_every_run_is_the_papers_protocol_and_a_valid_model(task, model):
    cfg = families.validate(make_config(table5b.overrides(task, model, 700, 60.0, length=40, d_model=32,
                                                          d_state=64, seed=5)))
    assert (cfg.task.name, cfg.data.seq_len, cfg.model.d_model, cfg.model.d_state) == (task, 40, 32, 64)
    assert cfg.model.n_layers == (1 if task == "parity" else 3)
    assert cfg.task.running == (task != "arith_brackets")
    assert cfg.task.modulus == 5 or task == "parity"
    assert cfg.task.curriculum == "5:300,10:300,20:300,40"
    assert (cfg.train.max_steps, cfg.train.max_seconds, cfg.train.seed, cfg.train.min_lr_ratio) == (700, 60.0, 5, 1.0)
    assert cfg.model.mimo_rank == (4 if model == "mamba3-mimo4" else 1)
    assert cfg.model.allow_neg_eigval == (model == "gdn-neg")
    assert cfg.model.mamba3_form == "released"


def test_scaled_accuracy_is_zero_at_chance_and_a_hundred_when_all_right():
    assert table5b.scaled(0.5, 0.5) == 0 and table5b.scaled(1.0, 0.2) == 100
    assert table5b.scaled(0.6, 0.2) == pytest.approx(50.0)
    assert table5b.chance("parity") == 0.5 and table5b.chance("arith") == table5b.chance("arith_brackets") == 0.2


def _rows(acc_at_256, acc_at_40=1.0):
    return [{"length": 40, "accuracy": acc_at_40}, {"length": 256, "accuracy": acc_at_256}]


def test_the_table_gives_the_median_and_range_over_seeds_and_the_claims_read_it():
    acc = {("parity", "mamba3", 0): _rows(1.0), ("parity", "mamba3", 1): _rows(0.75),
           ("parity", "mamba3", 2): _rows(0.95), ("parity", "mamba2", 0): _rows(0.52),
           ("arith", "mamba3", 0): _rows(0.6), ("parity", "gdn-neg", 0): _rows(0.99)}
    rows = {r["model"]: r for r in table5b.table(acc, 256)}
    assert rows["Mamba-3 SISO"]["parity"] == "90.0 (50.0..100.0, 3 seeds)"
    assert rows["Mamba-3 SISO"]["arith. w/o brackets"] == "50.0"
    assert rows["Mamba-2"]["parity"] == "4.0" and rows["Mamba-2"]["arith. w/o brackets"] == "-"
    claims = {(c["task"], c["model"]): c for c in table5b.verdicts(acc, 256)}
    assert claims[("parity", "Mamba-3 SISO")]["holds"] == "yes"          # median 90 >= 90
    assert claims[("arith. w/o brackets", "Mamba-3 SISO")]["holds"] == "no"
    assert claims[("parity", "Mamba-2")]["holds"] == "yes"                # 4 within 10 of chance
    assert claims[("parity", "Gated DeltaNet [0, 1]")]["holds"] == "not run"
    assert claims[("arith. w/ brackets", "Gated DeltaNet [-1, 1]")]["measured"] == "-"
    assert ("arith. w/o brackets", "Mamba-2") not in claims               # the failures are parity's claim
    curves = table5b.by_length(acc, "parity", 0)
    assert curves["Mamba-3 SISO"] == [(40, 1.0), (256, 1.0)] and "Mamba-2" in curves


def test_the_papers_rows_name_every_column():
    cols = {table5b.column(t) for t in table5b.TASKS}
    for row in table5b.PAPER_5B:
        assert set(row) == {"model"} | cols


def test_a_run_trains_and_scores_every_test_length(tmp_path):
    rows, acc = table5b.runs(["arith_brackets"], ["gdn-neg"], [3], steps=2, length=8, test_lengths=(8, 16),
                             d_model=16, d_state=8, n_test=4, out_dir=str(tmp_path))
    assert [(r["task"], r["model"], r["seed"], r["steps"]) for r in rows] == \
        [("arith_brackets", "Gated DeltaNet [-1, 1]", 3, 2)]
    assert [r["length"] for r in acc[("arith_brackets", "gdn-neg", 3)]] == [8, 16]
    assert (tmp_path / "arith_brackets-gdn-neg-seed3" / "checkpoint.pt").exists()
