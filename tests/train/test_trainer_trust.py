"""The trainer's promises: exact resume, equivalent accumulation, safe checkpoints,
every precision mode, the non-finite guard, the A constraint, signal handling."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, _assert_one_error_line, run_cli, tiny_overrides, wait_for
from sonata.core import checkpoint as ckpt
from sonata.core.config import make_config
from sonata.core.errors import TrainingDiverged
from sonata.model.lm import max_decay
from sonata.train.trainer import Trainer


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_accumulation_matches_a_larger_micro_batch():
    runs = {}
    for mb, eb in ((8, 8), (4, 8), (2, 8)):
        cfg = make_config(tiny_overrides(**{"train.micro_batch": mb, "train.effective_batch": eb,
                                            "train.max_steps": 3}))
        tr = Trainer(cfg, None, progress="none")
        tr.run()
        runs[mb] = ([r["loss"] for r in tr.history], [p.detach().clone() for p in tr.model.parameters()])
    for mb in (4, 2):
        assert runs[mb][0] == pytest.approx(runs[8][0], rel=1e-5, abs=1e-6)
        for a, b in zip(runs[mb][1], runs[8][1]):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("extra", [{}, {"train.micro_batch": 2, "train.effective_batch": 4}])
def test_resume_is_bit_identical(tmp_path, extra):
    base = tiny_overrides(**{"train.decay_steps": 20, "train.eval_every": 0, **extra})
    a, b = tmp_path / "a", tmp_path / "b"
    r = run_cli("train", "--out", str(a), "--progress", "none", *base, "train.max_steps=20")
    assert r.returncode == 0, r.stderr
    r = run_cli("train", "--out", str(b), "--progress", "none", *base, "train.max_steps=10")
    assert r.returncode == 0, r.stderr
    assert len(losses(b)) == 10
    r = run_cli("train", "--resume", str(b / "checkpoint.pt"), "--progress", "none", "train.max_steps=20")
    assert r.returncode == 0, r.stderr
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) == 20
    assert la == lb                                   # exact equality, every step
    sa, sb = ckpt.load(a / "checkpoint.pt"), ckpt.load(b / "checkpoint.pt")
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k


def test_sigkill_while_writing_leaves_the_previous_checkpoint(tmp_path):
    target = tmp_path / "checkpoint.pt"
    ckpt.save({"generation": 0, "w": torch.zeros(10)}, target)
    code = f"""
import torch, sys
sys.path.insert(0, {str(REPO)!r})
from sonata.core import checkpoint as ckpt
i = 0
print("writing", flush=True)
while True:
    i += 1
    ckpt.save({{"generation": i, "w": torch.full((4_000_000,), float(i))}}, {str(target)!r})
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    time.sleep(1.5)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    state = ckpt.load(target)                          # old or a complete new one, never half
    assert state["generation"] >= 1                    # it was replaced (16 MB writes, for 1.5 s)
    assert state["w"].numel() == 4_000_000 and bool((state["w"] == state["generation"]).all())


def test_cli_refuses_a_checkpoint_that_would_run_code(tmp_path):
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (os.mknod, (str(marker),))
    torch.save({"format": ckpt.FORMAT, "model": Payload()}, tmp_path / "evil.pt")
    for args in (["train", "--resume", str(tmp_path / "evil.pt")], ["generate", str(tmp_path / "evil.pt")]):
        _assert_one_error_line(run_cli(*args), "could run code")
    assert not marker.exists()


def test_cli_refuses_a_truncated_checkpoint(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "--out", str(out), "--progress", "none", *tiny_overrides(
        **{"train.max_steps": 2})).returncode == 0
    data = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    _assert_one_error_line(run_cli("train", "--resume", str(out / "checkpoint.pt")), "truncated or corrupt")


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8"])
def test_every_precision_mode_trains(tmp_path, precision):
    cfg = make_config(tiny_overrides(**{"train.precision": precision, "train.max_steps": 30,
                                        "train.lr": 1e-2}))
    tr = Trainer(cfg, tmp_path, progress="none")
    summary = tr.run()
    ls = [r["loss"] for r in tr.history]
    assert sum(ls[-5:]) / 5 < sum(ls[:5]) / 5 - 0.3, ls
    assert summary["precision"] == precision
    if precision == "fp16":   # the scaler is on, checkpointed, and its skips are the rows that say so
        state = ckpt.load(tmp_path / "checkpoint.pt")
        assert state["scaler"]["scale"] > 0 and tr.scaler.is_enabled()
        assert summary["scaler_skipped_steps"] == sum(r["skipped"] == "scaler" for r in tr.history)
    else:
        assert not tr.scaler.is_enabled() and summary["scaler_skipped_steps"] == 0
    if precision == "int8":
        export = torch.load(tmp_path / "model_int8.pt", weights_only=True)
        w = export["layers.0.mixer.in_proj.weight"]
        assert w["int8"].dtype == torch.int8 and w["scale"].dtype == torch.float32
        assert abs(summary["val_loss_int8_export"] - summary["val_loss"]) < 0.05
        assert math.isfinite(summary["val_loss_fp32_weights"])


def test_nonfinite_steps_are_skipped_then_training_stops(tmp_path):
    cfg = make_config(tiny_overrides(**{"train.max_steps": 20, "train.max_nonfinite": 3}))
    tr = Trainer(cfg, tmp_path, progress="none")
    poison = {"from": 4, "until": 5}    # steps (1-based) whose loss is NaN

    def hook(mod, inp, out):
        return out * float("nan") if poison["from"] <= tr.step + 1 <= poison["until"] else out
    tr.model.lm_head.register_forward_hook(hook)
    tr.cfg.train.max_steps = 8
    tr.run()                                           # two poisoned steps: skipped, training goes on
    skipped = [r["step"] for r in tr.history if r["skipped"] == "nonfinite"]
    assert skipped == [4, 5] and tr.counters["nonfinite_steps"] == 2
    assert tr.model_is_finite()
    poison.update({"from": 9, "until": 100})
    tr.cfg.train.max_steps = 20
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    with pytest.raises(TrainingDiverged, match="3 consecutive non-finite steps, the last at step 11"):
        tr.run()
    state = ckpt.load(tmp_path / "checkpoint.pt")     # emergency checkpoint: the last good state
    assert state["step"] == 11
    for k, v in state["model"].items():
        assert torch.equal(v, before[k]) and torch.isfinite(v).all()


def test_a_nonfinite_model_is_never_written_over_a_good_checkpoint(tmp_path):
    tr = Trainer(make_config(tiny_overrides(**{"train.max_steps": 2})), tmp_path, progress="none")
    tr.run()
    good = (tmp_path / "checkpoint.pt").read_bytes()
    with torch.no_grad():
        tr.model.layers[0].mixer.D.fill_(float("inf"))
    with pytest.warns(RuntimeWarning, match="non-finite weights"):
        assert tr.save_checkpoint() is None
    assert (tmp_path / "checkpoint.pt").read_bytes() == good


def test_direct_A_with_constraint_stays_contracting():
    cfg = make_config(tiny_overrides(**{"model.a_param": "direct", "model.a_constraint": "true",
                                        "model.a_min": 0.05, "train.lr": 0.05, "train.max_steps": 10}))
    tr = Trainer(cfg, None, progress="none")
    tr.run()
    for layer in tr.model.layers:
        assert float(layer.mixer.A.detach().max()) <= -0.05
    x, _ = tr.sampler.draw(2)
    assert max_decay(tr.model, x) < 1.0


def test_sigterm_writes_an_emergency_checkpoint(tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "sonata", "train", "--out", str(out), "--progress", "none",
                          *tiny_overrides(**{"train.max_steps": 100000})],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM")
    state = ckpt.load(out / "checkpoint.pt")
    assert state["step"] == len(metrics.read_text().splitlines()) >= 3


def test_a_step_the_guard_trips_after_is_logged_and_timed(tmp_path):
    """The memory check after step 3 trips: the run stops with the checkpoint of step 3, and
    metrics.jsonl has step 3's row, whose time counts in the checkpoint's training seconds.
    (Before: the checkpoint said step 3 but the file stopped at step 2 and the time of step 3
    was lost while its tokens were counted.)"""
    from sonata.train.memory import MemoryBudgetExceeded
    tr = Trainer(make_config(tiny_overrides(**{"train.max_steps": 6})), tmp_path, progress="none")
    after = tr.guard.after_step

    def trip_at_3(step, hint=""):
        now = after(step, hint)
        if step == 3:
            tr.guard._trip("step 3 peaked at (test)", now, hint)
        return now
    tr.guard.after_step = trip_at_3
    with pytest.raises(MemoryBudgetExceeded):
        tr.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    state = ckpt.load(tmp_path / "checkpoint.pt")
    assert state["step"] == 3 and [r["step"] for r in rows] == [1, 2, 3]
    assert state["train_seconds"] == pytest.approx(sum(r["step_s"] for r in rows), rel=1e-9)
    assert rows[-1]["train_s"] == pytest.approx(state["train_seconds"], rel=1e-9)
    assert state["tokens"] == rows[-1]["tokens"]


def test_resume_writes_the_row_of_the_checkpoints_step_when_the_file_lacks_it(tmp_path):
    """The process writing metrics.jsonl died after a step, before its row (a survivor of a
    data-parallel run saved that step): the checkpoint carries the row, and a resume writes
    it, so every step has its row."""
    out = tmp_path / "run"
    r = run_cli("train", "--out", str(out), "--progress", "none",
                *tiny_overrides(**{"train.max_steps": 5, "train.decay_steps": 7}))
    assert r.returncode == 0, r.stderr
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert ckpt.load(out / "checkpoint.pt")["last_row"]["step"] == 5
    (out / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")         # step 5's row lost
    r = run_cli("train", "--resume", str(out / "checkpoint.pt"), "--progress", "none", "train.max_steps=7")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert rows[4] == json.loads(lines[-1])


def test_a_new_run_never_overwrites_a_run_folder(tmp_path):
    """Issue 42 item 1: `train --out k` twice exited 0 both times, the second run truncating
    the first's metrics and replacing its checkpoint. Now the second is one error line that
    points at --resume or --force and changes nothing; --force replaces the run; resuming the
    folder's own checkpoint continues it; a typo in an override creates no folder."""
    out = tmp_path / "k"
    args = ["train", "--out", str(out), *tiny_overrides(**{"train.max_steps": 3})]
    assert run_cli(*args).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = run_cli(*args)
    _assert_one_error_line(r, f"--resume {out / 'checkpoint.pt'} continues it, or --force replaces it")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    r = run_cli(*args[:3], "--resume", str(out / "checkpoint.pt"), "train.max_steps=5")
    assert r.returncode == 0, r.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5
    r = run_cli(*args, "--force")
    assert r.returncode == 0, r.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    runs = tmp_path / "cwd"
    runs.mkdir()
    r = run_cli("train", "model.d_modle=3", cwd=runs)
    _assert_one_error_line(r, "unknown config key 'model.d_modle'")
    assert list(runs.iterdir()) == []                    # no empty runs/<time>/ left behind


def test_a_running_run_holds_its_folder(tmp_path):
    """Issue 42 item 1, the lock: nothing locked the folder, so a second `train --out k --force`
    removed a running run's files under it. Now the running run holds an exclusive lock: the
    second fails at once with one line naming the first (its pid), the first's files are
    untouched and it ends normally; the lock goes with the process (SIGKILL too), and the
    folder can then be resumed."""
    out = tmp_path / "k"
    args = ["train", "--out", str(out), "--progress", "none",
            *tiny_overrides(**{"train.max_steps": 400, "train.decay_steps": 400, "train.checkpoint_every": 1})]
    first = subprocess.Popen([sys.executable, "-m", "sonata", *args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(out / "checkpoint.pt", first)
        rows = len((out / "metrics.jsonl").read_text().splitlines())
        r = run_cli(*args, "--force")
        _assert_one_error_line(r, f"--out {out} is in use by another run (pid {first.pid}, started ")
        assert (out / "checkpoint.pt").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= rows
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    step = ckpt.load(out / "checkpoint.pt")["step"]
    r = run_cli("train", "--resume", str(out / "checkpoint.pt"), "--progress", "none", f"train.max_steps={step + 2}")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step + 2
