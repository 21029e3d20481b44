"""The Trainer's state in named records: the run's bookkeeping (`RunRecord`, what ended the run
included), the agreement after each step (`StepAgreement`, no list read by position), a Trainer
of few attributes, and the summary and the early stops working from the record, never from a
Trainer."""
import signal
from dataclasses import FrozenInstanceError

import pytest
import torch

from conftest import tiny_overrides
from sonata.core.config import make_config
from sonata.core.errors import TrainingDiverged, TrainingInterrupted, WorkerLost
from sonata.train import stops
from sonata.train.distributed import CollectiveFailed, Ranks, StepAgreement
from sonata.train.evaluate import EvalResult
from sonata.train.memory import MemoryBudgetExceeded
from sonata.train.record import RunRecord
from sonata.train.summary import Throughput, run_summary
from sonata.train import trainer as trainer_mod
from sonata.train.trainer import Trainer

MAX_ATTRIBUTES = 25


def _trainer(out=None, **extra) -> Trainer:
    return Trainer(make_config(tiny_overrides(**extra)), out, progress="none")


def test_a_trainer_has_fewer_than_25_instance_attributes():
    names = sorted(vars(_trainer()))
    assert len(names) < MAX_ATTRIBUTES, f"{len(names)} instance attributes: {', '.join(names)}"


def test_the_step_agreement_of_a_single_process_step_is_its_own_readings(monkeypatch):
    tr = _trainer()
    monkeypatch.setattr(trainer_mod, "peak_memory_bytes", lambda device: 5 << 30)    # the process's peak so far
    row, agreed = tr._guarded_step()
    assert isinstance(agreed, StepAgreement) and tr.step == 1
    assert agreed.step_seconds == row["step_s"] == tr.record.step_seconds > 0
    assert agreed.step_peak_bytes == row["step_peak_bytes"] == tr.guard.peak_last > 0
    assert agreed.peak_bytes == 5 << 30
    assert agreed.signum is None
    assert row["train_s"] == agreed.step_seconds                 # the schedule counted the step's time
    with pytest.raises(FrozenInstanceError):
        agreed.signum = signal.SIGTERM


def test_a_step_agreement_over_one_rank_is_itself():
    mine = StepAgreement(peak_bytes=3 << 20, step_peak_bytes=2 << 20, signum=None, step_seconds=0.25)
    assert mine.over_ranks() == mine
    caught = StepAgreement(1, 1, int(signal.SIGINT), 0.5)
    assert caught.over_ranks().signum == signal.SIGINT


def test_ended_by_after_a_step_limited_run():
    tr = _trainer(**{"train.max_steps": 2})
    s = tr.run()
    assert tr.record.ended_by == tr.ended_by == "steps" and s["stopped_by"] == "steps"   # summary.json's key


def test_the_summary_is_made_from_a_record():
    tr = _trainer()                           # its machinery only: no run
    rec = RunRecord(step=3, tokens=384, ended_by="time", setup_seconds=0.5, checkpoint_seconds=[0.25, 0.75],
                    counters={"nonfinite_steps": 1, "scaler_skipped_steps": 0},
                    history=[{"h2d_bytes": 0, "d2h_bytes": 8}] * 3)
    last_eval = EvalResult(loss=2.0, bpb=1.5, tokens=100, bytes=400)
    s = run_summary(rec, last_eval, Throughput(), 4.0, cfg=tr.cfg, plan=tr.plan, profile=tr.profile,
                    device=tr.device, world=1, params=tr.model.num_params(), guard=tr.guard,
                    leak_report=tr.leak.report(), train_seconds=3.0, data={"source": "test"})
    assert {k: s[k] for k in ("steps", "tokens", "stopped_by", "setup_s", "checkpoint_s", "checkpoints_written",
                              "nonfinite_steps", "d2h_bytes_in_steps", "val_loss", "val_tokens", "train_seconds",
                              "data", "micro_batch")} == \
        {"steps": 3, "tokens": 384, "stopped_by": "time", "setup_s": 0.5, "checkpoint_s": 1.0,
         "checkpoints_written": 2, "nonfinite_steps": 1, "d2h_bytes_in_steps": 24, "val_loss": 2.0,
         "val_tokens": 100, "train_seconds": 3.0, "data": {"source": "test"}, "micro_batch": tr.plan.micro_batch}


class _Run:
    """A RunHandle over a bare record, saving to a file in `out` and noting what the stops called."""

    def __init__(self, out, world=1, step=7):
        self.calls = []
        self.record = RunRecord(step=step, counters={"nonfinite_steps": 0})
        self.handle = stops.RunHandle(record=self.record, out_dir=out, ranks=Ranks(world - 1, world),
                                      device=torch.device("cpu"), save=self.save,
                                      drop_step=lambda: self.calls.append("drop"),
                                      roll_back=lambda: self.calls.append("roll back"))
        self.out = out

    def save(self, any_rank=False):
        self.calls.append(f"save any_rank={any_rank}")
        path = self.out / "checkpoint.pt"
        path.write_bytes(b"saved")
        return path


def test_the_early_stops_work_from_the_record(tmp_path):
    run = _Run(tmp_path)
    assert stops.diverged(run.handle, 4, 5) is None and run.calls == []          # under the limit: nothing
    with pytest.raises(TrainingDiverged) as e:
        stops.diverged(run.handle, 5, 5)
    assert e.value.step == 7 and run.record.emergency_reason == "nonfinite" and run.calls == ["save any_rank=False"]
    with pytest.raises(TrainingInterrupted) as e:
        stops.interrupted(run.handle, signal.SIGTERM)
    assert e.value.step == 7 and run.record.emergency_reason == "SIGTERM" and "--resume" in str(e.value)


def test_a_memory_trip_lists_the_step_it_completed_and_drops_the_failed_one(tmp_path):
    run = _Run(tmp_path)
    done = {"step": 7, "step_tokens": 128, "step_s": 0.1, "step_peak_bytes": 1}
    run.record.last_row = done                      # the check after step 7 tripped before the loop took it
    err = stops.memory_tripped(run.handle, MemoryBudgetExceeded("step 7 peaked (a test)"), Throughput(), None)
    assert run.record.history == [done] and "h2d_bytes" in done and done["peak_mem_bytes"] >= 1
    assert run.calls == ["drop", "save any_rank=False"] and run.record.emergency_reason == "memory"
    assert err.step == 7 and err.checkpoint == str(tmp_path / "checkpoint.pt") and not err.agreed


def test_a_lost_peer_rolls_the_step_back_and_saves_on_any_rank(tmp_path):
    run = _Run(tmp_path, world=2)
    with pytest.raises(WorkerLost) as e:
        with stops.on_lost_peer(run.handle):
            raise CollectiveFailed("all-reduce", RuntimeError("Connection closed by peer"))
    assert run.calls == ["roll back", "save any_rank=True"] and run.record.emergency_reason == "lost a peer"
    assert e.value.rank == 1 and e.value.step == 7
    with pytest.raises(ValueError):                 # anything else passes through untouched
        with stops.on_lost_peer(run.handle):
            raise ValueError("a bug of this rank")
