"""How a training run stops early, and what it saves: each function takes the `Trainer`.

- `diverged(tr)`: train.max_nonfinite non-finite steps in a row -> TrainingDiverged, the last
  good state saved (the skipped updates never touched the weights).
- `interrupted(tr, signum)`: SIGINT / SIGTERM, flagged during a step and acted on after it ->
  TrainingInterrupted, a checkpoint of that completed step.
- `memory_tripped(tr, e)`: the memory guard -> its error, the debug leak dropped and the last
  good state saved.
- `on_lost_peer(tr)`: around anything that talks to the other ranks: a failed collective (a
  peer died or hung) -> WorkerLost, after this survivor saved the last completed step (a step
  cut short is rolled back to its start: every survivor holds a full replica).
The checkpoint each writes is the ordinary atomic one (`Trainer.save_checkpoint`); with no
output folder nothing is written. `tr.emergency_reason` says which stop it was.
"""
from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import torch

from sonata.core.errors import TrainingDiverged, TrainingInterrupted, WorkerLost
from sonata.core.rng import set_rng_state
from sonata.train import distributed
from sonata.train.memory import MemoryBudgetExceeded


def _emergency(tr, reason: str) -> Path | None:
    tr.emergency_reason = reason
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
    raise TrainingDiverged(f"{n} consecutive non-finite steps, the last at step {tr.step}", where,
                           "lower train.lr or check the data", step=tr.step, agreed=tr.world > 1)


def interrupted(tr, signum: int) -> None:
    name = signal.Signals(signum).name
    path = _emergency(tr, name)
    raise TrainingInterrupted(f"stopped by {name} after step {tr.step}",
                              f"resume with --resume {path}" if _saved(path) else "no checkpoint was written",
                              signum=signum, step=tr.step, agreed=tr.world > 1)


def memory_tripped(tr, e: MemoryBudgetExceeded) -> MemoryBudgetExceeded:
    tr.injected_leak.clear()                      # a debug leak must not reach the checkpoint
    tr.optimizer.zero_grad(set_to_none=True)      # the gradients of a failed step
    if tr.device.type == "cuda":
        torch.cuda.empty_cache()
    return e.stopped(tr.step, _emergency(tr, "memory")).replace(agreed=tr.world > 1)


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
    tr.emergency_reason = "lost a peer"
    path = tr.save_checkpoint(any_rank=True) if tr.out_dir else None
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return WorkerLost(first, checkpoint=path, step=tr.step, rank=tr.rank)


__all__ = ["diverged", "interrupted", "memory_tripped", "on_lost_peer"]
