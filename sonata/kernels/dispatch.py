"""sonata/kernels/dispatch.py: the one home of the kernel backend policy, for every family.

Which backend runs (`reference`, `cpu` = fused numba, `triton` = fused Triton, plus a family's
own extra backends such as the SSD's `recurrent`), when a requested fast path cannot run and
what runs instead, the process-wide fallback counter with its once-per-reason warning, the
Triton checks (the interpreter on CPU tensors, families not yet run on a GPU) and the arithmetic
dtype of the kernels. It sits at the bottom of sonata.kernels: it imports no kernel module
eagerly (fused backends are imported on first use, by `load_backend`).

A kernel family describes itself once, as a `Family` (its name, its module paths, its extra
backends, what a failed fast path falls back to, which dtypes its fused paths take), and its
entry point asks `resolve(family, backend, x)` which backend runs for tensors like x:

    SELECTIVE = Family("selective_scan", "scan", cpu="selective.cpu", triton="selective.triton")
    name, reason = resolve(SELECTIVE, backend, u)     # reason: why it is not the requested one
    if reason is not None:
        record_fallback(reason)

`auto` picks triton for CUDA tensors (`on_cuda`) and cpu otherwise. `on_cuda` is the one device
check of every family: tests substitute `sonata.kernels.dispatch.on_cuda` to take the CUDA branch
on a CPU. `GPU_VERIFIED` lists the Triton families that have passed `benchmarks/gpu_check.sh`
compiled on a GPU; until a family is in it, `auto` choosing it for CUDA tensors says so once per
process (`triton_chosen`: a RuntimeWarning naming it, it has only run in Triton's interpreter).
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import warnings
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "reference", "cpu", "triton")
# The dtypes the fused (cpu, triton) paths take; others run the reference (a fallback).
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype for inputs of `dtype`: at least float32 (float64 stays float64). Every
    family's kernels and references compute in it."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- fallback counter

_lock = threading.Lock()
_fallbacks = 0
_warned: set[str] = set()


def fallback_count() -> int:
    """How many kernel calls ran another backend because a requested fast path could not."""
    return _fallbacks


def reset_fallback_count() -> None:
    global _fallbacks
    with _lock:
        _fallbacks = 0


def record_fallback(reason: str) -> None:
    """Count one call that could not run the fast path it asked for; warn once per reason.
    Every family's entry point calls this: one counter, one set of warned reasons."""
    global _fallbacks
    with _lock:
        _fallbacks += 1
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(f"sonata: selective scan fell back to the reference backend: {reason}",
                      RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------- Triton

# The Triton kernel families, by the names the dispatchers pass to `triton_chosen`.
TRITON_KERNELS = {
    "selective_scan": "the Mamba-1 selective scan (sonata/kernels/selective/triton.py)",
    "ssd": "the SSD / Mamba-2 scan (sonata/kernels/ssd/triton.py)",
}
# The families that have passed benchmarks/gpu_check.sh compiled on a GPU: name -> "commit,
# card, date" of that run. Empty: no Triton kernel of sonata has been launched on a GPU yet
# (docs/kernels.md, "Which kernels have run on a GPU"); every family has run only in Triton's
# CPU interpreter. Add a family here only with the log of a passing run.
GPU_VERIFIED: dict[str, str] = {}
_unverified_warned: set[str] = set()


def on_cuda(t: torch.Tensor) -> bool:
    """Whether t is a CUDA tensor: the one device check behind `auto`'s choice and the Triton
    checks of every family (tests substitute it to take the CUDA branch on a CPU)."""
    return t.is_cuda


def triton_chosen(kernel: str, requested: str, x: torch.Tensor) -> None:
    """A dispatcher calls this just before it runs the Triton kernel family `kernel` (a key of
    TRITON_KERNELS), which `requested` resolved to for tensors like x. When `auto` chose it for
    CUDA tensors and the family is not in GPU_VERIFIED, a RuntimeWarning names it, once per
    family per process. The one place for what a Triton family's first launch on a GPU needs."""
    if kernel not in TRITON_KERNELS:
        raise ValueError(f"unknown Triton kernel family {kernel!r}; one of {', '.join(TRITON_KERNELS)}")
    if requested != "auto" or not on_cuda(x) or kernel in GPU_VERIFIED:
        return
    with _lock:
        first = kernel not in _unverified_warned
        _unverified_warned.add(kernel)
    if first:
        warnings.warn(f"sonata: backend 'auto' chose the Triton kernels of {TRITON_KERNELS[kernel]} "
                      f"for CUDA tensors; they have only run in Triton's CPU interpreter and never "
                      f"passed on a GPU ({kernel!r} is not in sonata.kernels.GPU_VERIFIED): "
                      f"run benchmarks/gpu_check.sh on this machine to check them",
                      RuntimeWarning, stacklevel=3)


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton_interpreter_without_gpu() -> bool:
    """Call before triton is imported: without CUDA, run Triton kernels in Triton's CPU
    interpreter (slow, for checking correctness). Returns whether the interpreter is on."""
    if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ \
            and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return triton_interpreter_on()


_loaded: dict[str, object] = {}


def load_backend(name: str, label: str | None = None):
    """Import the fused backend module sonata.kernels.<name> (e.g. "selective.cpu",
    "ssd.triton"): (module, None), or (None, the reason it cannot be imported, naming it `label`,
    default `name`). A module once imported is kept (this runs for every kernel call:
    import_module costs a few microseconds)."""
    mod = _loaded.get(name)
    if mod is not None:
        return mod, None
    try:
        mod = _loaded[name] = importlib.import_module(f"sonata.kernels.{name}")
        return mod, None
    except ImportError as e:  # numba or triton missing
        return None, f"{label or name} backend unavailable ({e})"


def triton_module(x: torch.Tensor, load, label: str = "triton"):
    """Whether a Triton kernel family can run for tensors like x: (module, None), or (None, why
    not). `load` () -> load_backend's answer for the family's module; `label` names the family
    in the reasons. CUDA tensors run compiled kernels; CPU tensors need Triton's interpreter,
    on before triton was first imported."""
    if not on_cuda(x) and not triton_interpreter_on():
        return None, f"{label} backend needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors)"
    mod, why = load()
    if mod is None:
        return None, why
    if not on_cuda(x) and not getattr(mod, "INTERPRETED", True):
        return None, (f"{label} kernels were compiled for CUDA: TRITON_INTERPRET=1 must be set "
                      "before triton is first imported to run them on CPU tensors")
    return mod, None


def opaque(fn):
    """`fn` (a call into numba kernels) as torch.compile must take it: run as it is, never
    traced (dynamo cannot trace numba's dispatchers and stops with an error inside them), so a
    compiled model breaks its graph there and runs the fused kernel eagerly. Eager calls pay
    about half a microsecond. Every family wraps its fused CPU entry points that are not custom
    ops in it. The `torch.compiler.disable` wrapper is made on the first call, not here: making
    it imports torch._dynamo, and with it triton, which must not happen when sonata is imported
    (Triton's interpreter is switched on by an environment variable read at triton's import:
    `use_triton_interpreter_without_gpu`)."""
    made = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not made:
            made.append(torch.compiler.disable(fn))
        return made[0](*args, **kwargs)
    return call


# --------------------------------------------------------------------------- the resolver

@dataclass(frozen=True)
class Family:
    """One kernel family, as the resolver sees it.

    name       its key in TRITON_KERNELS (when it has Triton kernels)
    kind       the word in "unknown <kind> backend" errors
    cpu        the module of its fused numba backend under sonata.kernels ("selective.cpu"), loaded
               (numba imported) on first use; None: the family's cpu path needs no check here
    triton     the module of its Triton backend ("ssd.triton"); None: no Triton kernels, a
               `triton` request runs the family's PyTorch path by design (not a fallback)
    label      the prefix of its reasons ("ssd " -> "ssd triton backend needs ...")
    extra      backends beyond auto / reference / cpu / triton, always runnable (SSD: "recurrent")
    fallback   what runs for CPU tensors when a fast path cannot ("reference", or the SSD's "cpu");
               GPU tensors always fall back to the reference
    dtypes     the dtypes its fused paths take (None: the family checks its inputs itself)
    """
    name: str
    kind: str
    cpu: str | None
    triton: str | None
    label: str = ""
    extra: tuple[str, ...] = ()
    fallback: str = "reference"
    dtypes: tuple[torch.dtype, ...] | None = FUSED_DTYPES

    @property
    def backends(self) -> tuple[str, ...]:
        return ("auto", "reference", *self.extra, "cpu", "triton")

    def load_triton(self):
        """(module, None) or (None, why its Triton module cannot be imported)."""
        return load_backend(self.triton, f"{self.label}triton")


def resolve(family: Family, backend: str, x: torch.Tensor) -> tuple[str, str | None]:
    """Which backend of `family` runs for tensors like x when `backend` is asked for: (name,
    the reason it is not the requested one, or None). ValueError for a backend it does not know."""
    if backend not in family.backends:
        raise ValueError(f"unknown {family.kind} backend {backend!r}; choose one of {', '.join(family.backends)}")
    if backend == "reference" or backend in family.extra:
        return backend, None
    if backend == "auto":
        backend = "triton" if on_cuda(x) else "cpu"
    if family.dtypes is not None and x.dtype not in family.dtypes:
        return "reference", f"{backend} backend does not support dtype {x.dtype}"
    on_cpu = x.device.type == "cpu"
    if backend == "cpu":
        if not on_cpu:
            return "reference", f"{family.label}cpu backend needs CPU tensors, got {x.device}"
        if family.cpu is None:
            return "cpu", None
        mod, why = load_backend(family.cpu, f"{family.label}cpu")
    elif family.triton is None:
        return "reference", None                        # PyTorch ops, by design
    else:
        mod, why = triton_module(x, family.load_triton, f"{family.label}triton")
    return (backend, None) if mod is not None else (family.fallback if on_cpu else "reference", why)


__all__ = ["BACKENDS", "FUSED_DTYPES", "Family", "GPU_VERIFIED", "TRITON_KERNELS", "compute_dtype", "fallback_count",
           "load_backend", "on_cuda", "opaque", "record_fallback", "reset_fallback_count", "resolve", "triton_chosen",
           "triton_interpreter_on", "triton_module", "use_triton_interpreter_without_gpu"]
