"""Data-parallel training (issue 7): torchrun / --nproc with gloo on CPU.

Every multi-process run has a subprocess timeout, so a hung collective fails the
test instead of hanging it."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, _assert_one_error_line, tiny_overrides
from sonata.core import checkpoint as ckpt
from sonata.core.config import Config, ProfileConfig, apply_overrides, make_config, resolve_profile
from sonata.core.errors import ConfigError
from sonata.data.batches import BatchSampler
from sonata.lab.generate import load_model
from sonata.train.plan import plan_batch
from sonata.train.trainer import Trainer

STEPS = 6
# global batch 8; decay_steps fixed so the schedule does not depend on max_steps (resume legs)
BASE = {"train.effective_batch": 8, "train.max_steps": STEPS, "train.decay_steps": STEPS}
LAUNCH_TIMEOUT = 120


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", SONATA_PROGRESS="none", **extra)
    env.pop("SONATA_TEST_TRIP", None)
    env.update(extra)
    return env


def _torchrun(nproc, *args, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "sonata", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=LAUNCH_TIMEOUT,
                          env=env or _env())


def _sonata(*args, env=None):
    return subprocess.run([sys.executable, "-m", "sonata", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=LAUNCH_TIMEOUT, env=env or _env())


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_close(a, b, rel=1e-5):
    assert len(a) == len(b), (a, b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=rel), (a, b)


def _assert_same_params(sd_a, sd_b):
    """Equal up to summation order. AdamW divides each update by the root of its
    gradient's running square, so an element whose gradient is nearly zero can move by
    a few 1e-6 when its sums are ordered differently (one element of 9,600 did, with
    the fused CPU kernels); a wrong shard or a missed reduction moves every weight by
    about the learning rate (3e-3 here), far above atol."""
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        torch.testing.assert_close(sd_a[k], sd_b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, the same global batch (micro 4 x accumulation 2)."""
    out = tmp_path_factory.mktemp("single")
    tr = Trainer(make_config(tiny_overrides(**BASE, **{"train.micro_batch": 4})), out, progress="none")
    tr.run()
    return {"losses": [r["loss"] for r in tr.history], "model": ckpt.load(out / "checkpoint.pt")["model"]}


def test_sampler_shards_are_the_single_process_batch():
    stream = torch.arange(1000, dtype=torch.int32)
    whole = BatchSampler(stream, 16, seed=3)
    parts = [BatchSampler(stream, 16, seed=3) for _ in range(2)]
    for _ in range(3):
        x, y = whole.draw(8)
        shards = [p.draw(8, shard=(r, 2)) for r, p in enumerate(parts)]
        assert torch.equal(x, torch.cat([s[0] for s in shards])) and torch.equal(y, torch.cat([s[1] for s in shards]))
    # the generators stay identical on every rank and to the single process
    assert all(torch.equal(p.gen.get_state(), whole.gen.get_state()) for p in parts)


def test_batch_plan_splits_the_global_batch():
    p = resolve_profile(ProfileConfig(), "cpu", 20 * 2**30)
    t = make_config(["train.effective_batch=8", "train.micro_batch=2"]).train
    plan = plan_batch(t, p, world=2)
    assert (plan.micro_batch, plan.accumulation, plan.effective_batch, plan.world_size) == (2, 2, 8, 2)
    with pytest.raises(ConfigError, match=r"global batch and must be a multiple of the number of processes \(3\)"):
        plan_batch(t, p, world=3)
    t = make_config(["train.effective_batch=8", "train.micro_batch=8"]).train
    with pytest.raises(ConfigError, match=r"must divide the per-process batch \(train.effective_batch 8 / 2 processes = 4\)"):
        plan_batch(t, p, world=2)
    t = make_config(["train.effective_batch=24"]).train      # profile's choice divides 24 / 2 = 12
    plan = plan_batch(t, p, world=2)
    assert 12 % plan.micro_batch == 0 and plan.effective_batch == 24 and "per-process batch 12" in plan.how
    assert plan.micro_batch * plan.accumulation * 2 == 24
    alone = plan.alone()                                      # rank 0's autotuning: its share, one process
    assert (alone.effective_batch, alone.world_size, alone.micro_batch) == (12, 1, plan.micro_batch)


def test_two_gloo_ranks_match_one_process(tmp_path, single):
    out = tmp_path / "ddp"
    r = _torchrun(2, "train", "--out", str(out), "--progress", "none",
                  *tiny_overrides(**BASE, **{"train.micro_batch": 2}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("wrote ") == 1                     # rank 0 alone prints
    _assert_close(_losses(out), single["losses"])
    _assert_same_params(ckpt.load(out / "checkpoint.pt")["model"], single["model"])
    s = json.loads((out / "summary.json").read_text())
    assert (s["world_size"], s["backend_dist"], s["threads"]) == (2, "gloo", 1)
    assert (s["micro_batch"], s["accumulation"], s["effective_batch"]) == (2, 2, 8)
    assert s["tokens"] == STEPS * 8 * 32                     # global tokens
    assert s["peak_mem_bytes"] > 0


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path, single):
    out = tmp_path / "leg1"
    r = _sonata("train", "--nproc", "2", "--out", str(out), "--progress", "none",
                *tiny_overrides(**{**BASE, "train.micro_batch": 2, "train.max_steps": 3}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.strip() == "" and r.stdout.count("wrote ") == 1
    _assert_close(_losses(out), single["losses"][:3])
    state = ckpt.load(out / "checkpoint.pt")
    assert state["step"] == 3 and state["world_size"] == 2
    cfg = apply_overrides(Config.from_dict(state["config"]), ["train.max_steps=6"])
    tr = Trainer(cfg, out, state=state, progress="none")      # one process: micro 2 x accumulation 4
    assert tr.plan.accumulation == 4
    tr.run()
    _assert_close(_losses(out), single["losses"])
    _assert_same_params(ckpt.load(out / "checkpoint.pt")["model"], single["model"])


def test_a_guard_trip_on_one_rank_stops_every_rank(tmp_path):
    out = tmp_path / "trip"
    # test-only switch (sonata.core.inject.TRIP_ENV): rank 1's guard trips before step 3
    r = _sonata("train", "--nproc", "2", "--out", str(out), "--progress", "none",
                *tiny_overrides(**BASE, **{"train.micro_batch": 2}),
                env=_env(SONATA_TEST_TRIP="1:2"))
    _assert_one_error_line(r, "memory budget exceeded on rank 1 of 2")
    assert "last good state (step 2)" in r.stderr
    assert r.stdout.strip() == ""
    model, vocab, cfg = load_model(out / "checkpoint.pt")
    assert ckpt.load(out / "checkpoint.pt")["step"] == 2 and cfg.model.d_model == 32


@pytest.mark.parametrize("point", ["prepare", "finish"])
def test_a_peer_lost_outside_the_step_is_one_line_and_a_survivors_checkpoint(tmp_path, point):
    """Rank 1 dies before DDP's construction (`prepare`) or before the final evaluation
    (`finish`; test-only switch sonata.core.inject.EXIT_ENV): one `error:` line naming the
    lost peer or the failed rank, no traceback (before: raw communication errors there, and no
    checkpoint), and after the last step the survivor's checkpoint of it. Before the first
    step there is nothing to save, and the launcher, stopping the workers as soon as rank 1
    exits, may stop rank 0 before it says anything (its line is then the launcher's)."""
    out = tmp_path / "run"
    r = _sonata("train", "--nproc", "2", "--out", str(out), "--progress", "none",
                *tiny_overrides(**BASE, **{"train.micro_batch": 2}), env=_env(SONATA_TEST_EXIT=f"1:{point}"))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    # rank 0's own line (a lost peer) or the launcher's (rank 1 failed), whichever comes first
    assert "lost" in lines[0] or "another process" in lines[0] or "worker rank 1 failed" in lines[0], lines[0]
    if point == "finish":
        assert ckpt.load(out / "checkpoint.pt")["step"] == STEPS
    elif (out / "checkpoint.pt").exists():
        assert ckpt.load(out / "checkpoint.pt")["step"] == 0


def test_lost_peers_are_known_by_type_not_by_words():
    from sonata.train.distributed import CollectiveFailed, collective, is_comm_error
    assert not is_comm_error(RuntimeError("the data loader timed out"))
    assert not is_comm_error(RuntimeError("gloo"))                 # words alone are not a lost peer
    with pytest.raises(CollectiveFailed) as e:
        with collective("all-reduce"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert is_comm_error(e.value) and str(e.value).startswith("all-reduce: [gloo")
    with pytest.raises(RuntimeError) as plain:                     # an autograd error in DDP's backward
        with collective("DDP backward", backend_marks_only=True):
            raise RuntimeError("one of the variables needed for gradient computation has been modified")
    assert not is_comm_error(plain.value)


def test_the_launcher_reports_the_last_attempts_failure_not_a_stale_rank(monkeypatch, capsys):
    """Issue 42 item 16: the --nproc launcher read the status files of every restart attempt,
    so a line a rank wrote in an attempt that was then restarted could be reported as why the
    launch failed. Here (torch's elastic launch stood in for) rank 1 fails with its own line in
    attempt 0, the workers are restarted, and in attempt 1 rank 1 is killed without a word:
    the report is attempt 1's (rank 1 killed by signal 9), not attempt 0's line."""
    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from sonata import launch

    def fake_elastic_launch(config, entrypoint):
        def run(*args):
            log_dir = os.path.dirname(os.environ[launch.STATUS_ENV])
            for attempt in (0, 1):
                os.makedirs(os.path.join(log_dir, f"{config.run_id}_x", f"attempt_{attempt}", "0"))
                monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
                if attempt == 0:
                    launch.report(1, "error: rank 1: a stale failure of the first attempt", lost_peer=False)
                launch.report(0, "error: lost contact with another process", lost_peer=True)
            raise ChildFailedError("sonata", {1: ProcessFailure(local_rank=1, pid=12345, exitcode=-9,
                                                                error_file="/nonexistent/error.json")})
        return run

    monkeypatch.setattr(api, "elastic_launch", fake_elastic_launch)
    assert launch.launch(2, ["train", "--out", "/nonexistent/run"], max_restarts=1) == 137
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "stale" not in lines[0], lines
    assert lines[0].startswith("error: worker rank 1 was killed by signal 9 (the other ranks lost contact with it)")
    import shutil
    shutil.rmtree(lines[0].rsplit("the workers' output is in ", 1)[1].split(";")[0], ignore_errors=True)
