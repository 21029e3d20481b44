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

Profiling does not change the training run: the model, optimizer, scaler,
sampler, step counters and every RNG are saved before and restored after, so
training after autotuning is bit-identical to training with the chosen
micro-batch fixed (tests/test_autotune.py checks it).
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from sonata import kernels
from sonata.memory import PeakSampler, fmt_mib, is_out_of_memory, release_free_memory, too_few_steps

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
        """The table for display (sonata.plots.table): one row per candidate."""
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


def _snapshot(trainer) -> dict:
    from sonata.trainer import rng_state
    return copy.deepcopy({
        "model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
        "scaler": trainer.scaler.state_dict(), "sampler": trainer.sampler.state_dict(),
        "step": trainer.step, "tokens": trainer.tokens, "counters": dict(trainer.counters),
        "consecutive": trainer._consecutive_nonfinite, "rng": rng_state(),
        "micro_batch": trainer.cfg.train.micro_batch, "effective_batch": trainer.cfg.train.effective_batch,
        "fallbacks": kernels.fallback_count()})


def _restore(trainer, snap: dict) -> None:
    from sonata.trainer import set_rng_state
    trainer.model.load_state_dict(snap["model"])
    trainer.optimizer.load_state_dict(snap["optimizer"])
    if snap["scaler"]:
        trainer.scaler.load_state_dict(snap["scaler"])
    trainer.sampler.load_state_dict(snap["sampler"])
    trainer.step, trainer.tokens = snap["step"], snap["tokens"]
    trainer.counters.clear()
    trainer.counters.update(snap["counters"])
    trainer._consecutive_nonfinite = snap["consecutive"]
    trainer.cfg.train.micro_batch = snap["micro_batch"]
    trainer.cfg.train.effective_batch = snap["effective_batch"]
    trainer.optimizer.zero_grad(set_to_none=True)
    set_rng_state(snap["rng"])


def autotune(trainer, warmup: int = WARMUP_STEPS, steps: int = MEASURED_STEPS,
             progress=None) -> AutotuneResult:
    """Measure the profile's candidates on `trainer` and return the table and choice.
    The trainer's state is left exactly as it was (its batch is not changed: see
    `Trainer.apply_autotune`)."""
    prof = trainer.profile
    t = trainer.cfg.train
    eff = t.effective_batch
    budget = prof.memory_budget_bytes
    res = AutotuneResult(profile=prof.to_dict(), effective_batch=eff, budget_bytes=budget)
    t_start = time.perf_counter()
    snap = _snapshot(trainer)
    release_free_memory(trainer.device)
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
            _restore(trainer, snap)
            release_free_memory(trainer.device)
            t.micro_batch, t.effective_batch = mb, mb * acc
            try:
                times = []
                with PeakSampler(trainer.device) as peak:
                    for i in range(warmup + steps):
                        row = trainer.train_step()
                        if i >= warmup:
                            times.append(row["step_s"])
                step_s = statistics.median(times)
                c.status, c.step_s = "measured", step_s
                c.tok_per_s = mb * acc * trainer.cfg.data.seq_len / step_s
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
                trainer.optimizer.zero_grad(set_to_none=True)
                if trainer.device.type == "cuda":
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
        _restore(trainer, snap)
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


def sustained_and_peak(overrides, sustained_steps: int, peak_micro: int, peak_steps: int,
                       progress: str | None = None) -> list[dict]:
    """The dossier's two figures, measured side by side on this machine:

    - *sustained*: a training run under the profile's default batch (micro-batch within
      the cap, accumulation up to the effective batch), `sustained_steps` steps with
      its validation and checkpointing as configured;
    - *peak micro-benchmark*: `train.fixed_micro_batch=peak_micro` (no cap), a few
      steps, no validation until the end and that on one window.

    Each row gives three readings: end to end (tokens / wall time of the whole run),
    steps only (the trainer's sustained figure: step time alone, warm-up excluded) and
    the single best step."""
    import warnings

    from sonata.config import make_config
    from sonata.trainer import MEASURE_SKIP, Trainer

    runs = [("sustained (profile default)", list(overrides) + [f"train.max_steps={sustained_steps}"]),
            (f"peak micro-benchmark (fixed micro-batch {peak_micro})",
             list(overrides) + [f"train.max_steps={peak_steps}", f"train.fixed_micro_batch={peak_micro}",
                                "train.eval_every=0", "train.eval_tokens=1"])]
    rows = []
    for name, ov in runs:
        cfg = make_config(ov)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)     # the fixed-batch warning: this row says it
            tr = Trainer(cfg, None, progress=progress)
        s = tr.run()
        steps = [r["tok_per_s"] for r in tr.history[MEASURE_SKIP:]] or [r["tok_per_s"] for r in tr.history]
        step_s = sum(r["step_s"] for r in tr.history)
        rows.append({"run": name, "profile": tr.profile.name,
                     "micro x accum": f"{s['micro_batch']} x {s['accumulation']}",
                     "steps": s["steps"], "tokens": s["tokens"],
                     "end-to-end tok/s": round(s["tokens"] / s["wall_s"]),
                     "steps-only tok/s": (too_few_steps(MEASURE_SKIP + 1) if s["tok_per_s_sustained"] is None
                                          else round(s["tok_per_s_sustained"])),
                     "best step tok/s": round(max(steps)),
                     "outside steps s": round(s["wall_s"] - step_s, 2)})
    return rows


def sustained_vs_peak_text(rows: list[dict]) -> str:
    """What `sustained_and_peak`'s two rows say, as ratios; a reading that the runs were
    too short to give is named instead of divided."""
    sustained, peak = rows

    def ratio(a, b):
        ok = all(isinstance(v, (int, float)) and v > 0 for v in (a, b))
        return f"{a / b:.2f}x" if ok else (a if isinstance(a, str) else b if isinstance(b, str)
                                            else "no figure (a reading rounded to 0 tokens/s)")

    return (f"sustained, end to end: {sustained['end-to-end tok/s']:,} tokens/s; "
            f"peak, best step: {peak['best step tok/s']:,} tokens/s; "
            f"ratio {ratio(peak['best step tok/s'], sustained['end-to-end tok/s'])}\n"
            f"of which batch size alone (steps only, peak vs sustained): "
            f"{ratio(peak['steps-only tok/s'], sustained['steps-only tok/s'])}; "
            f"best step vs median steps in the peak run: {ratio(peak['best step tok/s'], peak['steps-only tok/s'])}; "
            f"validation and checkpoints in the sustained run: {sustained['outside steps s']:.1f} s outside steps")


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
