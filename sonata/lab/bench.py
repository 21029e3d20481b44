"""The stability-first benchmark harness: no throughput figure without its proof.

`run_bench(overrides)` trains the configuration twice from the same seed (fresh
trainer, memory handed back to the system in between) and returns a `BenchRecord`:

- throughput: tokens/s of each window of `window` steps after `warmup` excluded
  steps, and the median window of the first run as the figure (`tok_per_s`); the
  device is synchronized before every clock read (the trainer does it per step);
- memory: the peak (allocator peak on CUDA, sampled resident set on CPU), and the
  slope of the memory after each step from the leak detector, judged at the stated
  threshold (`leak_threshold_bytes_per_step`, the allowance applied; `replay_leak`);
- stability: non-finite losses or gradients seen, a guard trip, a divergence;
- reproducibility: whether the two runs' per-step losses are identical;
- the fallback count (the fast path really ran) and host-to-device bytes in steps;
- the hardware, threads, precision, backend and batch it ran with.

The verdict is `VALID` only if every check passes; otherwise `INVALID` with one
reason per failed check. A run with `debug.leak` on is always INVALID: it is a
reproduction of a bug, never a speed.

    python -m sonata bench [key=value ...] [--steps N] [--json]

Beside it, notebook 04's readings: `correction_table`, `timing_readings`, `ratio`
(two readings' ratio, None when one is missing) and `sync_pitfall` (a clock read with
and without synchronizing the device); the notebook writes the sentences from them.
The throughput studies of notebook 02 live in `sonata.lab.throughput`.
"""
from __future__ import annotations

import math
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from sonata import kernels
from sonata.core.config import make_config
from sonata.core.device import sync
from sonata.core.errors import TrainingDiverged
from sonata.train.leak import LeakDetector
from sonata.train.memory import MemoryBudgetExceeded, fmt_mib, release_free_memory, too_few_steps
from sonata.train.trainer import Trainer

DEFAULT_STEPS = 24      # >= the leak detector's skip (2) + window (16) + a few
DEFAULT_WARMUP = 3
DEFAULT_WINDOW = 5


@dataclass
class RunRecord:
    seed: int
    steps_done: int
    losses: list
    step_s: list
    mem_bytes: list
    windows_tok_per_s: list
    tok_per_s: float | None          # median window
    tok_per_s_best_window: float | None
    tok_per_s_with_warmup: float | None   # all steps, warm-up included: the pitfall
    peak_mem_bytes: int
    mem_slope_bytes_per_step: float
    leak: bool
    nonfinite: int
    fallbacks: int
    h2d_bytes_in_steps: int
    stopped: str | None              # guard trip or divergence: its first reason
    guard_tripped: bool = False
    warnings: list = field(default_factory=list)   # sonata's warnings during the run
    steps_for_rate: int = 0          # warm-up + one window: fewer give no tokens/s
    steps_for_leak: int = 0          # fewer give the leak detector no verdict
    leak_threshold_bytes_per_step: float = 0.0   # the allowance `leak` was judged at


@dataclass
class BenchRecord:
    overrides: list
    steps: int
    warmup: int
    window: int
    tok_per_s: float | None
    tok_per_s_best_window: float | None
    tok_per_s_with_warmup: float | None
    tok_per_s_cv: float | None        # spread of the windows (stdev / mean)
    peak_mem_bytes: int
    mem_slope_bytes_per_step: float
    leak: bool
    leak_threshold_bytes_per_step: float   # the allowance `leak` was judged at (the runs' largest)
    nonfinite: int
    reproducible: bool | None
    fallbacks: int
    h2d_bytes_in_steps: int
    guard_tripped: bool
    hardware: str
    device: str
    threads: int
    precision: str
    backend: str
    micro_batch: int
    accumulation: int
    debug_leak: str
    verdict: str
    reasons: list = field(default_factory=list)
    runs: list = field(default_factory=list)

    def to_dict(self, runs: bool = True) -> dict:
        d = asdict(self)
        if not runs:
            d.pop("runs")
        return d

    def summary_row(self, name: str = "") -> dict:
        """One line for a table (notebook 04, benchmarks/)."""
        return {"run": name or " ".join(self.overrides) or "defaults",
                "tok/s (median window)": None if self.tok_per_s is None else round(self.tok_per_s),
                "peak MiB": round(self.peak_mem_bytes / 2**20, 1),
                "MiB/step": round(self.mem_slope_bytes_per_step / 2**20, 2),
                "non-finite": self.nonfinite, "reproducible": self.reproducible,
                "verdict": self.verdict, "reasons": "; ".join(self.reasons) or "-"}


def hardware_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (from /proc/cpuinfo where there is one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def _windows(history: list[dict], warmup: int, window: int, step_tokens: int) -> list[float]:
    """Tokens/s of each full window of `window` steps after the first `warmup` steps."""
    rows = history[warmup:]
    return [window * step_tokens / sum(r["step_s"] for r in rows[i:i + window])
            for i in range(0, len(rows) - window + 1, window)]


def run_once(overrides, steps: int, warmup: int, window: int, seed: int | None = None,
             progress: str | None = "none") -> tuple[RunRecord, object]:
    """One measured run. Returns its record and the trainer (for the caller's plots)."""
    ov = list(overrides) + [f"train.max_steps={steps}", "train.eval_every=0", "train.eval_tokens=1",
                            "train.checkpoint_every=0"]
    if seed is not None:
        ov.append(f"train.seed={seed}")
    cfg = make_config(ov)
    release_free_memory()
    stopped, tripped = None, False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = Trainer(cfg, None, progress=progress)
        try:
            tr.run()
        except (MemoryBudgetExceeded, TrainingDiverged) as e:
            stopped, tripped = f"{type(e).__name__}: {e.headline}", isinstance(e, MemoryBudgetExceeded)
        finally:
            tr.injected_leak.clear()     # a debug leak ends with its run
    notes = [str(w.message) for w in caught if str(w.message).startswith("sonata:")]
    hist = tr.history
    seq_tokens = tr.plan.effective_batch * cfg.data.seq_len
    wins = _windows(hist, warmup, window, seq_tokens)
    total_s = sum(r["step_s"] for r in hist)
    leak = replay_leak(hist)
    rec = RunRecord(
        seed=cfg.train.seed, steps_done=len(hist), losses=[r["loss"] for r in hist],
        step_s=[r["step_s"] for r in hist], mem_bytes=[r["mem_bytes"] for r in hist],
        windows_tok_per_s=wins, tok_per_s=statistics.median(wins) if wins else None,
        tok_per_s_best_window=max(wins) if wins else None,
        tok_per_s_with_warmup=(len(hist) * seq_tokens / total_s) if total_s else None,
        peak_mem_bytes=max([tr.guard.peak] + [r.get("step_peak_bytes", 0) for r in hist]),
        mem_slope_bytes_per_step=leak.slope(), leak=leak.leaking(),
        nonfinite=int(tr.counters["nonfinite_steps"]),
        fallbacks=kernels.fallback_count(), h2d_bytes_in_steps=sum(r["h2d_bytes"] for r in hist),
        stopped=stopped, guard_tripped=tripped, warnings=notes, steps_for_rate=warmup + window,
        steps_for_leak=leak.needed, leak_threshold_bytes_per_step=leak.allowance())
    return rec, tr


def replay_leak(history: list[dict]) -> LeakDetector:
    """The leak detector over a run's rows, following them as the trainer does
    (`LeakDetector.follow`: the allowance scales with each step's tokens, a stage of another
    size starts afresh), with one difference: no settling allowance (`early_readings=0`).
    The trainer allows 4x its threshold while its window holds fewer than EARLY_READINGS
    readings (a training run's heap settles over its first steps); a bench run of the default
    24 steps never leaves that window, so a leak of up to 4x the stated threshold passed as
    flat. The bench judges its steps at the threshold it states; past the first window both
    read the same run the same way. `allowance()` is the threshold applied."""
    leak = LeakDetector(early_readings=0)
    for r in history:
        leak.follow(r["mem_bytes"], r["step_tokens"])
    return leak


def run_bench(overrides=(), steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP,
              window: int = DEFAULT_WINDOW, seeds: tuple | None = None,
              require_reproducible: bool = True, progress: str | None = "none") -> BenchRecord:
    """Two runs (same seed unless `seeds` says otherwise) and the verdict."""
    overrides = list(overrides)
    seeds = seeds or (None, None)
    runs = []
    for s in seeds:
        rec, tr = run_once(overrides, steps, warmup, window, seed=s, progress=progress)
        runs.append(rec)
        cfg, device, plan = tr.cfg, tr.device, tr.plan
        del tr                           # the next run starts from what is alive now
    first = runs[0]
    reasons = []
    if cfg.debug.leak != "none":
        reasons.append(f"debug.leak={cfg.debug.leak}: a leak injected on purpose (a reproduction, not a speed)")
    if first.steps_done < first.steps_for_leak:
        reasons.append(f"memory leak: {too_few_steps(first.steps_for_leak)} ({first.steps_done} done)")
    leaky = [r for r in runs if r.leak]
    if leaky:
        worst = max(leaky, key=lambda r: r.mem_slope_bytes_per_step)
        reasons.append(f"memory leak: memory after each step grows {fmt_mib(worst.mem_slope_bytes_per_step)} "
                       f"per step (leak detector threshold {fmt_mib(worst.leak_threshold_bytes_per_step)})")
    stopped = [r.stopped for r in runs if r.stopped]
    if stopped:
        reasons.append(f"run stopped early: {stopped[0]}")
    nonfinite = max(r.nonfinite for r in runs)
    if nonfinite:
        reasons.append(f"{nonfinite} non-finite step(s) (NaN/Inf loss or gradient)")
    reproducible = None
    if len(runs) >= 2:
        a, b = runs[0].losses, runs[1].losses
        reproducible = len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y))
                                                for x, y in zip(a, b))
        if require_reproducible and not reproducible:
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            reasons.append(f"not reproducible: the two runs' losses differ from step {k + 1}"
                           + (f" (seeds {runs[0].seed} and {runs[1].seed})" if runs[0].seed != runs[1].seed else ""))
    fallbacks = max(r.fallbacks for r in runs)
    if fallbacks:
        reasons.append(f"{fallbacks} selective-scan call(s) fell back to the reference: not the fast path")
    h2d = max(r.h2d_bytes_in_steps for r in runs)
    if h2d:
        reasons.append(f"{h2d:,} bytes copied host-to-device inside steps (expected 0)")
    if first.tok_per_s is None:
        reasons.append(f"tokens/s: {too_few_steps(warmup + window)} ({first.steps_done} done: "
                       f"{warmup} warm-up + {window} per window)")
    wins = first.windows_tok_per_s
    cv = (statistics.pstdev(wins) / statistics.mean(wins)) if len(wins) > 1 else None
    summary_backend = kernels.resolve_backend(cfg.model.backend, torch.zeros(1, device=device))[0]
    return BenchRecord(
        overrides=overrides, steps=steps, warmup=warmup, window=window,
        tok_per_s=first.tok_per_s, tok_per_s_best_window=first.tok_per_s_best_window,
        tok_per_s_with_warmup=first.tok_per_s_with_warmup, tok_per_s_cv=cv,
        peak_mem_bytes=max(r.peak_mem_bytes for r in runs),
        mem_slope_bytes_per_step=max(r.mem_slope_bytes_per_step for r in runs),
        leak=bool(leaky), leak_threshold_bytes_per_step=max(r.leak_threshold_bytes_per_step for r in runs),
        nonfinite=nonfinite, reproducible=reproducible, fallbacks=fallbacks,
        h2d_bytes_in_steps=h2d, guard_tripped=any(r.guard_tripped for r in runs),
        hardware=hardware_name(device), device=str(device), threads=torch.get_num_threads(),
        precision=plan.precision, backend=summary_backend, micro_batch=plan.micro_batch,
        accumulation=plan.accumulation, debug_leak=cfg.debug.leak,
        verdict="INVALID" if reasons else "VALID", reasons=reasons, runs=[asdict(r) for r in runs])


def correction_table(before: BenchRecord, after: BenchRecord, budget_bytes: int | None = None) -> list[dict]:
    """A before/after table, every cell from the two records.
    `budget_bytes`: a memory budget to judge memory safety against (e.g. the laptop
    profile's); by default the projected memory after a 1,000-step run is shown."""
    def mib(b):
        return f"{b / 2**20:,.0f} MiB"

    def projected(rec, steps=1000):
        return rec.peak_mem_bytes + max(0.0, rec.mem_slope_bytes_per_step) * (steps - rec.steps)

    def safety(rec):
        p = projected(rec)
        if budget_bytes:
            ok = p <= budget_bytes
            return f"{'fits' if ok else 'passes'} {mib(budget_bytes)} after 1,000 steps (projected {mib(p)})"
        return f"projected {mib(p)} after 1,000 steps"

    def stability(rec):
        first = rec.runs[0] if rec.runs else {}
        need = first.get("steps_for_leak", 0)
        judged = ("leak" if rec.leak else "flat") if first.get("steps_done", rec.steps) >= need else too_few_steps(need)
        return f"{rec.mem_slope_bytes_per_step / 2**20:+.2f} MiB/step, {rec.nonfinite} non-finite, {judged}"

    rows = [
        ("Throughput (median window)", lambda r: f"{r.tok_per_s:,.0f} tokens/s" if r.tok_per_s
                                        else too_few_steps(r.warmup + r.window)),
        ("Peak memory", lambda r: mib(r.peak_mem_bytes)),
        ("Stability", stability),
        ("Reproducibility", lambda r: "identical losses in 2 runs" if r.reproducible else "losses differ"),
        ("Memory safety", safety),
        ("Verdict", lambda r: r.verdict + (f" ({len(r.reasons)} reasons)" if r.reasons else "")),
    ]
    return [{"": name, "before (leaky)": f(before), "after (fixed)": f(after)} for name, f in rows]


def ratio(a, b) -> float | None:
    """`a / b`, or None when either reading is missing (a run too short to give it: its
    cell holds `too_few_steps`'s words or None) or not positive, so that nothing
    divides by zero; the notebooks write the words around it."""
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (a, b))
    return a / b if ok else None


def timing_readings(rec: BenchRecord, sp: dict) -> list[dict]:
    """Notebook 04's table of one run read five ways (`sp`: `sync_pitfall`'s result)."""
    def tps(v):
        return round(v) if v is not None else too_few_steps(rec.warmup + rec.window)
    return [
        {"reading": "median window, warm-up excluded (the harness)", "tokens/s": tps(rec.tok_per_s)},
        {"reading": "all steps, warm-up included", "tokens/s": tps(rec.tok_per_s_with_warmup)},
        {"reading": "best window (peak)", "tokens/s": tps(rec.tok_per_s_best_window)},
        {"reading": f"one micro-step, no synchronize ({sp['device']})", "tokens/s": round(sp["without_sync_tok_per_s"])},
        {"reading": f"one micro-step, synchronized ({sp['device']})", "tokens/s": round(sp["with_sync_tok_per_s"])},
    ]


def sync_pitfall(overrides=(), repeat: int = 10) -> dict:
    """Time forward+backward of one micro-batch with the clock read right after the
    Python call returns (no synchronize) and after the device has finished. On CUDA the
    first figure measures kernel launches, not work; on a CPU the two agree."""
    cfg = make_config(list(overrides))
    tr = Trainer(cfg, None, progress="none")
    x, y = tr.sampler.draw(tr.plan.micro_batch)

    def step():
        logits = tr.model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()

    for _ in range(2):
        step()
    sync(tr.device)
    out = {}
    for name, do_sync in (("without synchronize", False), ("with synchronize", True)):
        times = []
        for _ in range(repeat):
            sync(tr.device)
            t0 = time.perf_counter()
            step()
            if do_sync:
                sync(tr.device)
            times.append(time.perf_counter() - t0)
            sync(tr.device)
        out[name] = statistics.median(times)
    tokens = tr.plan.micro_batch * cfg.data.seq_len
    return {"device": str(tr.device),
            "without_sync_tok_per_s": tokens / out["without synchronize"],
            "with_sync_tok_per_s": tokens / out["with synchronize"],
            "without_sync_ms": 1e3 * out["without synchronize"],
            "with_sync_ms": 1e3 * out["with synchronize"]}
