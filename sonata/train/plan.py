"""The training plan: what a run actually trains with, resolved once.

The config says what the user asked (`train.micro_batch=0` means "the profile's
choice", `train.precision=auto` "the profile's precision"); the `Plan` says what was
chosen and why: micro-batch, accumulation (micro-steps per optimizer step on each
process), the global effective batch, precision, the number of processes and how the
batch was chosen. It is frozen, computed from config + profile (+ autotune, which
returns a new plan), kept on the trainer, in the checkpoint and in the summary.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, replace

from sonata.core.device import cpu_bf16_native
from sonata.core.errors import ConfigError


@dataclass(frozen=True)
class Plan:
    micro_batch: int        # sequences per forward/backward
    accumulation: int       # micro-steps per optimizer step, on each process
    effective_batch: int    # sequences per optimizer step, all processes together
    precision: str          # fp32 | fp16 | bf16 | int8
    world_size: int = 1     # processes
    how: str = ""           # how the micro-batch was chosen

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(**d)

    def with_batch(self, micro_batch: int, how: str) -> "Plan":
        """The same plan with another micro-batch (accumulation follows)."""
        return replace(self, micro_batch=micro_batch, how=how,
                       accumulation=self.effective_batch // (micro_batch * self.world_size))

    def alone(self) -> "Plan":
        """This process's share as a one-process plan (rank 0 autotuning on its own)."""
        per = self.effective_batch // self.world_size
        return replace(self, effective_batch=per, world_size=1, accumulation=per // self.micro_batch)


def resolve_precision(precision: str, profile) -> str:
    """train.precision as it runs: `auto` is the profile's precision; `fast` is bf16 under
    the cpu profile on a CPU that multiplies bf16 natively (AVX-512 BF16, AMX), else the
    profile's; any other value is itself."""
    if precision == "fast":
        return "bf16" if profile.name == "cpu" and cpu_bf16_native() else profile.precision
    return profile.precision if precision == "auto" else precision


def plan_batch(t, profile, world: int = 1) -> Plan:
    """The plan before any autotuning, from train.* and the profile. The effective batch
    is global: with `world` processes each trains on effective / world sequences, which
    the micro-batch must divide. Raises ConfigError for a micro-batch above the cap or a
    batch that does not split."""
    precision = resolve_precision(t.precision, profile)
    eff = t.effective_batch or profile.effective_batch
    if eff % world:
        raise ConfigError(f"train.effective_batch ({eff}) is the global batch and must be a "
                          f"multiple of the number of processes ({world})")
    per = eff // world

    def plan(mb, eff, how):
        return Plan(mb, eff // (mb * world), eff, precision, world, how)

    split = f" (train.effective_batch {eff} / {world} processes = {per})" if world > 1 else ""
    if t.fixed_micro_batch:
        n = t.fixed_micro_batch
        how = (f"fixed by train.fixed_micro_batch={n}: the autotuner and the profile cap "
               f"({profile.max_micro_batch}) are off; ")
        if per % n == 0:
            return plan(n, eff, how + f"accumulation {per // n}" + (f" on each of {world} processes"
                                                                   if world > 1 else ""))
        if world > 1:
            raise ConfigError(f"train.fixed_micro_batch ({n}) must divide the per-process batch{split}")
        # one process: a peak micro-benchmark of n sequences, whatever the effective batch
        return plan(n, n, how + f"effective batch {n}, not {eff}, which is not a multiple of {n}")
    if t.micro_batch:
        if t.micro_batch > profile.max_micro_batch:
            raise ConfigError(
                f"train.micro_batch={t.micro_batch} is above profile {profile.name}'s cap of "
                f"{profile.max_micro_batch}; raise profile.max_micro_batch, or use "
                f"train.fixed_micro_batch={t.micro_batch} for a peak micro-benchmark")
        if per % t.micro_batch:
            raise ConfigError(f"train.micro_batch ({t.micro_batch}) must divide the per-process batch{split}"
                              if world > 1 else f"train.effective_batch ({eff}) must be a multiple of "
                              f"train.micro_batch ({t.micro_batch})")
        return plan(t.micro_batch, eff, "train.micro_batch")
    fitting = [c for c in profile.candidates if c <= profile.max_micro_batch and per % c == 0]
    mb = max(fitting) if fitting else 1
    return plan(mb, eff, (f"largest candidate within profile {profile.name}'s cap that divides "
                          + (f"the per-process batch {per} ({eff} / {world} processes)" if world > 1
                             else f"{eff}")))



def resumed_inputs(t, saved_config: dict, saved_plan: dict | None, world: int):
    """The train.* values to plan a resumed run from: the checkpoint's plan where the
    user left a key as the checkpoint's config had it, the user's value where it was
    changed on resume. On a different number of processes, a micro-batch that does not
    divide the new per-process batch becomes the largest divisor below it (a warning
    says so) rather than an error. Returns a copy; `t` is not changed."""
    saved_t = saved_config.get("train", {})
    vals = {}
    if saved_plan:
        chosen = {"micro_batch": saved_plan["micro_batch"], "effective_batch": saved_plan["effective_batch"],
                  "precision": saved_plan["precision"]}
        if saved_t.get("fixed_micro_batch"):
            chosen["fixed_micro_batch"] = saved_plan["micro_batch"]
        vals = {k: v for k, v in chosen.items() if getattr(t, k) == saved_t.get(k, getattr(t, k))}
    r = replace(t, **vals)
    eff, mb = r.effective_batch, r.micro_batch or r.fixed_micro_batch
    if not (eff and mb) or eff % world:
        return r                                    # plan_batch explains what does not divide
    per = eff // world
    if per % mb == 0:
        return r
    new = max(d for d in range(1, min(mb, per) + 1) if per % d == 0)
    warnings.warn(f"sonata: the checkpoint's micro-batch {mb} does not divide the per-process "
                  f"batch {per} (global {eff} / {world} processes); training with "
                  f"micro-batch {new}", UserWarning, stacklevel=3)
    return replace(r, **({"fixed_micro_batch": new} if r.fixed_micro_batch else {"micro_batch": new}))
