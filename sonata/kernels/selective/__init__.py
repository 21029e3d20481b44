"""sonata/kernels/selective/: the Mamba-1 selective scan, one entry point and three backends.

    selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                   delta_softplus=False, return_last_state=False, backend="auto",
                   delta_proj=None, initial_state=None)

The folder: reference.py (`selective_scan_ref`, the oracle; `project_delta`; `step`, one token),
cpu.py (the `cpu` backend's torch glue) and cpu_kernels.py (its numba kernels), decode_cpu.py (the
model's one-token fused decode), triton.py (the `triton` backend), ops.py (the `cpu` scan's
forward and backward as PyTorch custom ops, torch.ops.sonata.selective_scan*: what the `cpu`
backend runs, traced by torch.compile), autograd.py (`fused_scan`, the Triton path's autograd).

`initial_state` (batch, d_inner, N), when given, is the state before the first step (mamba_ssm
has no such argument; zeros when None), and it receives a gradient: with `return_last_state`
a long sequence runs chunk by chunk, each chunk starting from the last one's final state, and
gives what one pass over the whole sequence gives. `delta_proj` (d_inner, R), when given, makes
`delta` the (batch, L, R) input of the model's delta projection: the scan's delta is
(delta @ delta_proj.T).transpose(1, 2). The `cpu` kernels compute that product block by block
inside the scan (and its gradients in the backward), so no (batch, d_inner, L) delta is ever
stored or transposed; the other backends compute it with a matmul first.

`reference` is plain PyTorch (the oracle, any dtype, autograd through it); `cpu` is fused numba
kernels; `triton` is fused Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1). `auto`
picks triton on CUDA and cpu on CPU. Which one runs is sonata.kernels.dispatch's rule (`SELECTIVE`
below): when a requested fast path cannot run, the reference runs instead and the process-wide
fallback counter moves (`fallback_count()`), a warning naming the reason once per reason.
"""
from __future__ import annotations

import torch

from sonata.kernels import dispatch
from sonata.kernels.selective.autograd import fused_scan
from sonata.kernels.selective.reference import project_delta, selective_scan_ref, step

SELECTIVE = dispatch.Family("selective_scan", "scan", cpu="selective.cpu", triton="selective.triton")
BACKENDS = SELECTIVE.backends


def resolve_backend(backend: str, u: torch.Tensor) -> tuple[str, str | None]:
    """Which backend runs for tensors like `u`: (name, reason it is not the requested one)."""
    return dispatch.resolve(SELECTIVE, backend, u)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                   delta_softplus=False, return_last_state=False, backend="auto", delta_proj=None,
                   initial_state=None):
    name, reason = resolve_backend(backend, u)
    if reason is not None:
        dispatch.record_fallback(reason)
    if delta_proj is not None and name != "cpu":
        delta, delta_proj = project_delta(delta, delta_proj), None
    if name == "reference":
        return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                  return_last_state, initial_state)
    if name == "triton":
        dispatch.triton_chosen("selective_scan", backend, u)
    impl, _ = dispatch.load_backend(getattr(SELECTIVE, name))
    if name == "cpu":                   # a custom op: torch.compile traces through it (ops.py)
        from sonata.kernels.selective import ops        # registered on first use (it imports dynamo)
        out, last_state, _ = ops.selective_scan(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                                                delta_proj, initial_state)
    else:
        out, last_state = fused_scan(impl, u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj,
                                     initial_state)
    return (out, last_state) if return_last_state else out


__all__ = ["BACKENDS", "SELECTIVE", "project_delta", "resolve_backend", "selective_scan", "selective_scan_ref",
           "step"]
