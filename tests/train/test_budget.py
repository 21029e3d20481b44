"""A time-budgeted run (train.max_seconds) through the trainer: it stops by time with the
learning rate at its floor, the step cap still wins when it comes first, bad values are one
error line, a budgeted checkpoint resumes in steps, and the summary says where the time went.
(The schedule's own functions: test_schedule.py.)"""
import json

import pytest

from conftest import _assert_one_error_line, run_cli, tiny_overrides
from sonata.core import checkpoint as ckpt
from sonata.core.config import Config, apply_overrides, make_config
from sonata.core.errors import ConfigError
from sonata.train.schedule import lr_at_progress
from sonata.train.trainer import Trainer

BUDGET = 2.0


@pytest.mark.parametrize("value, line", [
    ("-1", "train.max_seconds must be a number >= 0 (0 = no time budget), not -1.0"),
    ("abc", "bad value for train.max_seconds: 'abc' is not a number"),
    ("nan", "train.max_seconds must be a number >= 0 (0 = no time budget), not nan"),
    ("inf", "train.max_seconds must be a number >= 0 (0 = no time budget), not inf"),
])
def test_bad_max_seconds_is_a_config_error(value, line):
    with pytest.raises(ConfigError) as e:
        make_config([f"train.max_seconds={value}"])
    assert str(e.value) == line


def test_max_seconds_type_and_conflicts_are_config_errors():
    with pytest.raises(ConfigError, match=r"^bad value for train.max_seconds: '10' is not a float$"):
        Config.from_dict({"train": {"max_seconds": "10"}})          # a saved config holds typed values
    with pytest.raises(ConfigError, match="bad value for train.max_seconds: True is not a float"):
        make_config({"train.max_seconds": True})
    with pytest.raises(ConfigError, match=r"^set train.decay_steps or train.max_seconds, not both"):
        make_config(["train.max_seconds=60", "train.decay_steps=100"])
    assert make_config({"train.max_seconds": 30}).train.max_seconds == 30.0      # an int is a number


def test_cli_bad_max_seconds_is_one_error_line(tmp_path):
    _assert_one_error_line(run_cli("train", "--out", str(tmp_path / "o"), "train.max_seconds=-5", cwd=tmp_path),
                           "train.max_seconds must be a number >= 0")


# ---- a budgeted run

@pytest.fixture(scope="module")
def budgeted(tmp_path_factory):
    """A tiny model trained for BUDGET seconds, no step cap."""
    out = tmp_path_factory.mktemp("budget")
    cfg = make_config(tiny_overrides(**{"train.max_seconds": BUDGET, "train.max_steps": 0,
                                        "train.warmup_steps": 2}))
    tr = Trainer(cfg, out, progress="none")
    summary = tr.run()
    return out, tr, summary


def test_a_budgeted_run_stops_by_time_with_the_rate_at_its_floor(budgeted):
    out, tr, s = budgeted
    rows = tr.history
    steps_s = [r["step_s"] for r in rows]
    assert s["stopped_by"] == tr.record.ended_by == "time" and s["steps"] == len(rows) > 0
    assert s["max_seconds"] == BUDGET
    # training time is the steps' own time (setup and evaluation excluded) ...
    assert s["train_seconds"] == pytest.approx(sum(steps_s), rel=1e-9)
    assert [r["train_s"] for r in rows] == pytest.approx([sum(steps_s[:i + 1]) for i in range(len(rows))])
    # ... and the run ends with the step whose projected end (time so far + the last step's)
    # reached the budget: within one step before it and two after it
    assert BUDGET - max(steps_s) <= s["train_seconds"] <= BUDGET + 2 * max(steps_s)
    assert [r["progress"] >= 1.0 for r in rows] == [False] * (len(rows) - 1) + [True]
    assert rows[0]["progress"] == 0.0
    for prev, r in zip(rows, rows[1:]):        # progress = (time so far + the last step's time) / budget
        assert r["progress"] == pytest.approx(min(1.0, (prev["train_s"] + prev["step_s"]) / BUDGET))
    t = tr.cfg.train
    assert rows[-1]["lr"] == pytest.approx(t.lr * t.min_lr_ratio, rel=1e-12, abs=0)
    assert [r["lr"] for r in rows] == pytest.approx([lr_at_progress(i, r["progress"], t)
                                                     for i, r in enumerate(rows)], rel=1e-12)
    # the files say the same
    written = json.loads((out / "summary.json").read_text())
    assert {k: written[k] for k in ("max_seconds", "train_seconds", "steps", "stopped_by")} == \
        {"max_seconds": BUDGET, "train_seconds": s["train_seconds"], "steps": s["steps"], "stopped_by": "time"}
    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, s["steps"] + 1))
    assert metrics[-1]["lr"] == rows[-1]["lr"] and "val_bpb" in metrics[-1]
    assert ckpt.load(out / "checkpoint.pt")["train_seconds"] == s["train_seconds"]


def test_the_step_cap_ends_a_budgeted_run_when_it_comes_first(tmp_path):
    cfg = make_config(tiny_overrides(**{"train.max_seconds": 600, "train.max_steps": 3}))
    tr = Trainer(cfg, None, progress="none")
    with pytest.warns(UserWarning, match=r"train.max_steps=3 ended the run after [\d.]+ s of its 600 s budget "
                                         r"\(the learning rate had not reached its floor\); "
                                         r"train.max_steps=0 lifts the step cap"):
        s = tr.run()
    assert s["steps"] == 3 and s["stopped_by"] == tr.record.ended_by == "steps" and 0 < s["train_seconds"] < 600
    assert tr.history[-1]["lr"] > cfg.train.lr * cfg.train.min_lr_ratio
    assert all(r["progress"] < 1 for r in tr.history)


# ---- resuming a budgeted run: it continues in steps

def _resumed(path, *overrides):
    state = ckpt.load(path)
    cfg = apply_overrides(Config.from_dict(state["config"]), list(overrides))
    return Trainer(cfg, None, state=state, progress="none")


def test_a_budgeted_checkpoint_resumes_in_steps_at_the_floor(budgeted):
    out, tr, s = budgeted
    k = s["steps"]
    done = _resumed(out / "checkpoint.pt")
    t = done.cfg.train
    assert (t.max_seconds, t.decay_steps, t.max_steps) == (0.0, k, k)   # the budget was used: nothing left
    assert done.run()["steps"] == k
    runs = []
    for _ in range(2):
        more = _resumed(out / "checkpoint.pt", f"train.max_steps={k + 3}")
        summary = more.run()
        runs.append([r["loss"] for r in more.history])
        floor = more.cfg.train.lr * more.cfg.train.min_lr_ratio
        assert [r["lr"] for r in more.history] == pytest.approx([floor] * 3, rel=1e-12)
        assert summary["stopped_by"] == "steps" and summary["max_seconds"] == 0.0
        assert summary["resumed_budget"] == {"max_seconds": BUDGET, "train_seconds": s["train_seconds"], "steps": k}
        assert summary["train_seconds"] == pytest.approx(s["train_seconds"] + sum(r["step_s"] for r in more.history))
    assert runs[0] == runs[1]                 # in steps, two resumes train identically


def test_summary_says_where_the_time_went_beside_the_budget(tmp_path, monkeypatch):
    """The budget counts optimizer steps only: the summary reports setup, validation and
    checkpoint seconds beside the training seconds, and together they fit in the wall time
    (which runs to after the final checkpoint: it once ended before it, and on a loaded
    machine the parts summed to 5 ms more than the wall; each save here takes 0.2 s more)."""
    import time

    from sonata.core import checkpoint
    save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda *a, **k: (time.sleep(0.2), save(*a, **k))[1])
    cfg = make_config(tiny_overrides(**{"train.max_seconds": 2, "train.max_steps": 0, "train.eval_every": 5,
                                        "train.checkpoint_every": 5}))
    tr = Trainer(cfg, tmp_path, progress="none")
    s = tr.run()
    for key in ("setup_s", "eval_s", "checkpoint_s"):
        assert s[key] > 0, key
    assert s["train_seconds"] + s["setup_s"] + s["eval_s"] + s["checkpoint_s"] <= s["wall_s"] + 1e-6
    # the last step is the one projected to reach the budget (however long a loaded machine
    # made it): the one before was projected short of it
    rows = tr.history
    assert rows[-1]["progress"] == 1.0 and rows[-2]["progress"] < 1.0 and s["stopped_by"] == "time"
