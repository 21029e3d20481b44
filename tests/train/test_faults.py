"""Faults a long run meets: SIGKILL anywhere (inside a checkpoint write too), a full
disk, a dead data-parallel worker. Each run ends with a usable checkpoint, and a
resumed run ends bit-identical to an uninterrupted one."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import REPO, tiny_overrides
from sonata.core import checkpoint as ckpt
from sonata.core.errors import WriteError

STEPS = 12
FAULT = tiny_overrides(**{"train.max_steps": STEPS, "train.decay_steps": STEPS, "train.checkpoint_every": 1,
                          "train.checkpoint_every_s": 0, "model.backend": "reference",
                          "train.effective_batch": 8, "train.micro_batch": 2, "train.threads": 1})
SLOW_SAVE_S = "0.15"      # sonata.core.inject.SLOW_SAVE_ENV: a wide window inside each write
TIMEOUT = 180


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", SONATA_PROGRESS="none")
    env.pop("SONATA_TEST_TRIP", None)
    env.update(extra)
    return env


def _args(out, *extra):
    args = ["train", "--out", str(out), "--progress", "none", *FAULT, *extra]
    return [sys.executable, "-m", "sonata", *args]


def _rows(out):
    p = out / "metrics.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []


def _tmp_files(out):
    return sorted(p.name for p in out.glob(".*.tmp"))


def _same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    r = subprocess.run(_args(out), capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return {"rows": _rows(out), "model": ckpt.load(out / "checkpoint.pt")["model"]}


def _kill_when(proc, out, step, in_write, deadline):
    """SIGKILL `proc` once the metrics show `step` (and, `in_write`, once a checkpoint's
    temporary file exists: inside a write). Returns whether it was killed."""
    while time.monotonic() < deadline and proc.poll() is None:
        rows = _rows(out) if (out / "metrics.jsonl").exists() else []
        if rows and rows[-1]["step"] >= step and (not in_write or _tmp_files(out)):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    return False


def test_sigkill_anywhere_then_resume_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    rng = random.Random(17)
    steps = sorted(rng.sample(range(1, STEPS - 1), 5))               # spread over the run
    in_write = [rng.random() < 0.5 for _ in steps]
    in_write[rng.randrange(len(steps))] = True                       # at least one inside a write
    out = tmp_path / "run"
    out.mkdir()
    killed = landed_in_write = 0
    for step, w in zip(steps, in_write):
        resume = ["--resume", str(out / "checkpoint.pt")] if (out / "checkpoint.pt").exists() else []
        proc = subprocess.Popen(_args(out, *resume), cwd=REPO, env=_env(SONATA_TEST_SLOW_SAVE=SLOW_SAVE_S),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if _kill_when(proc, out, step, w, time.monotonic() + TIMEOUT):
            killed += 1
            landed_in_write += bool(_tmp_files(out))                 # the write's temp file survived the kill
        else:
            proc.communicate()
        if (out / "checkpoint.pt").exists():                        # what is on disk always loads
            ckpt.load(out / "checkpoint.pt")
    r = subprocess.run(_args(out, "--resume", str(out / "checkpoint.pt")), capture_output=True, text=True,
                       cwd=REPO, timeout=TIMEOUT, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"kill points (step, inside a write): {list(zip(steps, in_write))}; killed {killed}, "
          f"{landed_in_write} inside a checkpoint write")
    assert killed >= 5 and landed_in_write >= 1
    rows = _rows(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))          # the sequence continues
    assert [row["loss"] for row in rows] == [row["loss"] for row in uninterrupted["rows"]]
    _same_weights(ckpt.load(out / "checkpoint.pt")["model"], uninterrupted["model"])
    assert _tmp_files(out) == []                                   # stale temp files were cleared


def test_a_full_disk_is_one_error_line_and_the_previous_checkpoint_stays(tmp_path):
    out = tmp_path / "run"
    # the process's 5th atomic write fails: after metrics.jsonl and the checkpoints of steps
    # 1-3, the checkpoint of step 4
    r = subprocess.run(_args(out, "train.max_steps=6"), capture_output=True, text=True, cwd=REPO,
                       timeout=TIMEOUT, env=_env(SONATA_TEST_DISK_FULL_AT="5"))
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: could not write the checkpoint"), lines
    assert str(out / "checkpoint.pt") in lines[0] and "bytes" in lines[0] and "No space left" in lines[0]
    assert ckpt.load(out / "checkpoint.pt")["step"] == 3                # the previous one stays
    assert _tmp_files(out) == []


def test_write_errors_name_path_what_and_bytes(tmp_path):
    target = tmp_path / "no-such-dir-file"
    target.write_text("a file where a folder should be")
    with pytest.raises(WriteError) as e:
        ckpt.save({"x": torch.zeros(3)}, target / "checkpoint.pt")
    assert e.value.path == str(target / "checkpoint.pt") and e.value.what == "checkpoint"
    assert e.value.bytes > 0 and str(target) in str(e.value)


def _worker(launcher: subprocess.Popen, rank: int):
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank) and "sonata" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def test_a_dead_worker_is_restarted_from_the_emergency_checkpoint(tmp_path):
    ddp = ["--nproc", "2", "train.checkpoint_every=0"]
    ref = tmp_path / "ref"
    r = subprocess.run(_args(ref, *ddp), capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    proc = subprocess.Popen(_args(out, *ddp, "--max-restarts", "1"), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    victim = None
    while time.monotonic() < deadline and proc.poll() is None:
        rows = _rows(out)
        if rows and rows[-1]["step"] >= 5:
            victim = _worker(proc, 1)
            if victim is not None:
                victim.kill()
                break
        time.sleep(0.005)
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    assert victim is not None, "the run ended before a worker could be killed"
    assert proc.returncode == 0, stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["restarts"] == 1 and 5 <= s["resumed_from_step"] < STEPS
    rows = _rows(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["loss"] for row in rows] == [row["loss"] for row in _rows(ref)]
    _same_weights(ckpt.load(out / "checkpoint.pt")["model"], ckpt.load(ref / "checkpoint.pt")["model"])


def test_a_restarted_worker_resumes_only_its_own_launchs_checkpoint(tmp_path):
    """A worker restarted by the elastic launcher (TORCHELASTIC_RESTART_COUNT > 0) finds a
    checkpoint in its --out: written by this launch (the same TORCHELASTIC_RUN_ID), it resumes
    from it; left there by another run (the user reused --out, this run failed before its
    first checkpoint), it starts this run over instead of training on from the old state."""
    out = tmp_path / "run"
    base = ["--progress", "none", *tiny_overrides(**{"train.max_steps": 4, "train.decay_steps": 8})]
    env = dict(_env(), TORCHELASTIC_RUN_ID="old-launch")
    r = subprocess.run([sys.executable, "-m", "sonata", "train", "--out", str(out), *base], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert ckpt.load(out / "checkpoint.pt")["launch_id"] == "old-launch"
    import shutil
    shutil.copytree(out, tmp_path / "copy")
    for folder, launch, resumed in ((out, "new-launch", False), (tmp_path / "copy", "old-launch", True)):
        env = dict(_env(), TORCHELASTIC_RUN_ID=launch, TORCHELASTIC_RESTART_COUNT="1")
        r = subprocess.run([sys.executable, "-m", "sonata", "train", "--out", str(folder), *base[:2],
                            *tiny_overrides(**{"train.max_steps": 6, "train.decay_steps": 8})],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        s = json.loads((folder / "summary.json").read_text())
        assert (s["resumed_from_step"] == 4) is resumed and s["steps"] == 6, (launch, s["resumed_from_step"])
        assert ("resuming from" in r.stdout) is resumed and ("another run" in r.stdout) is not resumed


def test_plain_torchrun_launches_are_told_apart(tmp_path):
    """Issue 42 item 8: plain torchrun (a rendezvous endpoint, no --rdzv-id) names every launch
    "none", and sonata took that for the launch's identity, so a restarted worker of one launch
    resumed the checkpoint another launch left in a reused --out. Two real launches now write
    different identities (the agent's own folder), both marked as torchrun's "none"."""
    ids = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m", "sonata", "train", "--out", str(out),
               "--progress", "none", *tiny_overrides(**{"train.max_steps": 2, "train.decay_steps": 2})]
        r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr[-3000:]
        ids.append(ckpt.load(out / "checkpoint.pt")["launch_id"])
    assert all(i.startswith("none@") for i in ids) and ids[0] != ids[1], ids


def test_a_launch_named_none_is_one_agent_across_its_restarts(monkeypatch):
    """The identity of a "none" launch is its agent's folder: the same at every restart (only
    attempt_<n> changes), another for another agent; over several machines it is refused."""
    from sonata.core.errors import SonataError
    from sonata.train import distributed
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    seen = []
    for agent, attempt in (("torchelastic_a1", 0), ("torchelastic_a1", 1), ("torchelastic_b2", 0)):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", f"/tmp/{agent}/none_x/attempt_{attempt}/0/error.json")
        seen.append(distributed.launch_id())
    assert seen[0] == seen[1] == "none@/tmp/torchelastic_a1/none_x" and seen[2] != seen[0]
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert distributed.launch_id() == f"none@{__import__('socket').gethostname()}:{os.getppid()}"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a-uuid")
    assert distributed.launch_id() == "a-uuid"
    distributed.check_launch_id()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(SonataError, match="over 2 machines needs a --rdzv-id of its own"):
        distributed.check_launch_id()
