"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear-attention layer): one entry point
with fla's `chunk_gated_delta_rule` meaning, several backends, and the one-token step.

    gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, return_final_state=False,
                     chunk_size=64, backend="auto") -> o (b, l, h, dv) [, final_state (b, h, dk, dv)]
    gated_delta_rule_step(state, q, k, v, g, beta, scale=None) -> o (b, h, dv), state updated in place

Shapes and meaning are `reference.py`'s (q, k (b, l, hk, dk) with hk dividing the h value heads;
q and k as given: the layer L2-normalises them first). Backends:
  reference  the chunked WY form in plain PyTorch (`gdn_chunked_ref`, autograd through it)
  recurrent  the step-by-step recurrence (`gdn_recurrent_ref`: the float64 oracle)
  cpu        fused numba kernels (`cpu.py`): the recurrence forward with the state kept at each
             chunk's start, a backward that recomputes a chunk's states from there and walks it
             back, and the fused one-token step
  triton     no Triton kernels yet: the reference runs, by design (not a fallback)
  auto       cpu on CPU tensors, the reference on others
When the cpu path cannot run (numba missing, GPU tensors) the reference runs instead and
sonata.kernels' process-wide fallback counter moves, warning once per reason
(`sonata.kernels.dispatch`, the policy every family shares). A sequence of length 0 returns at
once (the initial state is the final one).
"""
from __future__ import annotations

import torch

from sonata.kernels import dispatch
from sonata.kernels.gdn.reference import (check_step, default_scale, expand_heads, gdn_chunked_ref,
                                          gdn_recurrent_ref, gdn_step_ref, l2norm)

GDN = dispatch.Family("gdn", "gdn", cpu="gdn.cpu", triton=None, label="gdn ", extra=("recurrent",))
BACKENDS = GDN.backends
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(q, k, v, g, beta, initial_state=None, chunk_size=64):
    """ValueError naming the first argument that does not fit v (b, l, h, dv) and q (b, l, hk, dk)."""
    def bad(msg):
        raise ValueError(f"gdn: {msg}")
    if v.dim() != 4:
        bad(f"v must be (batch, seqlen, heads, dv), got {tuple(v.shape)}")
    if v.dtype not in _FLOATS:
        bad(f"v must be a floating tensor (float16/bfloat16/float32/float64), got {v.dtype}")
    b, L, h, dv = v.shape
    if q.dim() != 4 or q.shape[:2] != (b, L):
        bad(f"q must be (batch, seqlen, key heads, dk) = ({b}, {L}, hk, dk), got {tuple(q.shape)}")
    if k.shape != q.shape:
        bad(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    hk, dk = q.shape[2], q.shape[3]
    if hk < 1 or h % hk:
        bad(f"{h} value heads cannot share {hk} key heads (heads must be a multiple of key heads)")
    for name, t, want in (("g", g, (b, L, h)), ("beta", beta, (b, L, h)),
                          ("initial_state", initial_state, (b, h, dk, dv))):
        if t is not None and tuple(t.shape) != want:
            bad(f"{name} must be {want} for v {tuple(v.shape)} and q {tuple(q.shape)}, got {tuple(t.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        bad(f"chunk_size must be a positive int, got {chunk_size!r}")
    for name, t in (("q", q), ("k", k), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.device != v.device:
            bad(f"{name} is on {t.device}, v on {v.device}")


def resolve_backend(backend: str, x: torch.Tensor) -> tuple[str, str | None]:
    """Which backend runs for tensors like x: (name, why it is not the requested one)."""
    name, why = dispatch.resolve(GDN, backend, x)
    return ("reference", why) if name == "triton" else (name, why)


def gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, return_final_state=False,
                     chunk_size=64, backend="auto"):
    """The gated delta rule (module docstring)."""
    check_inputs(q, k, v, g, beta, initial_state, chunk_size)
    name, why = resolve_backend(backend, v)
    if why is not None:
        dispatch.record_fallback(why)
    if v.shape[1] == 0:
        name = "recurrent"                              # nothing to compute
    if name == "cpu":
        from sonata.kernels.gdn import ops              # registered on first use (it imports dynamo)
        impl = ops.gdn_cpu                              # the custom op on cpu.py's kernels
    else:
        impl = {"reference": gdn_chunked_ref, "recurrent": gdn_recurrent_ref}[name]
    return impl(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                return_final_state=return_final_state, chunk_size=chunk_size)


def gated_delta_rule_step(state, q, k, v, g, beta, scale=None):
    """One token (decoding): q, k (b, hk, dk), v (b, h, dv), g, beta (b, h) -> o (b, h, dv) in
    v's dtype, `state` (b, h, dk, dv) updated in place. The fused numba step for a contiguous
    float32 or float64 CPU state when no input asks for a gradient, the torch ops otherwise."""
    check_step(state, q, k, v, g, beta)
    if (state.device.type == "cpu" and state.dtype in (torch.float32, torch.float64) and state.is_contiguous()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (state, q, k, v, g, beta)))):
        mod, _ = dispatch.load_backend(GDN.cpu)
        if mod is not None:
            return mod.gdn_step_cpu(state, q, k, v, g, beta, scale)
    return gdn_step_ref(state, q, k, v, g, beta, scale)


__all__ = ["BACKENDS", "GDN", "check_inputs", "check_step", "default_scale", "expand_heads", "gated_delta_rule",
           "gated_delta_rule_step", "gdn_chunked_ref", "gdn_recurrent_ref", "gdn_step_ref", "l2norm",
           "resolve_backend"]
