"""Memory accounting and the MemoryGuard (the fuse).

What "memory" means here, per device:
- CUDA: bytes held by tensors (`torch.cuda.memory_allocated`) after a step, and the
  allocator's peak (`max_memory_allocated`) within it. The budget is also handed to
  the allocator (`set_per_process_memory_fraction`), so an allocation that would pass
  it raises `OutOfMemoryError` instead of spilling into the driver's shared memory.
- CPU: the process's resident set (psutil). There is no allocator to ask, so the
  guard samples the resident set from a background thread while a step runs (every
  few milliseconds) to learn the step's peak, and refuses to start a step whose
  projected peak (resident now + the growth of the last step, with a margin) would
  pass the budget. The process never grows past the budget into swap because it
  stops one step before it would.

The trainer wraps each step once in `MemoryGuard.watch` (check before, sampling
during, check after, an allocation failure turned into the same error); a trip
raises `MemoryBudgetExceeded`, which names the budget, the usage and what to try;
the trainer catches it, writes an emergency checkpoint of the last good state, and
re-raises, so the command line prints one `error:` line and exits 2.

The leak detector and the leak injected on purpose live in sonata.train.leak.
"""
from __future__ import annotations

import threading

import psutil
import torch

from sonata.core.errors import SonataError

MiB = 2**20


class MemoryBudgetExceeded(SonataError):
    """The run would pass its memory budget. Fields: `detail` (what happened, e.g.
    "step 3 would reach 1.2 GiB of resident set, over the budget of 1.0 GiB (...)"),
    `advice`, the budget and usage in bytes, and in a data-parallel run the tripping
    `rank`, the `world` size and the other ranks that tripped too (`also`). Once the
    trainer has stopped, `stopped(step, checkpoint)` gives the same error with where
    the last good state is."""

    def __init__(self, detail: str, *advice: str, budget_bytes: int = 0, used_bytes: int = 0,
                 rank: int | None = None, world: int = 1, also: tuple = (), step: int | None = None,
                 checkpoint: str | None = None, agreed: bool = False):
        self.detail, self.advice = detail, list(advice)
        self.budget_bytes, self.used_bytes = int(budget_bytes), int(used_bytes)
        self.world, self.also, self.checkpoint = world, tuple(also), checkpoint
        where = ""
        if rank is not None and world > 1:
            where = f" on rank {rank} of {world}" + (
                f" (also rank{'s' if len(self.also) > 1 else ''} {', '.join(map(str, self.also))})"
                if self.also else "")
        reasons = [f"memory budget exceeded{where}: {detail}", *advice]
        if step is not None:
            reasons.append(f"the last good state (step {step}) is in {checkpoint}; resume with --resume "
                           f"{checkpoint} and a larger profile.memory_budget_mb" if checkpoint else
                           "no checkpoint written (no output folder)")
        super().__init__(*reasons, step=step, rank=rank, agreed=agreed)

    def fields(self) -> dict:
        return {"detail": self.detail, "advice": list(self.advice), "budget_bytes": self.budget_bytes,
                "used_bytes": self.used_bytes, "rank": self.rank, "world": self.world, "also": self.also,
                "step": self.step, "checkpoint": self.checkpoint, "agreed": self.agreed}

    def replace(self, **changes) -> "MemoryBudgetExceeded":
        f = {**self.fields(), **changes}
        return MemoryBudgetExceeded(f.pop("detail"), *f.pop("advice"), **f)

    def stopped(self, step: int, checkpoint) -> "MemoryBudgetExceeded":
        """This error after the run stopped at `step` (checkpoint: the file, or None)."""
        return self.replace(step=step, checkpoint=None if checkpoint is None else str(checkpoint))


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def available_ram_bytes() -> int:
    return int(psutil.virtual_memory().available)


def device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return 0


def release_free_memory(device: torch.device | None = None) -> None:
    """Hand memory that is free inside the process back to the system (glibc
    `malloc_trim`; the CUDA caching allocator's cache), so the resident set measures
    what is alive now, not what an earlier run in this process once used."""
    import gc
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc():
    """The process's glibc through ctypes (malloc_trim, mallopt), or None where the C
    library is not glibc."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt      # noqa: B018 - both exist only in glibc
        return libc
    except (OSError, AttributeError):
        return None


# glibc mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_heap_steadied = False


def steady_cpu_heap() -> bool:
    """Keep freed activation memory inside the process between CPU training steps (glibc).

    By default glibc serves blocks above a moving threshold with fresh mmaps and returns the
    heap's free top to the system, so each training step handed tens of MiB back and faulted
    them in again the next step: 3 page faults per KiB trained, a resident set swinging by
    15-25 MiB from step to step, and a leak detector that saw growth in the swings. A fixed
    32 MiB mmap threshold (glibc's largest) and a 256 MiB trim threshold keep a step's blocks
    in the heap for the next step; `release_free_memory` (malloc_trim) still hands them back
    between runs. Process-wide and idempotent; False where the C library is not glibc."""
    global _heap_steadied
    if _heap_steadied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    _heap_steadied = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20) == 1
    return _heap_steadied


def current_bytes(device: torch.device) -> int:
    """Memory in use now: tensor bytes on CUDA, the resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return rss_bytes()


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak so far: the allocator's on CUDA, the peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    mi = psutil.Process().memory_info()
    return int(getattr(mi, "peak_wset", 0) or _ru_maxrss() or mi.rss)


def _ru_maxrss() -> int:
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return 0


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure, recognized by type (CUDA and CPU allocators both raise
    torch.OutOfMemoryError in recent PyTorch)."""
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, (oom, torch.cuda.OutOfMemoryError, MemoryError))


def fmt_mib(n: float) -> str:
    if abs(n) < MiB / 10:
        return f"{n / 1024:,.1f} KiB" if abs(n) >= 1024 else f"{n:,.0f} B"
    return f"{n / MiB:,.2f} MiB" if abs(n) < MiB else f"{n / MiB:,.1f} MiB"


class PeakSampler:
    """Peak memory inside a block. CUDA: the allocator's own peak. CPU: a thread
    samples the resident set every `interval` seconds (plus at entry and exit)."""

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device, self.interval = device, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.peak = int(torch.cuda.memory_allocated(self.device))
        else:
            self.peak = rss_bytes()
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        proc = psutil.Process()
        while not self._stop.wait(self.interval):
            try:
                r = proc.memory_info().rss
            except psutil.Error:      # pragma: no cover - process going away
                return
            if r > self.peak:
                self.peak = r

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = max(self.peak, int(torch.cuda.max_memory_allocated(self.device)))
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_bytes())
        return False


class MemoryGuard:
    """The fuse. `budget_bytes` caps the process (CPU resident set) or the tensors on
    the device (CUDA). `margin`: the fraction of the last step's growth added when
    projecting the next step's peak."""

    def __init__(self, budget_bytes: int, device: torch.device, what: str = "profile.memory_budget_mb",
                 margin: float = 0.25):
        self.budget = int(budget_bytes)
        self.device = device
        self.what = what
        self.margin = margin
        self.step_growth = 0          # peak during the last step minus memory before it
        self.peak = 0                 # highest memory seen during guarded steps
        self.peak_last = 0            # peak of the last step
        self.trips = 0
        self._sampler: PeakSampler | None = None
        self._before = 0
        if device.type == "cuda" and self.budget:
            total = device_total_bytes(device)
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget / total), device)

    # -- the two checks
    def check_before_step(self, step: int, hint: str = "") -> None:
        now = current_bytes(self.device)
        projected = now + int(self.step_growth * (1 + self.margin))
        if projected > self.budget:
            kind = "would reach" if now <= self.budget else "is already at"
            self._trip(f"step {step + 1} {kind} {fmt_mib(projected if now <= self.budget else now)}",
                       projected, hint)
        self._before = now
        self._sampler = PeakSampler(self.device).__enter__()

    def after_step(self, step: int, hint: str = "") -> int:
        """Ends the step's sampling; returns the memory now (for the leak detector)."""
        peak = self._end_sampling()
        self.step_growth = max(0, peak - self._before)
        self.peak = max(self.peak, peak)
        self.peak_last = peak
        now = current_bytes(self.device)
        if peak > self.budget:
            self._trip(f"step {step} peaked at {fmt_mib(peak)}", peak, hint)
        return now

    def abort_step(self) -> None:
        """The step raised: stop sampling (idempotent)."""
        self._end_sampling()

    def _end_sampling(self) -> int:
        if self._sampler is None:
            return current_bytes(self.device)
        s, self._sampler = self._sampler, None
        s.__exit__(None, None, None)
        return s.peak

    def _trip(self, what_happened: str, used: int, hint: str) -> None:
        self.trips += 1
        unit = "resident set" if self.device.type == "cpu" else "device memory"
        raise MemoryBudgetExceeded(
            f"{what_happened} of {unit}, over the budget of {fmt_mib(self.budget)} ({self.what}){hint}",
            "try a smaller train.micro_batch, train.autotune=true, or a larger profile.memory_budget_mb",
            budget_bytes=self.budget, used_bytes=used)

    def out_of_memory(self, step: int, exc: BaseException, hint: str = "") -> MemoryBudgetExceeded:
        """The error to raise when an allocation failed inside a step."""
        self.trips += 1
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        return MemoryBudgetExceeded(
            f"out of memory in step {step + 1} ({first})",
            f"budget {fmt_mib(self.budget)} ({self.what}){hint}",
            "try a smaller train.micro_batch or train.autotune=true",
            budget_bytes=self.budget, used_bytes=current_bytes(self.device))

    # -- the one wrapper the trainer uses
    def watch(self, step: int, agree=None) -> "StepWatch":
        """`with guard.watch(step) as w: <one training step>`: the check before the step,
        peak sampling during it, the check after it (then `w.mem_bytes`, `w.peak`); an
        allocation failure inside the step becomes MemoryBudgetExceeded. `agree(error,
        readings)`, data parallel: called at both checks with this rank's error (or None)
        and, after the step, with `readings` = (peak so far, step peak) (None before it); it
        raises the agreed error when any rank tripped, so all stop, and what it returns after
        the step is kept as `w.agreed` (the trainer's: a StepAgreement)."""
        return StepWatch(self, step, agree)


class StepWatch:
    """One step under the guard (see MemoryGuard.watch)."""

    def __init__(self, guard: MemoryGuard, step: int, agree=None):
        self.guard, self.step, self.agree = guard, step, agree
        self.mem_bytes = self.peak = 0
        self.agreed = None             # what `agree` returned after the step (data parallel)

    def _checked(self, check, readings=None):
        if self.agree is None:
            return check()
        value, err = None, None
        try:
            value = check()
        except MemoryBudgetExceeded as e:
            err = e
        try:
            agreed = self.agree(err, readings() if readings else None)
        except MemoryBudgetExceeded:
            self.guard.abort_step()        # ranks that did not trip were sampling
            raise
        return value, agreed

    def __enter__(self) -> "StepWatch":
        self._checked(lambda: self.guard.check_before_step(self.step))
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            # data parallel: an allocation failure inside the step cannot be agreed on (the
            # other ranks are inside DDP's all-reduce): this rank stops, the others learn it
            # from the process group (a closed connection, or the timeout)
            self.guard.abort_step()
            if is_out_of_memory(exc):
                raise self.guard.out_of_memory(self.step, exc) from None
            return False
        after = lambda: self.guard.after_step(self.step + 1)       # noqa: E731
        if self.agree is None:
            self.mem_bytes = after()
        else:
            self.mem_bytes, self.agreed = self._checked(
                after, lambda: (peak_memory_bytes(self.guard.device), self.guard.peak_last))
        self.peak = self.guard.peak_last
        return False


def refuse_over_budget(device: torch.device, budget: int, what: str) -> None:
    """A MemoryBudgetExceeded when this process already holds more than `budget` (what the guard
    counts: the resident set on CPU, allocated bytes on CUDA), so the first step would trip the
    guard: the Trainer asks before a run writes a file (the command line before it claims the
    folder, run() before it starts). `what` names the budget's source."""
    used = current_bytes(device)
    if used > budget:
        raise MemoryBudgetExceeded(
            f"this process already uses {fmt_mib(used)} before training starts, over the budget of "
            f"{fmt_mib(budget)} ({what})", "raise profile.memory_budget_mb", budget_bytes=budget, used_bytes=used)


def too_few_steps(need: int) -> str:
    """What a table cell or a verdict says when a run is too short to judge something."""
    return f"too few steps to judge: need at least {need}"
