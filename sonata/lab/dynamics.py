"""Contracting dynamics: does the state transition exp(delta*A) stay below 1?

With `model.a_param=log`, A = -exp(A_log) < 0 by construction, so every decay
exp(delta*A) is in (0, 1) and the recurrence is contracting. With `direct`, A is
a free parameter: a large learning rate can push an entry above 0, the decay
above 1, and the state then grows like exp(delta*A*L) along the sequence. The
post-step constraint (`model.a_constraint`) projects A back to A <= -a_min after
every optimizer step. These helpers run the comparison and return records
(notebook 05 writes what they say).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sonata.core.config import make_config
from sonata.core.errors import TrainingDiverged
from sonata.model.lm import max_decay
from sonata.train.trainer import Trainer

VARIANTS = {
    "direct": {"model.a_param": "direct", "model.a_constraint": False},
    "direct + constraint": {"model.a_param": "direct", "model.a_constraint": True},
    "log (A_log)": {"model.a_param": "log", "model.a_constraint": False},
}


@dataclass
class DynamicsRun:
    variant: str
    lr: float
    steps: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    max_decay: list = field(default_factory=list)
    nonfinite_steps: int = 0
    diverged_at: int | None = None     # step at which training stopped on non-finite values
    final_loss: float | None = None

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None

    def row(self) -> dict:
        return {"variant": self.variant, "lr": self.lr, "steps run": len(self.steps),
                "final loss": None if self.final_loss is None else round(self.final_loss, 4),
                "max exp(dA) seen": f"{max(self.max_decay):.6g}" if self.max_decay else "-",
                "non-finite steps": self.nonfinite_steps,
                "verdict": f"diverged at step {self.diverged_at}" if self.diverged else "stable"}


def run_variant(variant: str, lr: float, overrides: dict, probe_batch: int = 4,
                progress: str | None = "none") -> DynamicsRun:
    """Train one variant at one learning rate, recording loss and max exp(delta*A) per step."""
    cfg = make_config({**overrides, **VARIANTS[variant], "train.lr": lr})
    trainer = Trainer(cfg, None, progress=progress)
    before = trainer.sampler.state_dict()
    probe, _ = trainer.sampler.draw(probe_batch)      # a fixed probe batch, drawn once
    trainer.sampler.load_state_dict(before)           # ...without shifting the training batches
    run = DynamicsRun(variant, lr)

    def record(tr, row):
        row["max_decay"] = max_decay(tr.model, probe)
        run.steps.append(row["step"])
        run.loss.append(row["loss"])
        run.max_decay.append(row["max_decay"])

    try:
        trainer.run(on_step=record)
    except TrainingDiverged:
        run.diverged_at = trainer.step
    run.nonfinite_steps = trainer.counters["nonfinite_steps"]
    finite = [v for v in run.loss if v == v and abs(v) != float("inf")]
    run.final_loss = sum(finite[-10:]) / len(finite[-10:]) if finite else None
    return run


def lr_sweep(variant: str, lrs, overrides: dict, **kw) -> list[DynamicsRun]:
    return [run_variant(variant, lr, overrides, **kw) for lr in lrs]


def first_divergent_lr(runs: list[DynamicsRun]) -> float | None:
    """Smallest learning rate whose run diverged (or whose decay exceeded 1)."""
    bad = [r.lr for r in runs if r.diverged or (r.max_decay and max(r.max_decay) > 1.0)]
    return min(bad) if bad else None
