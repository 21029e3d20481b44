"""A run's bookkeeping in one record: how far it got (step, tokens), its metrics rows (history,
and the row a checkpoint carries), where the time went (setup, evaluation, checkpoints, the
last step, when the last checkpoint was written), what it resumed from (step and file), the
autotuner's result, the skipped updates and what ended it.

The Trainer owns one (`trainer.record`) and writes it as the run goes; the early stops
(sonata.train.stops) write `emergency_reason`. The summary (sonata.train.summary) and the stops
read it; the machinery (model, optimizer, sampler, schedule, plan, device, config) stays on
the Trainer. `resume(state)` takes the record's part of a checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunRecord:
    step: int = 0                          # optimizer steps done (a resumed run's included)
    tokens: int = 0                        # tokens trained on, over every rank
    history: list[dict] = field(default_factory=list)     # the metrics rows of run()'s steps, one a step
    # the metrics row of the last completed step when metrics.jsonl gets it (a checkpoint
    # carries it: a resume writes it when the file lacks it), and the one resumed from
    last_row: dict | None = None
    resumed_last_row: dict | None = None
    setup_seconds: float = 0.0             # before the first step of run() (autotuning, kernel warm-up)
    eval_seconds: float = 0.0              # validation inside run()
    checkpoint_seconds: list[float] = field(default_factory=list)     # each checkpoint written
    # time.monotonic() when the last checkpoint was written (or run() started): train.checkpoint_every_s
    last_checkpoint_at: float = field(default_factory=time.monotonic)
    step_seconds: float = 0.0              # this rank's time of its last optimizer step (train_step)
    resumed_from_step: int | None = None   # the checkpoint's step, for a resumed run
    # the checkpoint file resumed from (never pruned by train.keep_checkpoints; in another
    # folder, its metrics rows start this run's)
    resumed_from_file: Path | None = None
    resumed_budget: dict | None = None     # a resumed budgeted run's budget, time and steps
    autotune: dict | None = None           # the autotuner's result (a checkpoint keeps it)
    # skipped updates (nonfinite_steps, scaler_skipped_steps): the dict the Updater counts in
    counters: dict = field(default_factory=dict)
    ended_by: str | None = None            # after run(): "time" (the budget) or "steps" (summary.json's stopped_by)
    emergency_reason: str | None = None    # an early stop's (sonata.train.stops)

    @classmethod
    def starting(cls, state: dict | None, counters: dict, source=None) -> RunRecord:
        """The record of a new run, or of one resuming `state` (a checkpoint's dict, read from
        the file `source`): what it resumed from (`resume` then takes the checkpoint's progress)."""
        source = Path(source) if source else None
        if not state:
            return cls(counters=counters, resumed_from_file=source)
        budget = state.get("config", {}).get("train", {}).get("max_seconds")
        return cls(counters=counters, resumed_from_step=int(state["step"]), resumed_from_file=source,
                   resumed_budget=({"max_seconds": budget, "train_seconds": state.get("train_seconds", 0.0),
                                    "steps": state["step"]} if budget else None))

    def resume(self, state: dict) -> None:
        """The record's part of a checkpoint's state (`Trainer.state_dict()`)."""
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.counters.update(state.get("counters", {}))
        self.autotune = state.get("autotune")
        self.last_row = self.resumed_last_row = state.get("last_row")

    def add(self, row: dict, logged: bool) -> None:
        """A completed step's row; `logged`: metrics.jsonl gets it (a checkpoint then carries it)."""
        self.history.append(row)
        self.last_row = row if logged else None

    def unlisted_row(self) -> dict | None:
        """The last completed step's row when the history lacks it (the memory guard's check
        after that step tripped before the loop took the row), else None."""
        done = self.last_row
        if done is not None and done["step"] == self.step and (not self.history or self.history[-1] is not done):
            return done
        return None

    def copied_bytes(self, direction: str) -> int:
        """Bytes copied host to device ("h2d") or back ("d2h") inside this run's steps."""
        return sum(r[f"{direction}_bytes"] for r in self.history)

    def checkpoint_figures(self) -> dict:
        """The summary's checkpoints_written, checkpoint_s_mean and checkpoint_s_max."""
        saves = self.checkpoint_seconds
        return {"checkpoints_written": len(saves), "checkpoint_s_mean": sum(saves) / len(saves) if saves else None,
                "checkpoint_s_max": max(saves, default=None)}


__all__ = ["RunRecord"]
