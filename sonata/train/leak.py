"""The leak detector and the leak injected on purpose (`debug.leak`, notebook 03).

`LeakDetector` keeps the memory after each step (the trainer's reading: the resident set on
CPU, allocated bytes on CUDA) and calls it a leak when the slope over its window is above a
threshold (256 KiB per step, or 64 bytes per token of the step when more; four times that
while the window is short, a training run's heap settling, unless the caller turns that off
as the bench does) and significant against the window's own noise by two measures: `trend`,
least squares with the allocator's level shifts taken out, and `median_slope`, Theil-Sen
through the raw readings. Each alone misreads one pattern of a correct loop (a single
allocator jump; a sawtooth of heap trims), both together have not (tests/train/test_memory.py
replays each). `InjectedLeak` keeps what a classic leak keeps (a graph, or activations) so
notebooks 03 and 04 can show the detector and the benchmark harness catching it.
"""
from __future__ import annotations

import functools

import numpy as np

from sonata.train.memory import fmt_mib, too_few_steps


def trend(ys) -> tuple[float, float]:
    """(slope, its standard error) of memory readings ys, in bytes per step, robust to what a
    correct loop's memory does: a few level shifts (allocator jumps, 4 MiB in one step) and
    large swings around a flat level (tens of MiB from step to step).

    A step's growth that sits more than 8 noise floors (and 1 MiB) away from the median growth
    is a level shift: it is replaced by the median growth, so it moves the levels once instead
    of tilting the fit. The slope is then the least-squares slope through the levels over the
    whole window (every reading counts, so swings average out: a window of 64 readings
    measures a slope about 30 times more finely than the noise of one step), and its standard
    error comes from the spread of the residuals (1.4826 x their median absolute deviation):
    the window's own noise floor."""
    y = np.asarray(ys, dtype=np.float64)
    n = len(y)
    if n < 3:
        return 0.0, 0.0
    d = np.diff(y)
    med = np.median(d)
    floor = 1.4826 * np.median(np.abs(d - med))
    d = np.where(np.abs(d - med) > max(8 * floor, 2**20), med, d)   # level shifts out
    levels = np.concatenate(([y[0]], y[0] + np.cumsum(d)))
    t = np.arange(n) - (n - 1) / 2
    sxx = n * (n * n - 1) / 12                                       # sum of t^2
    slope = float(t @ (levels - levels.mean()) / sxx)
    resid = levels - levels.mean() - slope * t
    sigma = 1.4826 * np.median(np.abs(resid - np.median(resid)))
    return slope, float(sigma / np.sqrt(sxx))


def median_slope(ys) -> tuple[float, float]:
    """(slope, its standard error) of readings ys: the median of the slopes between every two
    readings (Theil-Sen), and the error from the spread of the residuals as in `trend`. It
    reads the raw readings, so a sawtooth (the resident set falling at once when the heap is
    trimmed, then growing back over a few steps) averages out; `trend` takes the sudden falls
    out as level shifts and keeps the gradual regrowth, which a sawtooth turns into a slope."""
    y = np.asarray(ys, dtype=np.float64)
    n = len(y)
    if n < 3:
        return 0.0, 0.0
    i, j = _pairs(n)
    slope = float(np.median((y[j] - y[i]) / (j - i)))
    t = np.arange(n) - (n - 1) / 2
    resid = y - slope * t
    sigma = 1.4826 * np.median(np.abs(resid - np.median(resid)))
    return slope, float(sigma / np.sqrt(n * (n * n - 1) / 12))


def swing(ys) -> float:
    """How far readings ys stray from their least-squares line: max minus min of the residuals
    (bytes). For a stage's settling readings, the allocator's sawtooth without the slope a
    leak would add."""
    y = np.asarray(ys, dtype=np.float64)
    n = len(y)
    if n < 3:
        return 0.0
    t = np.arange(n) - (n - 1) / 2
    resid = y - y.mean() - float(t @ (y - y.mean()) / (n * (n * n - 1) / 12)) * t
    return float(resid.max() - resid.min())


@functools.lru_cache(maxsize=8)
def _pairs(n: int):
    return np.triu_indices(n, 1)


# Steps a new stage's window skips (a task's curriculum moving to longer sequences): the heap
# grows for the first ten or twenty steps of a longer sequence (notebook 08: +210 MiB over
# 20 steps at length 4096, then flat).
STAGE_SETTLE_STEPS = 32

# A run's first readings are its heap settling too, by less than a stage change and for about
# as long: notebook 10's attention run (2026-12-05) grew 10 MiB over its first 18 steps (0.46
# MiB per step), then stayed flat for 2,000 (1.2 KiB per step), and the first verdict (16
# readings) called it a leak. Until a window holds EARLY_READINGS readings, a leak must grow
# EARLY_FACTOR times the allowance: a kept graph (2.7 MiB per step at the tests' small model,
# 26 MiB at the seed model's) is still flagged at the first verdict, and a leak near the
# allowance once the window is long enough to tell it from settling. The trainer's detector
# applies this rule (the default of LeakDetector's `early_readings`); the bench's does not
# (`early_readings=0`: it judges a run of a few dozen steps, all of them inside this window).
EARLY_READINGS, EARLY_FACTOR = 48, 4.0


def leak_threshold(step_tokens: int | None) -> float:
    """The growth per step that counts as a leak for a step of `step_tokens` tokens: 256 KiB,
    or 64 bytes per token when that is more. A correct loop's heap settles in proportion to
    its step (notebook 08, 32,768 tokens a step: +0.35 MiB per step over the 100 steps after
    its stage's first 32, then flat), and what leaks (a kept graph, kept activations) grows with
    the step too (~19 KiB per token for the seed model's kept graph: 300 times the allowance).
    The seed model's step (2,048 tokens) keeps 256 KiB."""
    return float(max(256 * 1024, 64 * (step_tokens or 0)))


class LeakDetector:
    """Memory after each step (from step `skip` + 1 on). A leak is a slope over the last
    `window` steps, once `min_samples` are there, that is above `threshold` bytes per step
    and more than `z` standard errors above zero (significant against the window's own
    noise floor) by two measures: `trend` (least squares through the readings, allocator
    jumps taken out) and `median_slope` (Theil-Sen through the raw readings). Each alone
    misreads one pattern of a correct loop: a single allocator jump tilts the raw slope, a
    sawtooth of heap trims and regrowth tilts the jump-free one (notebook 08 at length 4096:
    10 MiB per step by `trend` alone, on memory that stayed flat for 300 steps).
    The default threshold, 256 KiB per step, is far above what a correct loop drifts by (0 to
    15 KiB per step measured on CPU) and far below what one kept graph of the seed model
    costs (about 38 MiB per step at micro-batch 16). With the resident set swinging by +-20
    MiB from step to step, the slope's error over 64 readings is about 0.1 MiB per step, so
    a 0.5 MiB-per-step leak is flagged within about 60 steps and flat noise is not: a
    single step's growth (what an earlier detector took the median of) says little there.
    A window of fewer than `early_readings` readings (EARLY_READINGS by default) allows
    EARLY_FACTOR times the threshold: a training run's heap settles over its first steps. A
    caller that judges a short run whose settling it does not want excused (the bench:
    `early_readings=0`) applies the threshold itself from the first verdict. `allowance()` is
    what a verdict was judged at; the report and the message name it."""

    def __init__(self, window: int = 256, threshold: float = 256 * 1024, skip: int = 2,
                 min_samples: int = 16, z: float = 5.0, early_readings: int = EARLY_READINGS):
        self.window, self.threshold, self.skip = window, float(threshold), skip
        self.min_samples, self.z, self.early_readings = min_samples, z, early_readings
        self.samples: list[int] = []
        self.step_tokens: int | None = None     # `follow`: the size of the steps followed
        self.warned = False                     # `follow`: a leak was reported

    def record(self, mem_bytes: int) -> None:
        self.samples.append(int(mem_bytes))

    def follow(self, mem_bytes: int, step_tokens: int) -> bool:
        """The trainer's reading after a step of `step_tokens` tokens: True once, the first
        time it is a leak (the caller warns). A step of another size (a task's curriculum at
        its next length) starts the window afresh after STAGE_SETTLE_STEPS: the memory a
        longer sequence needs is the workload's, not a leak; the allowance grows with the
        step (`leak_threshold`)."""
        if step_tokens != self.step_tokens:
            if self.step_tokens is not None:            # the heap settles for a few steps first
                self.samples, self.skip = [], STAGE_SETTLE_STEPS
            self.threshold = leak_threshold(step_tokens)
            self.step_tokens = step_tokens
        self.record(mem_bytes)
        if self.warned or not self.leaking():
            return False
        self.warned = True
        return True

    def _window(self) -> list[int]:
        return self.samples[self.skip:][-self.window:]

    def slope(self) -> float:
        """Bytes per step over the last `window` samples after the skipped ones (all of them
        if fewer)."""
        return trend(self._window())[0]

    @property
    def needed(self) -> int:
        """Steps needed before a verdict."""
        return self.skip + min(self.window, self.min_samples)

    @property
    def enough(self) -> bool:
        return len(self.samples) >= self.needed

    def leaking(self) -> bool:
        if not self.enough:
            return False
        window = self._window()
        # After a stage change, the window's rise must also pass the sawtooth the stage's settling
        # readings swung through: notebook 08's second phase at length 32,768 (131,072 tokens a
        # step) swung between 801 and 1,347 MiB with a period of about 15 steps, and the first
        # 16 readings after settling caught one rise, 10 MiB a step (+- 0.9) over 8 allowed: a
        # leak by both measures, on memory that fell back to 801 MiB at the next step.
        band = swing(self.samples[:self.skip]) if self.skip >= STAGE_SETTLE_STEPS else 0.0
        allowed = self.allowance(len(window))
        # lazily: the median over every pair (32,640 in a full window) only when `trend` agrees
        return all(slope > allowed and slope > self.z * err and slope * (len(window) - 1) > band
                   for slope, err in (measure(window) for measure in (trend, median_slope)))

    def allowance(self, readings: int | None = None) -> float:
        """The growth per step a window of `readings` readings (None: the current window's)
        may show: `threshold`, EARLY_FACTOR times it below `early_readings` readings."""
        n = len(self._window()) if readings is None else readings
        return self.threshold * (EARLY_FACTOR if n < self.early_readings else 1.0)

    def verdict(self) -> str:
        """`LEAK`, `flat`, or what a run too short to judge needs."""
        if not self.enough:
            return too_few_steps(self.needed)
        return "LEAK" if self.leaking() else "flat"

    def report(self) -> dict:
        """The readings for a summary; `leak_threshold_bytes_per_step` is the allowance the
        current window is judged at (`allowance()`: EARLY_FACTOR x `threshold` while the window
        is short), not the bare threshold."""
        s, err = trend(self._window())
        return {"mem_slope_bytes_per_step": s, "mem_slope_error_bytes_per_step": err,
                "leak": self.leaking(),
                "leak_window": min(self.window, max(0, len(self.samples) - self.skip)),
                "leak_threshold_bytes_per_step": self.allowance(),
                "mem_baseline_bytes": self.samples[self.skip] if len(self.samples) > self.skip else None}

    def message(self) -> str:
        r = self.report()
        slope = min(r["mem_slope_bytes_per_step"], median_slope(self._window())[0])   # both passed
        return (f"memory grows {fmt_mib(slope)} per step over the last "
                f"{r['leak_window']} steps (+- {fmt_mib(r['mem_slope_error_bytes_per_step'])}; threshold "
                f"{fmt_mib(self.allowance())}): a leak")


class InjectedLeak:
    """`debug.leak`: a classic leak reproduced on purpose (notebook 03), as a hook on
    each micro-step. `keep_graph` keeps every micro-step's loss with its autograd graph
    (`retain_graph` makes the backward keep the graph's saved activations alive);
    `keep_activations` keeps each micro-step's logits (detached: the activations
    outlive the backward, the graph does not). `none` keeps nothing."""

    def __init__(self, mode: str = "none"):
        self.mode = mode
        self.retain_graph = mode == "keep_graph"
        self.kept: list = []

    def after_backward(self, loss, logits) -> None:
        if self.mode == "keep_graph":
            self.kept.append(loss)
        elif self.mode == "keep_activations":
            self.kept.append(logits.detach())

    def clear(self) -> None:
        """Let go of what was kept (a trip, the end of a benchmark run)."""
        self.kept.clear()


__all__ = ["LeakDetector", "InjectedLeak", "trend", "median_slope", "swing", "leak_threshold", "STAGE_SETTLE_STEPS",
           "EARLY_READINGS", "EARLY_FACTOR"]
