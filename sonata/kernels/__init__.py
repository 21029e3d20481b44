"""The selective scan: one entry point, three backends.

    selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                   delta_softplus=False, return_last_state=False, backend="auto",
                   delta_proj=None, initial_state=None)

`initial_state` (batch, d_inner, N), when given, is the state before the first step (mamba_ssm
has no such argument; zeros when None), and it receives a gradient: with `return_last_state`
a long sequence runs chunk by chunk, each chunk starting from the last one's final state, and
gives what one pass over the whole sequence gives. `delta_proj` (d_inner, R), when given, makes `delta` the (batch, L, R) input of the model's
delta projection: the scan's delta is (delta @ delta_proj.T).transpose(1, 2). The `cpu`
kernels compute that product block by block inside the scan (and its gradients in the
backward), so no (batch, d_inner, L) delta is ever stored or transposed; the other backends
compute it with a matmul first.

`reference` is plain PyTorch (the oracle, any dtype, autograd through it);
`cpu` is fused numba kernels; `triton` is fused Triton kernels (CUDA, or CPU
tensors under TRITON_INTERPRET=1). `auto` picks triton on CUDA and cpu on CPU.

When a requested fast path cannot run, the reference runs instead, a
process-wide fallback counter moves (`fallback_count()`) and a warning names
the reason once per reason. The trainer reports the counter every step.

This module is the one dispatcher for every kernel family, the SSD's (`sonata.kernels.ssd`)
included: the fallback counter (`record_fallback`), whether a Triton family can run
(`triton_module`) and what happens when one is about to (`triton_chosen`). `GPU_VERIFIED`
lists the Triton families that have passed `benchmarks/gpu_check.sh` compiled on a GPU; until
a family is in it, `auto` choosing it for CUDA tensors says so once per process (a
RuntimeWarning naming it: it has only run in Triton's CPU interpreter).

Around the scan, `rms_norm(x, weight, eps, backend)` (the blocks' RMSNorm: fused in numba
for the `cpu` backend, PyTorch ops for the others, which is their design and not a fallback;
`cpu` falling back (no numba, a GPU tensor) counts) and `conv_silu(xz, weight, bias, backend)`
(the model's depthwise causal convolution + SiLU of in_proj's first half, and its second half,
the gate, both handed on in the scan's (batch, dim, L) layout: fused in numba for `cpu`,
PyTorch's conv1d + SiLU otherwise), and for Mamba-2 `causal_conv_silu(x, weight, bias, backend)`
(the convolution alone, over x, B and C) and `rms_norm_gated(x, weight, z, eps, group_size,
norm_before_gate, backend)` (the gated, grouped output norm), fused the same way.
`cross_entropy(logits, target, backend)` is the training loss (mean over rows): one fused
numba pass for `cpu` that leaves the gradient ready for the backward, PyTorch's
F.cross_entropy otherwise.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings

import torch

from sonata.kernels.autograd import (CausalConvSiluFn, ConvSiluFn, CrossEntropyFn, RMSNormFn, RMSNormGatedFn,
                                    fused_scan)
from sonata.kernels.reference import (conv_silu_ref, cross_entropy_ref, project_delta, rms_norm_gated_ref,
                                     rms_norm_ref, selective_scan_ref)

BACKENDS = ("auto", "reference", "cpu", "triton")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_lock = threading.Lock()
_fallbacks = 0
_warned: set[str] = set()


def fallback_count() -> int:
    """How many scans ran the reference because a requested fast path could not."""
    return _fallbacks


def reset_fallback_count() -> None:
    global _fallbacks
    with _lock:
        _fallbacks = 0


def record_fallback(reason: str) -> None:
    """Count one call that could not run the fast path it asked for; warn once per reason.
    Every dispatcher calls this (the SSD's too): one counter, one set of warned reasons."""
    global _fallbacks
    with _lock:
        _fallbacks += 1
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(f"sonata: selective scan fell back to the reference backend: {reason}",
                      RuntimeWarning, stacklevel=3)


# The Triton kernel families, by the names the dispatchers pass to `triton_chosen`.
TRITON_KERNELS = {
    "selective_scan": "the Mamba-1 selective scan (sonata/kernels/triton.py)",
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
    checks of every dispatcher (tests substitute it to take the CUDA branch on a CPU)."""
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
    """Import the fused backend module sonata.kernels.<name> (e.g. "cpu", "ssd.triton"):
    (module, None), or (None, the reason it cannot be imported, naming it `label`, default
    `name`). A module once imported is kept (this runs for every kernel call: import_module
    costs a few microseconds)."""
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


def resolve_backend(backend: str, u: torch.Tensor) -> tuple[str, str | None]:
    """Which backend runs for tensors like `u`: (name, reason it is not the requested one)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown scan backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "reference":
        return "reference", None
    if backend == "auto":
        backend = "triton" if on_cuda(u) else "cpu"
    if u.dtype not in _FUSED_DTYPES:
        return "reference", f"{backend} backend does not support dtype {u.dtype}"
    if backend == "cpu" and u.device.type != "cpu":
        return "reference", f"cpu backend needs CPU tensors, got {u.device}"
    if backend == "triton":
        mod, reason = triton_module(u, lambda: load_backend("triton"))
    else:
        mod, reason = load_backend(backend)
    return (backend, None) if mod is not None else ("reference", reason)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                   delta_softplus=False, return_last_state=False, backend="auto", delta_proj=None,
                   initial_state=None):
    name, reason = resolve_backend(backend, u)
    if reason is not None:
        record_fallback(reason)
    if delta_proj is not None and name != "cpu":
        delta, delta_proj = project_delta(delta, delta_proj), None
    if name == "reference":
        return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                  return_last_state, initial_state)
    if name == "triton":
        triton_chosen("selective_scan", backend, u)
    impl, _ = load_backend(name)
    out, last_state = fused_scan(impl, u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj,
                                 initial_state)
    return (out, last_state) if return_last_state else out


def _fused_cpu(backend, x):
    """The cpu backend module when `backend` resolves to it for x, else None (a `cpu` request
    that cannot run counts as a fallback; other backends use PyTorch ops by design)."""
    name, reason = resolve_backend(backend, x)
    if name == "cpu":
        return load_backend("cpu")[0]
    if reason is not None and backend == "cpu":
        record_fallback(reason)
    return None


def rms_norm(x, weight, eps, backend="auto"):
    """x * rsqrt(mean(x^2, -1) + eps) * weight for x (..., d), weight (d,)."""
    impl = _fused_cpu(backend, x)
    if impl is not None:
        return RMSNormFn.apply(impl, x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def conv_silu(xz, weight, bias, backend="auto"):
    """The mixer's convolution and gate split: xz (batch, L, 2 dim), in_proj's output, any
    strides -> (u, z), each (batch, L, dim): u = silu(depthwise causal conv1d(xz[..., :dim]) +
    bias) and the gate z = xz[..., dim:]. weight (dim, 1, K), bias (dim,). Fused in numba for
    the `cpu` backend: u C-contiguous (x_proj and the cpu scan read it in place), z moved into
    the scan's (batch, dim, L) layout (a transposed view comes back), and the backward writes
    the whole projection's gradient at once; PyTorch ops for the others (z a view of xz)."""
    impl = _fused_cpu(backend, xz)
    if impl is not None:
        u, z = ConvSiluFn.apply(impl, xz, weight, bias)
        return u.transpose(1, 2), z.transpose(1, 2)
    dim = weight.shape[0]
    return conv_silu_ref(xz[..., :dim], weight, bias), xz[..., dim:]


def causal_conv_silu(x, weight, bias, backend="auto", out_dtype=None):
    """Mamba-2's convolution: x (batch, L, dim), any strides (the xBC slice of in_proj's
    output) -> silu(depthwise causal conv1d(x) + bias), (batch, L, dim); `conv_silu_ref`'s
    semantics. weight (dim, 1, K), bias (dim,) or None. Fused in numba for the `cpu` backend
    (the output C-contiguous), PyTorch's conv1d + SiLU otherwise. out_dtype: the output's
    dtype (None: x's); the fused kernel computes in float32, so a float32 output of bfloat16
    input skips one rounding and the next kernel's conversion."""
    impl = _fused_cpu(backend, x)
    if impl is not None:
        return CausalConvSiluFn.apply(impl, x, weight, bias, out_dtype)
    out = conv_silu_ref(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


def rms_norm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True, backend="auto"):
    """Mamba-2's gated, grouped RMSNorm, `rms_norm_gated_ref`'s semantics (no bias): with z and
    not norm_before_gate (the block's order) norm(x * silu(z)), with norm_before_gate norm(x) *
    silu(z), over groups of `group_size` channels (None: one group). Fused in numba for the
    `cpu` backend (float32 arithmetic, the result in x's dtype), PyTorch ops otherwise."""
    d = x.shape[-1]
    g = group_size or d
    if d % g:
        raise ValueError(f"rms_norm_gated: group_size {g} must divide the {d} channels")
    impl = _fused_cpu(backend, x)
    if impl is not None:
        return RMSNormGatedFn.apply(impl, x, weight, z, eps, g, norm_before_gate)
    return rms_norm_gated_ref(x, weight, z, eps, g, norm_before_gate)


def cross_entropy(logits, target, backend="auto"):
    """Mean cross-entropy of logits (..., V) against integer targets (...) in [0, V): the
    training loss. A target outside the range raises IndexError (no ignored index)."""
    logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    impl = _fused_cpu(backend, logits)
    if impl is not None:
        return CrossEntropyFn.apply(impl, logits, target)
    return cross_entropy_ref(logits, target)


__all__ = ["selective_scan", "selective_scan_ref", "conv_silu", "conv_silu_ref", "causal_conv_silu",
           "rms_norm_gated", "rms_norm_gated_ref",
           "rms_norm", "rms_norm_ref", "cross_entropy", "cross_entropy_ref", "fallback_count",
           "reset_fallback_count", "record_fallback",
           "resolve_backend", "use_triton_interpreter_without_gpu", "BACKENDS",
           "GPU_VERIFIED", "TRITON_KERNELS", "on_cuda", "triton_chosen", "triton_module", "load_backend"]
