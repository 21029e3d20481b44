"""How a training run stops early, and what it saves: each function takes the `Trainer` (and
reads its run's record, `tr.record`: sonata.train.record).

- `diverged(tr)`: train.max_nonfinite non-finite steps in a row -> TrainingDiverged, the last
  good state saved (the skipped updates never touched the weights).
- `interrupted(tr, signum)`: SIGINT / SIGTERM, flagged during a step (`StopSignal`) and acted
  on after it -> TrainingInterrupted, a checkpoint of that completed step.
- `memory_tripped(tr, e, speed, metrics)`: the memory guard -> its error, the debug leak dropped
  and the last good state saved (a step that completed before the check tripped counts).
- `on_lost_peer(tr)`: around anything that talks to the other ranks: a failed collective (a
  peer died or hung) -> WorkerLost, after this survivor saved the last completed step (a step
  cut short is rolled back to its start: every survivor holds a full replica).
The checkpoint each writes is the ordinary atomic one (`Trainer.save_checkpoint`); with no
output folder nothing is written. `tr.record.emergency_reason` says which stop it was.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

import torch

from sonata.core.errors import TrainingDiverged, TrainingInterrupted, WorkerLost
from sonata.core.rng import set_rng_state
from sonata.train import distributed
from sonata.train.memory import MemoryBudgetExceeded, peak_memory_bytes


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


def _emergency(tr, reason: str) -> Path | None:
    tr.record.emergency_reason = reason
    return tr.save_checkpoint() if tr.out_dir else None


def _saved(path: Path | None) -> bool:
    """A checkpoint is there to name (a model with non-finite weights is never written)."""
    return path is not None and path.exists()


def diverged(tr) -> None:
    """Raise TrainingDiverged once train.max_nonfinite updates in a row were skipped."""
    n = tr.update.consecutive_nonfinite
    if n < tr.cfg.train.max_nonfinite:
        return
    path = _emergency(tr, "nonfinite")
    old = tr.out_dir / "checkpoint.pt" if tr.out_dir else None
    where = (f"updates were skipped, the last good state is in {path}" if _saved(path) else
             f"the model's weights are not finite: {old} keeps an earlier step" if _saved(old) else
             "the model's weights are not finite: no checkpoint was written" if tr.out_dir else
             "no checkpoint (no --out)")
    step = tr.record.step
    raise TrainingDiverged(f"{n} consecutive non-finite steps, the last at step {step}", where,
                           "lower train.lr or check the data", step=step, agreed=tr.world > 1)


def interrupted(tr, signum: int) -> None:
    name = signal.Signals(signum).name
    path = _emergency(tr, name)
    raise TrainingInterrupted(f"stopped by {name} after step {tr.record.step}",
                              f"resume with --resume {path}" if _saved(path) else "no checkpoint was written",
                              signum=signum, step=tr.record.step, agreed=tr.world > 1)


def memory_tripped(tr, e: MemoryBudgetExceeded, speed, metrics) -> MemoryBudgetExceeded:
    """The error to raise. A step the check after it tripped still counts (in `speed`, the run's
    Throughput) and is listed and logged (to `metrics`, its MetricsLog or None) with every row's fields."""
    done = tr.record.unlisted_row()
    if done is not None:
        speed.add(done, done["step_tokens"], tr.record.counters["nonfinite_steps"],
                  max(peak_memory_bytes(tr.device), done["step_peak_bytes"]))
        tr.record.history.append(done)
        if metrics:
            metrics.write(done)
    tr.injected_leak.clear()                      # a debug leak must not reach the checkpoint
    tr.optimizer.zero_grad(set_to_none=True)      # the gradients of a failed step
    if tr.device.type == "cuda":
        torch.cuda.empty_cache()
    return e.stopped(tr.record.step, _emergency(tr, "memory")).replace(agreed=tr.world > 1)


@contextlib.contextmanager
def on_lost_peer(tr):
    try:
        yield
    except Exception as e:       # noqa: BLE001 - only a lost peer is handled here
        if tr.world > 1 and distributed.is_comm_error(e):
            raise _lost_peer(tr, e) from None
        raise


def _lost_peer(tr, e: BaseException) -> WorkerLost:
    if tr.step_start is not None:                 # the model and optimizer are untouched
        sampler, rng = tr.step_start
        tr.sampler.load_state_dict(sampler)
        set_rng_state(rng)
        tr.optimizer.zero_grad(set_to_none=True)
    tr.record.emergency_reason = "lost a peer"
    path = tr.save_checkpoint(any_rank=True) if tr.out_dir else None
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return WorkerLost(first, checkpoint=path, step=tr.record.step, rank=tr.rank)


__all__ = ["StopSignal", "diverged", "interrupted", "memory_tripped", "on_lost_peer"]
