"""The run's length in one place: `Schedule` owns the learning rate of every step, a time
budget's progress, when the run stops (and why), and the conversion of a budgeted run into
steps on resume. The trainer asks it; nothing else keeps a run's clock.

Two kinds of run. A step-based run (train.max_steps, train.max_seconds 0) has the rate of
`lr_at`: linear warm-up, then a cosine to the floor (train.lr * train.min_lr_ratio) at
train.decay_steps (0: train.max_steps), constant after. A budgeted run (train.max_seconds > 0)
counts *training time*, the time inside optimizer steps (setup, autotuning, evaluation and
checkpoints are not counted), and has the rate of `lr_at_progress`: the same cosine over the
fraction of the budget used, where each step's fraction is projected to its end (the time so
far plus the last step's); the step projected to reach the budget trains at the floor and is
the last. train.max_steps > 0 still caps a budgeted run: whichever comes first ends it.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import replace

from sonata.core.errors import ConfigError


def _cosine(frac: float, t) -> float:
    """train.lr at frac 0, train.lr * train.min_lr_ratio (the floor) at frac 1, cosine between."""
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def lr_at(step: int, t) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then cosine to
    min_lr at train.decay_steps (0: train.max_steps), constant after. From that horizon on the
    rate is the floor even where warm-up would still run (a horizon within the warm-up: a budgeted
    run that used its budget in its first steps resumes at the floor, as continue_in_steps says)."""
    horizon = t.decay_steps or t.max_steps
    if horizon and step >= horizon:
        return _cosine(1.0, t)
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, (t.decay_steps or t.max_steps) - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    return _cosine(frac, t)


def lr_at_progress(step: int, progress: float, t) -> float:
    """Learning rate of a time-budgeted run (train.max_seconds) for optimizer step `step`
    ending at `progress`, the fraction of the budget used (in [0, 1]): the cosine of
    `lr_at` over the budget, so the step that ends the budget (progress 1) trains at the
    floor, train.lr * train.min_lr_ratio. Warm-up stays in steps: the rate rises linearly
    over train.warmup_steps and never exceeds the cosine."""
    lr = _cosine(min(1.0, max(0.0, progress)), t)
    if t.warmup_steps and step < t.warmup_steps:
        lr = min(lr, t.lr * (step + 1) / t.warmup_steps)
    return lr


def continue_in_steps(t, state: dict):
    """The train.* values of a run resumed from `state` (a checkpoint's dict): `t` itself,
    unless the checkpoint's run had a time budget.

    A budgeted run resumes *in steps*: the resumed run is an ordinary step-based run
    (train.max_seconds 0) whose cosine horizon (train.decay_steps) is the number of
    steps the whole budget reaches at the pace the run had, steps / (fraction of the
    budget used): for a run that used its budget (its last step ran at budget progress
    1, the checkpoint's `budget_progress`; its measured time may end a little short),
    the steps it reached (the resumed run trains at the floor), for an interrupted one
    its steps so far extrapolated to the end of its budget. train.max_steps becomes that horizon (within the budgeted
    run's step cap, if it had one), unless changed on resume. Why steps, not a fresh
    or remaining budget: time is not reproducible, steps are; from the checkpoint on,
    two resumes train identically, and a resumed run's own checkpoints resume like
    any step-based run. A budget cannot be changed (or added) on resume: a new budget
    is a new run (ConfigError)."""
    saved = state.get("config", {}).get("train", {})
    budget = float(saved.get("max_seconds", 0) or 0)
    if t.max_seconds and t.max_seconds != budget:
        raise ConfigError(f"train.max_seconds cannot be {'changed' if budget else 'set'} on resume "
                          f"(a resumed run continues in steps: set train.max_steps; a new budget is a new run)")
    steps, used = int(state.get("step", 0)), float(state.get("train_seconds", 0.0))
    if not budget or steps == 0 or used <= 0:
        return t                     # a step-based run, or a budgeted one that spent nothing yet
    if float(state.get("budget_progress", 0.0)) >= 1.0:
        horizon = steps              # its last step ran at the floor (its time may end a bit short)
    else:
        horizon = max(steps, round(steps / min(1.0, used / budget)))
    cap = int(saved.get("max_steps", 0))
    max_steps = t.max_steps if t.max_steps != cap else (min(horizon, cap) if cap else horizon)
    decay = t.decay_steps if t.decay_steps != int(saved.get("decay_steps", 0)) else horizon
    return replace(t, max_seconds=0.0, max_steps=max_steps, decay_steps=decay)


class Schedule:
    """One run's clock: `lr(step)`, `progress()` under a budget, `count(step_s, row, progress)`
    after each step, `finished(step, row)` (and why: `ended_by`, "time" or "steps"). Its state
    (training seconds, the last step's budget fraction) travels in the checkpoint."""

    def __init__(self, t):
        self.t = t
        self.train_seconds = 0.0      # time inside optimizer steps, all runs of this model (resumes add)
        self.last_step_s = 0.0        # the last step's time (data parallel: the slowest rank's)
        self.last_progress = 0.0      # under a budget: the budget fraction the last step ran at
        self.ended_by: str | None = None

    @property
    def budgeted(self) -> bool:
        return bool(self.t.max_seconds)

    def progress(self) -> float:
        """Under train.max_seconds: the fraction of the budget that will be used when the
        next step ends, estimated as the training seconds so far plus the last step's
        time (at most 1; the step that reaches 1 is the run's last)."""
        return min(1.0, (self.train_seconds + self.last_step_s) / self.t.max_seconds)

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (the next one)."""
        return lr_at_progress(step, self.progress(), self.t) if self.budgeted else lr_at(step, self.t)

    def start(self) -> None:
        """Before a run's first step: an autotuner's steps do not count towards the budget."""
        self.last_step_s = 0.0
        self.ended_by = None

    def count(self, step_s: float, row: dict, progress: float | None) -> None:
        """A finished step: its time (`row["train_s"]`, the total so far) and, under a budget,
        the fraction `progress` it ran at (`row["progress"]`)."""
        if progress is not None:
            row["progress"] = self.last_progress = progress
        self.last_step_s = step_s
        self.train_seconds += step_s
        row["train_s"] = self.train_seconds

    def finished(self, step: int, row: dict | None = None) -> bool:
        """Whether the run is over, and why (`ended_by`): its budget spent (the step of
        `row` ran at progress 1) or its step count reached."""
        t = self.t
        if self.ended_by is None:
            if t.max_seconds and row is not None and row["progress"] >= 1.0:
                self.ended_by = "time"
            elif step >= t.max_steps and (t.max_steps or not t.max_seconds):
                self.ended_by = "steps"
        return self.ended_by is not None

    def warn_if_capped(self) -> None:
        t = self.t
        if t.max_seconds and self.ended_by == "steps" and t.min_lr_ratio < 1:
            warnings.warn(f"sonata: train.max_steps={t.max_steps} ended the run after {self.train_seconds:.1f} s "
                          f"of its {t.max_seconds:g} s budget (the learning rate had not reached its floor); "
                          f"train.max_steps=0 lifts the step cap", UserWarning, stacklevel=5)

    def bar(self, step: int) -> tuple[int, str]:
        """(total, label) of the progress bar: steps to go, or under a budget its whole seconds."""
        if self.budgeted:
            return math.ceil(self.t.max_seconds), f"train ({self.t.max_seconds:g} s budget, seconds)"
        return self.t.max_steps - step, "train"

    def bar_units(self, bar) -> int:
        """How far to move the bar after a step."""
        if not self.budgeted:
            return 1
        done = bar.total if self.ended_by == "time" else min(bar.total, int(self.train_seconds))
        return max(0, done - bar.n)

    def state_dict(self) -> dict:
        return {"train_seconds": self.train_seconds, "budget_progress": self.last_progress}

    def load_state_dict(self, state: dict) -> None:
        self.train_seconds = float(state.get("train_seconds", 0.0))


__all__ = ["Schedule", "lr_at", "lr_at_progress", "continue_in_steps"]
