"""sonata/kernels/gdn/ops.py: the fused CPU gated delta rule (gdn/cpu.py) as PyTorch custom ops,
so torch.compile traces a GDN layer through it without a graph break:

    sonata::gated_delta_rule(q, k, v, g, beta, initial_state?, scale, chunk_size)
        -> (o, final_state, checkpoints)
    sonata::gated_delta_rule_backward(do?, dfinal?, q, k, v, g, beta, checkpoints, scale,
                                      chunk_size, has_initial_state) -> (dq, dk, dv, dg, dbeta, dS0)

cpu.gdn_forward's and cpu.gdn_backward's arguments and results (dS0 comes back empty without an
initial state: an op returns tensors only), each with a fake implementation and the forward's
autograd calling the backward op; `torch.library.opcheck` checks them (tests/kernels/
test_gdn_kernels.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sonata.kernels.dispatch import compute_dtype
from sonata.kernels.gdn.reference import default_scale


def _cpu():
    from sonata.kernels.gdn import cpu           # numba, imported on first use
    return cpu


@torch.library.custom_op("sonata::gated_delta_rule", mutates_args=())
def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                     scale: float, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    return _cpu().gdn_forward(q, k, v, g, beta, initial_state, scale, chunk_size)


@gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, scale, chunk_size):
    b, L, h, dv = v.shape
    dk, ct = q.shape[-1], compute_dtype(v.dtype)
    C = max(1, min(int(chunk_size), L))
    return (v.new_empty(v.shape), v.new_empty((b, h, dk, dv), dtype=ct),
            v.new_empty((b, h, -(-L // C), dk, dv), dtype=ct))


@torch.library.custom_op("sonata::gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward(do: Optional[Tensor], dfinal: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                              g: Tensor, beta: Tensor, ckpt: Tensor, scale: float, chunk_size: int,
                              initial_dtype: Optional[torch.dtype]) -> list[Tensor]:
    grads = _cpu().gdn_backward(do, dfinal, q, k, v, g, beta, ckpt, scale, chunk_size, initial_dtype)
    return [v.new_empty(0) if t is None else t for t in grads]


@gated_delta_rule_backward.register_fake
def _(do, dfinal, q, k, v, g, beta, ckpt, scale, chunk_size, initial_dtype):
    b, L, h, dv = v.shape
    dS0 = v.new_empty(0) if initial_dtype is None else v.new_empty((b, h, q.shape[-1], dv), dtype=initial_dtype)
    return [t.new_empty(t.shape) for t in (q, k, v, g, beta)] + [dS0]


def _setup(ctx, inputs, output):
    q, k, v, g, beta, S0, scale, chunk_size = inputs
    ctx.scale, ctx.chunk, ctx.s0_dtype = scale, chunk_size, None if S0 is None else S0.dtype
    ctx.save_for_backward(q, k, v, g, beta, output[2])


def _grad(ctx, do, dfinal, _dckpt):
    q, k, v, g, beta, ckpt = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dS0 = torch.ops.sonata.gated_delta_rule_backward(
        do, dfinal, q, k, v, g, beta, ckpt, ctx.scale, ctx.chunk, ctx.s0_dtype)
    return dq, dk, dv, dg, dbeta, None if ctx.s0_dtype is None else dS0, None, None


gated_delta_rule.register_autograd(_grad, setup_context=_setup)


def gdn_cpu(q, k, v, g, beta, scale=None, initial_state=None, return_final_state=False, chunk_size=64):
    """`gdn_chunked_ref`'s arguments and results, on the fused kernels through the op."""
    scale = default_scale(q) if scale is None else float(scale)
    o, S, _ = torch.ops.sonata.gated_delta_rule(q, k, v, g, beta, initial_state, scale, int(chunk_size))
    return (o, S) if return_final_state else o


__all__ = ["gated_delta_rule", "gated_delta_rule_backward", "gdn_cpu"]
