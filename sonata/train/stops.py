"""How a training run stops early, and what it saves. Each function takes a `RunHandle`, the
parts of the run a stop needs (its record, folder, ranks and device, and how to save, drop a
failed step or roll a step back), which the Trainer makes for its run, never the Trainer itself.

- `diverged(run, consecutive, limit)`: `limit` (train.max_nonfinite) non-finite steps in a row
  -> TrainingDiverged, the last good state saved (the skipped updates never touched the weights).
- `interrupted(run, signum)`: SIGINT / SIGTERM, flagged during a step (`StopSignal`) and acted
  on after it -> TrainingInterrupted, a checkpoint of that completed step.
- `memory_tripped(run, e, speed, metrics)`: the memory guard -> its error, the failed step
  dropped (with the debug leak) and the last good state saved (a step that completed before
  the check tripped counts).
- `on_lost_peer(run)`: around anything that talks to the other ranks: a failed collective (a
  peer died or hung) -> WorkerLost, after this survivor saved the last completed step (a step
  cut short is rolled back to its start: every survivor holds a full replica).
The checkpoint each writes is the ordinary atomic one (`run.save`, the Trainer's
`save_checkpoint`); with no output folder nothing is written. `run.record.emergency_reason`
says which stop it was.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sonata.core.errors import TrainingDiverged, TrainingInterrupted, WorkerLost
from sonata.train import distributed
from sonata.train.memory import MemoryBudgetExceeded, peak_memory_bytes
from sonata.train.record import RunRecord


@dataclass(frozen=True)
class RunHandle:
    """What the early stops need of a run (the Trainer makes one for its run)."""
    record: RunRecord
    out_dir: Path | None                    # the run folder; None: nothing is saved
    ranks: distributed.Ranks
    device: torch.device
    save: Callable[..., Path | None]        # save(any_rank=False) -> the checkpoint, None if not written
    drop_step: Callable[[], None]           # a failed step's gradients and the debug leak dropped
    roll_back: Callable[[], None]           # a step cut short back to its start (nothing between steps)


class StopSignal:
    """While training, SIGINT/SIGTERM set a flag; the loop stops between steps, so an
    emergency checkpoint never catches an optimizer step half-applied."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:        # a second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _emergency(run: RunHandle, reason: str) -> Path | None:
    run.record.emergency_reason = reason
    return run.save() if run.out_dir else None


def _saved(path: Path | None) -> bool:
    """A checkpoint is there to name (a model with non-finite weights is never written)."""
    return path is not None and path.exists()


def diverged(run: RunHandle, consecutive: int, limit: int) -> None:
    """Raise TrainingDiverged once `limit` (train.max_nonfinite) updates in a row were skipped
    (`consecutive`: the Updater's count)."""
    if consecutive < limit:
        return
    path = _emergency(run, "nonfinite")
    old = run.out_dir / "checkpoint.pt" if run.out_dir else None
    where = (f"updates were skipped, the last good state is in {path}" if _saved(path) else
             f"the model's weights are not finite: {old} keeps an earlier step" if _saved(old) else
             "the model's weights are not finite: no checkpoint was written" if run.out_dir else
             "no checkpoint (no --out)")
    step = run.record.step
    raise TrainingDiverged(f"{consecutive} consecutive non-finite steps, the last at step {step}", where,
                           "lower train.lr or check the data", step=step, agreed=run.ranks.parallel)


def interrupted(run: RunHandle, signum: int) -> None:
    name = signal.Signals(signum).name
    path = _emergency(run, name)
    raise TrainingInterrupted(f"stopped by {name} after step {run.record.step}",
                              f"resume with --resume {path}" if _saved(path) else "no checkpoint was written",
                              signum=signum, step=run.record.step, agreed=run.ranks.parallel)


def memory_tripped(run: RunHandle, e: MemoryBudgetExceeded, speed, metrics) -> MemoryBudgetExceeded:
    """The error to raise. A step the check after it tripped still counts (in `speed`, the run's
    Throughput) and is listed and logged (to `metrics`, its MetricsLog or None) with every row's fields."""
    rec = run.record
    done = rec.unlisted_row()
    if done is not None:
        speed.add(done, done["step_tokens"], rec.counters["nonfinite_steps"],
                  max(peak_memory_bytes(run.device), done["step_peak_bytes"]))
        rec.history.append(done)
        if metrics:
            metrics.write(done)
    run.drop_step()                               # a debug leak must not reach the checkpoint
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    return e.stopped(rec.step, _emergency(run, "memory")).replace(agreed=run.ranks.parallel)


@contextlib.contextmanager
def on_lost_peer(run: RunHandle):
    try:
        yield
    except Exception as e:       # noqa: BLE001 - only a lost peer is handled here
        if run.ranks.parallel and distributed.is_comm_error(e):
            raise _lost_peer(run, e) from None
        raise


def _lost_peer(run: RunHandle, e: BaseException) -> WorkerLost:
    run.roll_back()                               # the model and optimizer are untouched
    run.record.emergency_reason = "lost a peer"
    path = run.save(any_rank=True) if run.out_dir else None
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return WorkerLost(first, checkpoint=path, step=run.record.step, rank=run.ranks.rank)


__all__ = ["RunHandle", "StopSignal", "diverged", "interrupted", "memory_tripped", "on_lost_peer"]
