"""A time-budgeted run (train.max_seconds): it stops by time with the learning rate at its
floor, the step cap still wins when it comes first, bad values are one error line, and a
budgeted checkpoint resumes in steps. And `python -m sonata eval CKPT --text FILE`: the
trainer's own validation figures on the same text, one error line for each bad input."""
import json
import math

import pytest
import torch

from conftest import tiny_overrides
from sonata import checkpoint as ckpt
from sonata.__main__ import main
from sonata.config import Config, apply_overrides, make_config
from sonata.errors import ConfigError
from sonata.sources import load_stories, split_train_val
from sonata.schedule import continue_in_steps, lr_at, lr_at_progress
from sonata.trainer import Trainer
from sonata.vocab import EOT
from test_train import _assert_one_error_line, run_cli

BUDGET = 2.0


# ---- the schedule

def test_lr_at_progress_is_the_cosine_over_the_budget_with_warm_up_in_steps():
    t = make_config(["train.lr=1e-3", "train.min_lr_ratio=0.1", "train.warmup_steps=10"]).train
    assert lr_at_progress(50, 0.0, t) == pytest.approx(1e-3)
    assert lr_at_progress(50, 0.5, t) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at_progress(50, 1.0, t) == t.lr * t.min_lr_ratio          # the floor, exactly
    assert lr_at_progress(50, 1.7, t) == t.lr * t.min_lr_ratio          # clamped
    # warm-up in steps, never above the cosine
    assert lr_at_progress(0, 0.01, t) == pytest.approx(1e-4)
    assert lr_at_progress(4, 0.01, t) == pytest.approx(5e-4)
    assert lr_at_progress(4, 0.99, t) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.99)))
    lrs = [lr_at_progress(20, p / 100, t) for p in range(101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # the step schedule is unchanged: warm-up, cosine to the floor at max_steps, constant after
    s = make_config(["train.max_steps=110", "train.warmup_steps=10", "train.lr=1e-3"]).train
    assert lr_at(9, s) == pytest.approx(1e-3) and lr_at(60, s) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(110, s) == lr_at(500, s) == pytest.approx(1e-4)


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
    with pytest.raises(ConfigError, match=r"^train.max_seconds must be a number >= 0 \(0 = no time budget\), "
                                          r"not '10'$"):
        Config.from_dict({"train": {"max_seconds": "10"}})
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
    assert s["stopped_by"] == "time" and s["steps"] == len(rows) > 0
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
    assert s["steps"] == 3 and s["stopped_by"] == "steps" and 0 < s["train_seconds"] < 600
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


def test_continue_in_steps_extrapolates_an_interrupted_budget():
    t = make_config(["train.max_seconds=100", "train.max_steps=0"]).train
    state = {"config": make_config(["train.max_seconds=100", "train.max_steps=0"]).to_dict(),
             "step": 10, "train_seconds": 25.0}
    r = continue_in_steps(t, state)
    # a quarter of the budget gave 10 steps: the whole budget is 40 at that pace
    assert (r.max_seconds, r.decay_steps, r.max_steps) == (0.0, 40, 40)
    assert t.max_seconds == 100                                    # the caller's config is not changed
    capped = make_config(["train.max_seconds=100", "train.max_steps=30"])
    r = continue_in_steps(capped.train, dict(state, config=capped.to_dict()))
    assert (r.decay_steps, r.max_steps) == (40, 30)                # the budgeted run's step cap still holds
    asked = make_config(["train.max_seconds=100", "train.max_steps=55"]).train
    assert continue_in_steps(asked, state).max_steps == 55         # changed on resume: the user's value
    off = make_config(["train.max_seconds=0", "train.max_steps=0"]).train
    assert continue_in_steps(off, state).max_steps == 40           # max_seconds=0 on resume: the same
    with pytest.raises(ConfigError, match=r"^train.max_seconds cannot be changed on resume"):
        continue_in_steps(make_config(["train.max_seconds=50"]).train, state)
    steps_state = {"config": make_config().to_dict(), "step": 10, "train_seconds": 3.0}
    plain = make_config().train
    assert continue_in_steps(plain, steps_state) is plain          # a step-based run resumes as it was
    with pytest.raises(ConfigError, match=r"^train.max_seconds cannot be set on resume"):
        continue_in_steps(make_config(["train.max_seconds=50"]).train, steps_state)



def test_continue_in_steps_keeps_a_spent_budget_at_its_steps_even_when_its_time_ended_short():
    """A run that stopped by time ran its last step at budget progress 1 (the projection: time
    so far + the previous step's), but its measured time can end short of the budget when
    that last step was faster than the one before: resumed, it still trains at the floor
    with its own step count, not one extrapolated past it (seen once in a full-suite run:
    297 instead of 296 steps)."""
    cfg = make_config(["train.max_seconds=100", "train.max_steps=0"])
    short = {"config": cfg.to_dict(), "step": 296, "train_seconds": 99.6}     # 296 / 0.996 -> 297
    r = continue_in_steps(cfg.train, dict(short, budget_progress=1.0))
    assert (r.max_seconds, r.decay_steps, r.max_steps) == (0.0, 296, 296)
    r = continue_in_steps(cfg.train, dict(short, budget_progress=0.97))         # interrupted: extrapolated
    assert (r.decay_steps, r.max_steps) == (297, 297)

# ---- python -m sonata eval

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model whose final validation covers the whole validation split, and that
    split written out as text."""
    out = tmp_path_factory.mktemp("eval")
    cfg = make_config(tiny_overrides(**{"train.eval_tokens": 0}))
    tr = Trainer(cfg, out, progress="none")
    summary = tr.run()
    _, val = split_train_val(load_stories("embedded", max_stories=60), cfg.data.val_fraction)
    text = out / "val.txt"
    text.write_text(f"\n{EOT}\n".join(val) + "\n")
    return out / "checkpoint.pt", text, summary, tr


def test_eval_gives_the_trainers_validation_figures_on_the_same_text(trained, capsys):
    path, text, summary, tr = trained
    assert main(["eval", str(path), "--text", str(text), "--json", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == summary["val_tokens"] == tr.corpus.val.numel() - 1
    assert got["bytes"] == summary["val_bytes"]
    assert got["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert got["bpb"] == pytest.approx(summary["val_bpb"], rel=1e-6)
    assert got["bpb"] == pytest.approx(got["loss"] * got["tokens"] / (math.log(2) * got["bytes"]), rel=1e-12)
    assert got["stories"] == summary["data"]["stories_val"] and got["seq_len"] == 32


def test_eval_of_text_without_separators_is_one_story(trained, tmp_path, capsys):
    path, text, _, tr = trained
    story = text.read_text().split(EOT)[0].strip()
    one, sep = tmp_path / "one.txt", tmp_path / "sep.txt"
    one.write_text(story + "\n")
    sep.write_text(f"{EOT}\n{story}\n{EOT}")
    results = []
    for f in (one, sep):
        assert main(["eval", str(path), "--text", str(f), "--json", "--device", "cpu"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0] == results[1] and results[0]["stories"] == 1
    ids, _ = tr.corpus.vocab.encode_stories([story])
    assert results[0]["tokens"] == len(ids) - 1


def test_cli_eval_prints_loss_and_bits_per_byte(trained):
    path, text, summary, _ = trained
    r = run_cli("eval", str(path), "--text", str(text))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{text}: {summary['data']['stories_val']} stories, {summary['val_tokens']:,} tokens")
    assert lines[1] == f"validation loss: {summary['val_loss']:.4f} nats/token"
    assert lines[2] == f"bits per byte: {summary['val_bpb']:.4f}"


def _eval_error(capsys, *args):
    assert main(["eval", *map(str, args)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_eval_bad_inputs_are_one_error_line(trained, tmp_path, capsys):
    path, text, _, tr = trained
    missing = tmp_path / "missing.txt"
    assert _eval_error(capsys, path, "--text", missing) == f"error: text file not found: {missing}"
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Once upon a time, a caf\u00e9.".encode("latin-1"))
    assert _eval_error(capsys, path, "--text", latin) == \
        f"error: text file {latin} is not UTF-8 text (invalid continuation byte at byte 23)"
    short = tmp_path / "short.txt"
    short.write_text("Hi.")
    n = len(tr.corpus.vocab.encode_stories(["Hi."])[0])
    assert _eval_error(capsys, path, "--text", short) == (
        f"error: text file {short} is too short to score: {n} tokens under the checkpoint's vocabulary, "
        f"at least data.seq_len + 1 = 33 needed (one full window)")
    empty = tmp_path / "empty.txt"
    empty.write_text(f"\n{EOT}\n")
    assert "too short to score: 0 tokens" in _eval_error(capsys, path, "--text", empty)
    assert _eval_error(capsys, path, "--text", tmp_path) == f"error: cannot read text file {tmp_path}: Is a directory"
    assert _eval_error(capsys, tmp_path / "none.pt", "--text", text) == \
        f"error: checkpoint not found: {tmp_path / 'none.pt'}"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    assert "truncated or corrupt" in _eval_error(capsys, bad, "--text", text)
    assert _eval_error(capsys, path) == "error: eval needs --text FILE for a language model (--lengths is for task checkpoints)"
    assert _eval_error(capsys, path, "--text", text, "--device", "tpu") == \
        "error: --device must be auto, cpu or cuda, not 'tpu'"


def test_summary_says_where_the_time_went_beside_the_budget(tmp_path, monkeypatch):
    """The budget counts optimizer steps only: the summary reports setup, validation and
    checkpoint seconds beside the training seconds, and together they fit in the wall time
    (which runs to after the final checkpoint: it once ended before it, and on a loaded
    machine the parts summed to 5 ms more than the wall; each save here takes 0.2 s more)."""
    import time

    from sonata import checkpoint
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
