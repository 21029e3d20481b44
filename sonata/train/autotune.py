"""The micro-batch autotuner: measure each candidate, train with the fastest that fits.

For every candidate micro-batch of the profile (default 1, 2, 4, 6, 8, 12, 16, 24,
32) it runs real optimizer steps of the trainer on real batches: `warmup` steps
that are not timed, then `steps` timed ones; a step processes the candidate's
micro-batches up to the effective batch (micro x ceil(effective / micro)
sequences), so every candidate is timed on the work of one optimizer step.
Per candidate it records the median tokens/s, the peak memory (allocator peak on
CUDA, sampled resident set on CPU) and whether that peak fits the memory budget.
An out-of-memory error is caught by type and marks the candidate as not fitting;
a candidate whose peak, extrapolated from the measured ones (the steepest growth
per sequence between consecutive candidates so far, times PREDICT_SAFETY), would
pass the budget is not run at all, so the tuner does not push the process past
the budget (the first two candidates are always run: two points make a slope).

Eligible: fits the budget, at most the profile's `max_micro_batch`, and divides
the effective batch (so micro x accumulation equals it exactly). The choice is
the fastest eligible candidate. Candidates above the cap are still measured, so
the table shows what the cap costs.

Profiling does not change the training run: the training state (model,
optimizer, scaler, sampler, step counters, every RNG) is saved before and
restored after (the `state_dict` / `load_state_dict` callables: the Trainer's),
and each candidate runs as its own `Plan` (through the `step` callable: the
Trainer's `train_step`), so neither the run's plan nor the config changes.
Training with the returned plan is bit-identical to training with the chosen
micro-batch fixed (tests/train/test_autotune.py checks it).
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from sonata.core.errors import SonataError
from sonata.train import distributed
from sonata.train.memory import PeakSampler, fmt_mib, is_out_of_memory, release_free_memory
from sonata.train.plan import Plan

WARMUP_STEPS = 2
MEASURED_STEPS = 3
PREDICT_SAFETY = 1.5   # the allocator's growth is lumpy: extrapolate with room to spare


@dataclass
class Candidate:
    micro_batch: int
    accumulation: int            # micro-steps per measured step
    status: str                  # measured | oom | skipped
    tok_per_s: float | None = None
    step_s: float | None = None
    peak_mem_bytes: int | None = None
    fits: bool = False           # peak within the budget
    within_cap: bool = False     # <= profile.max_micro_batch
    divides: bool = False        # divides the effective batch
    eligible: bool = False
    note: str = ""


@dataclass
class AutotuneResult:
    profile: dict
    effective_batch: int
    budget_bytes: int
    table: list = field(default_factory=list)       # Candidate dicts, ascending micro-batch
    micro_batch: int | None = None                  # the choice
    accumulation: int | None = None
    reason: str = ""
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[dict]:
        """The table for display (sonata.lab.plots.table): one row per candidate."""
        out = []
        for c in self.table:
            c = c if isinstance(c, dict) else asdict(c)
            out.append({
                "micro": c["micro_batch"], "accum": c["accumulation"],
                "tok/s": None if c["tok_per_s"] is None else round(c["tok_per_s"]),
                "peak MiB": None if c["peak_mem_bytes"] is None else round(c["peak_mem_bytes"] / 2**20, 1),
                "fits": "yes" if c["fits"] else "no", "in cap": "yes" if c["within_cap"] else "no",
                "divides": "yes" if c["divides"] else "no",
                "note": "<- chosen" if c["micro_batch"] == self.micro_batch else c["note"]})
        return out


def autotune(step, state_dict, load_state_dict, *, profile, plan: Plan, device: torch.device, seq_len: int,
             warmup: int = WARMUP_STEPS, steps: int = MEASURED_STEPS, progress=None) -> AutotuneResult:
    """Measure `profile`'s candidates for the batch of `plan` (one process's plan: see
    Plan.alone) and return the table and the choice (`choose_plan` makes it a plan).
    `step(plan)`: one optimizer step under a candidate's plan -> its metrics row (its
    `step_s`); `state_dict()` / `load_state_dict(state)`: the training state, left exactly as
    it was; `device`: where the steps run (their peak memory); `seq_len`: tokens per sequence."""
    prof, base = profile, plan
    eff = base.effective_batch
    budget = prof.memory_budget_bytes
    res = AutotuneResult(profile=prof.to_dict(), effective_batch=eff, budget_bytes=budget)
    t_start = time.perf_counter()
    snap = copy.deepcopy(state_dict())
    release_free_memory(device)
    last_peak = last_mb = per_seq = None
    try:
        for mb in sorted(prof.candidates):
            acc = -(-eff // mb)
            c = Candidate(micro_batch=mb, accumulation=acc, status="skipped",
                          within_cap=mb <= prof.max_micro_batch, divides=eff % mb == 0)
            predicted = (None if per_seq is None else
                         last_peak + PREDICT_SAFETY * per_seq * (mb - last_mb))
            if predicted is not None and predicted > budget:
                c.note = f"predicted peak {fmt_mib(predicted)} > budget"
                res.table.append(c)
                if progress:
                    progress.update(1)
                continue
            load_state_dict(snap)
            release_free_memory(device)
            cand = Plan(mb, acc, mb * acc, base.precision, 1, "autotune candidate")
            try:
                times = []
                with PeakSampler(device) as peak:
                    for i in range(warmup + steps):
                        row = step(cand)
                        if i >= warmup:
                            times.append(row["step_s"])
                step_s = statistics.median(times)
                c.status, c.step_s = "measured", step_s
                c.tok_per_s = cand.effective_batch * seq_len / step_s
                c.peak_mem_bytes = peak.peak
                c.fits = peak.peak <= budget
                if not c.fits:
                    c.note = "peak over the budget"
                if last_peak is not None:
                    per_seq = max(per_seq or 0.0, (peak.peak - last_peak) / (mb - last_mb))
                last_peak, last_mb = peak.peak, mb
            except Exception as e:          # noqa: BLE001 - only OOM is expected; others re-raised
                if not is_out_of_memory(e):
                    raise
                c.status, c.note = "oom", "out of memory"
                load_state_dict(snap)                        # the failed step's gradients dropped
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                last_peak, last_mb = budget, mb              # anything larger is predicted over too
                per_seq = max(per_seq or 0.0, 1.0)
            if not c.within_cap and not c.note:
                c.note = f"above the cap {prof.max_micro_batch}"
            elif not c.divides and not c.note:
                c.note = f"does not divide {eff}"
            c.eligible = c.status == "measured" and c.fits and c.within_cap and c.divides
            res.table.append(c)
            if progress:
                progress.update(1, micro=mb, **({"tok/s": round(c.tok_per_s)} if c.tok_per_s else {}))
    finally:
        load_state_dict(snap)
    eligible = [c for c in res.table if c.eligible]
    if eligible:
        best = max(eligible, key=lambda c: c.tok_per_s)
        res.micro_batch, res.accumulation = best.micro_batch, eff // best.micro_batch
        res.reason = (f"fastest of {len(eligible)} eligible candidates (fit {fmt_mib(budget)}, "
                      f"<= cap {prof.max_micro_batch}, divide the effective batch {eff})")
    else:
        res.reason = (f"no candidate fits the budget {fmt_mib(budget)}, is within the cap "
                      f"{prof.max_micro_batch} and divides the effective batch {eff}")
    res.table = [asdict(c) for c in res.table]
    res.wall_s = time.perf_counter() - t_start
    return res


def choose_plan(step, state_dict, load_state_dict, *, profile, plan: Plan, device: torch.device,
                seq_len: int, is_main: bool = True, progress=None) -> tuple[Plan, dict]:
    """Autotune (`autotune`'s arguments; `plan`: the run's) and return (the plan to train
    with, the result as a dict).

    Data parallel (`plan.world_size` processes; `is_main`: this is rank 0): rank 0 measures the candidates alone, on the bare model (no
    collectives, so nothing can leave the ranks out of step), for its share of the
    batch (the micro-batch decides per-process throughput and memory); the other ranks
    wait (a long-timeout group) and take its choice, so every rank trains with the
    same micro-batch. Call it before the model is wrapped in DDP. Raises SonataError
    (agreed over ranks) when no candidate is eligible."""
    world = plan.world_size
    tune = dict(profile=profile, device=device, seq_len=seq_len, progress=progress)
    if world == 1:
        res = autotune(step, state_dict, load_state_dict, plan=plan, **tune).to_dict()
    else:
        outcome = None
        if is_main:
            try:
                outcome = {"result": autotune(step, state_dict, load_state_dict, plan=plan.alone(), **tune).to_dict()}
            except SonataError as e:
                outcome = {"error": str(e)}
            except Exception as e:       # noqa: BLE001 - the others must not wait forever
                outcome = {"error": f"autotune failed on rank 0: {type(e).__name__}: {e}"}
                raise
            finally:
                outcome = distributed.broadcast_object(outcome, src=0, wait=True)
        else:
            outcome = distributed.broadcast_object(None, src=0, wait=True)
        if "error" in outcome:
            raise SonataError(outcome["error"], agreed=True)
        res = outcome["result"]
    if res["micro_batch"] is None:
        raise SonataError(f"autotune: {res['reason']}",
                          "raise profile.memory_budget_mb or use train.fixed_micro_batch", agreed=world > 1)
    how = (f"autotuned: {res['reason']}" if world == 1 else
           f"autotuned on rank 0 for the per-process batch {res['effective_batch']} "
           f"(global {plan.effective_batch} / {world} processes): {res['reason']}")
    return plan.with_batch(res["micro_batch"], how), res


def cap_cost(result: dict) -> dict:
    """What the profile's cap costs: the chosen candidate against the fastest measured
    one that fits the budget, cap ignored."""
    fits = [c for c in result["table"] if c["status"] == "measured" and c["fits"]]
    chosen = next((c for c in result["table"] if c["micro_batch"] == result["micro_batch"]), None)
    if not fits or chosen is None:
        return {}
    best = max(fits, key=lambda c: c["tok_per_s"])
    return {"chosen_micro": chosen["micro_batch"], "chosen_tok_per_s": chosen["tok_per_s"],
            "fastest_micro": best["micro_batch"], "fastest_tok_per_s": best["tok_per_s"],
            "cost_fraction": 1 - chosen["tok_per_s"] / best["tok_per_s"],
            "chosen_peak_bytes": chosen["peak_mem_bytes"], "fastest_peak_bytes": best["peak_mem_bytes"]}
