import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import _assert_one_error_line, run_cli, tiny_overrides
from sonata.core.config import make_config
from sonata.lab.generate import generate_text, load_model
from sonata.train.schedule import lr_at
from sonata.train.trainer import Trainer


def test_loss_falls_and_files_are_written(tmp_path):
    cfg = make_config(tiny_overrides(**{"train.max_steps": 40, "train.eval_every": 20}))
    tr = Trainer(cfg, tmp_path, progress="none")
    summary = tr.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in ("step", "loss", "lr", "tokens", "tok_per_s"):
        assert all(key in r for r in rows)
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert "val_bpb" in rows[19] and "val_bpb" in rows[39]
    assert rows[39]["val_bpb"] < rows[19]["val_bpb"] + 0.05
    assert rows[-1]["tokens"] == 40 * 4 * 32
    assert summary["val_bpb"] == rows[-1]["val_bpb"] and summary["fallbacks"] == 0
    assert (tmp_path / "checkpoint.pt").exists() and (tmp_path / "summary.json").exists()
    model, vocab, cfg2 = load_model(tmp_path / "checkpoint.pt")
    assert cfg2.model.d_model == 32 and len(vocab) == 300
    texts = generate_text(model, vocab, "Once upon a time", n=2, max_new_tokens=20)
    assert len(texts) == 2 and all(t.startswith("Once upon a time") for t in texts)


def test_lr_schedule_warms_up_then_decays():
    t = make_config(["train.max_steps=100", "train.warmup_steps=10", "train.lr=1e-3"]).train
    lrs = [lr_at(s, t) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[10] > lrs[60] > lrs[99]
    floor = t.lr * t.min_lr_ratio
    assert lrs[-1] == pytest.approx(floor, rel=3e-3)          # the last step is a hair above the floor
    assert lr_at(100, t) == floor and lr_at(500, t) == floor  # reached at decay_steps (100), then held


def test_validation_bits_per_byte_is_consistent():
    cfg = make_config(tiny_overrides())
    tr = Trainer(cfg, None, progress="none")
    ev = tr.evaluate(max_tokens=0)
    assert ev.tokens == tr.corpus.val.numel() - 1
    assert ev.bpb == pytest.approx(ev.loss * ev.tokens / (ev.bytes * torch.log(torch.tensor(2.0)).item()))
    # an untrained model is near uniform over the vocabulary
    assert abs(ev.loss - torch.log(torch.tensor(300.0)).item()) < 0.5


def test_cli_train_then_generate(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", "--out", str(out), "--progress", "none", *tiny_overrides())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["steps"] == 6
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6
    g = run_cli("generate", str(out / "checkpoint.pt"), "--n", "2", "--max-new-tokens", "10")
    assert g.returncode == 0, g.stderr
    assert g.stdout.count("--- sample") == 2


@pytest.mark.parametrize("args,fragment", [
    (["train", "model.d_modle=3"], "unknown config key 'model.d_modle'"),
    (["train", "train.lr=abc"], "train.lr"),
    (["train", "model.n_layers=-1"], "model.n_layers must be positive"),
    (["train", "data.source=/nonexistent/stories.txt"], "data file not found"),
    (["train", "--resume", "/nonexistent/checkpoint.pt"], "checkpoint not found"),
    (["generate", "/nonexistent/checkpoint.pt"], "checkpoint not found"),
    (["generate", "/nonexistent/checkpoint.pt", "--top-k", "-3"], "--top-k must be >= 0"),       # issue 42 item 12
    (["generate", "/nonexistent/checkpoint.pt", "--temperature", "nan"], "--temperature must be a finite"),
    (["generate", "/nonexistent/checkpoint.pt", "--temperature", "-1"], "--temperature must be a finite"),
    (["frobnicate"], "invalid choice"),
    (["train", "--out", "/proc/x/y"], "output folder /proc/x/y cannot be created or written"),
    (["prepare", "data.cache_dir=/proc/x"], "data.cache_dir /proc/x cannot be created or written"),
    (["prepare", "data.vocab_size=70000"], "at most 65536"),
])
def test_cli_bad_input_is_one_error_line(tmp_path, args, fragment):
    _assert_one_error_line(run_cli(*args, cwd=tmp_path), fragment)


BAD_MODE = "progress mode must be one of auto | display | widget | bar | lines | none, not 'off'"


@pytest.mark.parametrize("args,fragment", [
    (["prepare", "--progress", "off"], BAD_MODE),
    (["train", "--progress", "off"], BAD_MODE),
    (["train", "--progress", "off", "--nproc", "2"], BAD_MODE),    # before any worker starts
    (["autotune", "--progress", "off"], BAD_MODE),
    (["bench", "--progress", "off"], "unrecognized arguments: --progress"),    # bench has no progress option
])
def test_cli_unknown_progress_mode_is_one_error_line(tmp_path, args, fragment):
    _assert_one_error_line(run_cli(*args, cwd=tmp_path), fragment)


@pytest.mark.parametrize("command", ["prepare", "train", "autotune", "bench"])
def test_cli_unknown_progress_mode_from_the_environment_is_one_error_line(tmp_path, command):
    r = subprocess.run([sys.executable, "-m", "sonata", command], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, SONATA_PROGRESS="off"), timeout=300)
    _assert_one_error_line(r, "SONATA_PROGRESS must be one of auto | display | widget | bar | lines | none, "
                              "not 'off'")


def test_cli_empty_corpus_and_corrupt_checkpoint(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n<|endoftext|>\n")
    _assert_one_error_line(run_cli("train", "--out", str(tmp_path / "o"), f"data.source={empty}"),
                           "has 0 stories")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    _assert_one_error_line(run_cli("generate", str(bad)), "truncated or corrupt")
    _assert_one_error_line(run_cli("train", "--resume", str(bad)), "truncated or corrupt")


def test_real_data_path_trains(tmp_path, tinystories_path):
    cfg = make_config(tiny_overrides(**{"data.source": str(tinystories_path),
                                        "data.max_stories": 200, "train.max_steps": 3}))
    summary = Trainer(cfg, tmp_path, progress="none").run()
    assert summary["data"]["stories_train"] + summary["data"]["stories_val"] == 200
    assert summary["val_bpb"] > 0
