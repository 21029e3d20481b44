"""The micro-batch autotuner (sonata.train.autotune): cap, budget, divisibility, out-of-memory by
type, bit-identical training after it, the command line."""
import json

import torch

from conftest import run_cli, tiny_overrides
from sonata.core import checkpoint as ckpt
from sonata.core.config import make_config
from sonata.train import autotune as autotune_mod
from sonata.train.trainer import Trainer

GiB = 2**30


# ---------------------------------------------------------------- autotuner
def _autotune(tr, step):
    """The autotuner on trainer `tr`'s state and plan, one measured step a candidate through `step`."""
    return autotune_mod.autotune(step, tr.state_dict, tr.load_state_dict, profile=tr.profile, plan=tr.plan,
                                 device=tr.device, seq_len=tr.cfg.data.seq_len, warmup=0, steps=1)


class _FakePeak:
    """PeakSampler stand-in: the peak is 100 MiB per sequence of the running micro-batch."""
    micro_batch = 0                     # set by the step wrapper below

    def __init__(self, device, interval=0.0):
        self.peak = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.peak = 100 * 2**20 * _FakePeak.micro_batch
        return False


def test_autotuner_respects_cap_budget_and_divisibility(monkeypatch):
    cfg = make_config(tiny_overrides(**{"train.micro_batch": 0, "train.effective_batch": 12,
                                        "profile.candidates": "1,2,3,4,6,8,12",
                                        "profile.max_micro_batch": 8,
                                        "profile.memory_budget_mb": 450}))
    tr = Trainer(cfg, None, progress="none")
    real = tr.train_step

    def step(plan=None):
        _FakePeak.micro_batch = plan.micro_batch
        return real(plan)
    monkeypatch.setattr(autotune_mod, "PeakSampler", _FakePeak)
    res = _autotune(tr, step)
    rows = {c["micro_batch"]: c for c in res.table}
    assert [m for m, c in rows.items() if c["status"] == "measured"] == [1, 2, 3, 4]
    assert rows[6]["status"] == "skipped" and "predicted" in rows[6]["note"]   # 600 MiB > 450
    assert all(not rows[m]["eligible"] for m in (6, 8, 12))
    assert rows[4]["fits"] and rows[4]["divides"]
    assert res.micro_batch in (1, 2, 3, 4)
    assert res.micro_batch * res.accumulation == 12
    best = max((c for c in res.table if c["eligible"]), key=lambda c: c["tok_per_s"])
    assert res.micro_batch == best["micro_batch"]
    # the trainer was left as it was
    assert tr.step == 0 and tr.tokens == 0 and tr.plan.micro_batch == 6     # plan: 6 divides 12
    assert cfg.train.micro_batch == 0                                          # the config as asked


def test_autotuner_marks_out_of_memory_by_type():
    cfg = make_config(tiny_overrides(**{"train.micro_batch": 0, "train.effective_batch": 8,
                                        "profile.candidates": "1,2,4,8"}))
    tr = Trainer(cfg, None, progress="none")
    real = tr.train_step

    def step(plan=None):
        if plan.micro_batch >= 4:
            raise torch.OutOfMemoryError("simulated: tried to allocate 1 GiB")
        return real(plan)
    res = _autotune(tr, step)
    rows = {c["micro_batch"]: c for c in res.table}
    assert rows[4]["status"] == "oom" and not rows[4]["fits"]
    assert rows[8]["status"] in ("oom", "skipped") and not rows[8]["eligible"]
    assert res.micro_batch in (1, 2)


def test_training_after_autotune_is_bit_identical_to_the_fixed_choice(tmp_path):
    common = {"train.effective_batch": 8, "train.max_steps": 5, "profile.candidates": "2,4,8"}
    cfg = make_config(tiny_overrides(**{**common, "train.micro_batch": 0, "train.autotune": "true"}))
    a = Trainer(cfg, tmp_path / "a", progress="none")
    sa = a.run()
    chosen = sa["autotune"]["micro_batch"]
    assert sa["micro_batch"] == chosen and chosen * sa["accumulation"] == 8
    assert len(sa["autotune"]["table"]) == 3 and "autotuned" in sa["batch_how"]
    b = Trainer(make_config(tiny_overrides(**{**common, "train.micro_batch": chosen})), None,
                progress="none")
    b.run()
    assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
    for (n, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), n
    # the choice and the table travel in the checkpoint and the summary
    state = ckpt.load(tmp_path / "a" / "checkpoint.pt")
    assert state["autotune"]["micro_batch"] == chosen
    assert state["plan"] == sa["plan"] == a.plan.to_dict() and state["plan"]["micro_batch"] == chosen
    assert state["config"]["train"]["micro_batch"] == 0         # the config stays what was asked
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["autotune"]["micro_batch"] == chosen


def test_cli_autotune_prints_the_table():
    r = run_cli("autotune", "--progress", "none", *tiny_overrides(**{
        "train.micro_batch": 0, "train.effective_batch": 4, "profile.candidates": "1,2,4,8",
        "profile.max_micro_batch": 4}))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("profile cpu: budget") and "max micro-batch 4" in lines[0]
    assert sum(1 for line in lines if line.split()[:1] in (["1"], ["2"], ["4"], ["8"])) == 4
    assert "above the cap 4" in r.stdout and "<- chosen" in r.stdout
    assert "chosen: micro-batch" in lines[-1]
