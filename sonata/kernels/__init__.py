"""sonata.kernels: sonata's kernels, one folder per family, chosen by one dispatch module.

    dispatch.py    the backend policy of every family: BACKENDS, the fallback counter
                   (fallback_count, reset_fallback_count, record_fallback), the Triton checks
                   (TRITON_KERNELS, GPU_VERIFIED, on_cuda, triton_chosen, triton_module),
                   load_backend, compute_dtype, and `resolve`: a family's `Family` description
                   and a requested backend -> the backend that runs and why
    selective/     the Mamba-1 selective scan: `selective_scan`, `selective_scan_ref`,
                   `resolve_backend` (reference.py, cpu.py + cpu_kernels.py, ops.py: the cpu
                   scan as a custom op, triton.py, autograd.py: the Triton path's,
                   decode_cpu.py: the model's one-token fused decode)
    layers/        the fused layer ops: conv_silu, causal_conv_silu, rms_norm, rms_norm_gated,
                   cross_entropy, each beside its reference (reference.py, cpu.py + numba
                   kernels, ops.py: each a custom op)
    ssd/           the SSD (Mamba-2) scan: `from sonata.kernels.ssd import ssd, ssd_step, ...`
    mamba3/        the Mamba-3 scan as mamba_ssm released it, SISO and MIMO: `mamba3_scan`,
                   `mamba3_step` (reference.py, ssd_form.py: SISO on the SSD kernel, chunked.py:
                   any rank, cpu_step.py: the layer's fused one-token step)
    gdn/           Gated DeltaNet's gated delta rule: `gated_delta_rule`, `gated_delta_rule_step`
                   (reference.py: the recurrence and the chunked WY form, cpu.py: numba,
                   ops.py: the fused rule as a custom op)
    cpu_simd.py, cpu_arrays.py, numba_cache.py
                   shared numba infrastructure: lane widths, compile flags and fast maths; the
                   torch <-> numpy glue; the on-disk cache keyed by every source here

This module only re-exports the public API (docs/kernels.md describes it).
"""
from __future__ import annotations

from sonata.kernels.dispatch import (BACKENDS, GPU_VERIFIED, TRITON_KERNELS, fallback_count, load_backend, on_cuda,
                                     record_fallback, reset_fallback_count, triton_chosen, triton_module,
                                     use_triton_interpreter_without_gpu)
from sonata.kernels.layers import (causal_conv_silu, conv_silu, conv_silu_ref, cross_entropy, cross_entropy_ref,
                                   rms_norm, rms_norm_gated, rms_norm_gated_ref, rms_norm_ref)
from sonata.kernels.selective import resolve_backend, selective_scan, selective_scan_ref

def register_ops() -> None:
    """Register every kernel that is a PyTorch custom op (torch.ops.sonata.*: the layer ops,
    Mamba-1's scan, GDN's rule). Each registers itself on first use; a process that loads an
    exported program (torch.export.load) before running any sonata kernel calls this first.
    It imports torch._dynamo and triton: after `use_triton_interpreter_without_gpu`."""
    import importlib

    for family in ("layers", "selective", "gdn"):
        importlib.import_module(f"sonata.kernels.{family}.ops")


__all__ = ["register_ops", "selective_scan", "selective_scan_ref", "conv_silu", "conv_silu_ref", "causal_conv_silu",
           "rms_norm_gated", "rms_norm_gated_ref",
           "rms_norm", "rms_norm_ref", "cross_entropy", "cross_entropy_ref", "fallback_count",
           "reset_fallback_count", "record_fallback",
           "resolve_backend", "use_triton_interpreter_without_gpu", "BACKENDS",
           "GPU_VERIFIED", "TRITON_KERNELS", "on_cuda", "triton_chosen", "triton_module", "load_backend"]
