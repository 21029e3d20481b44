"""sonata/kernels/selective/autograd.py: torch.autograd glue between the fused Mamba-1 scan
kernels and the rest of PyTorch (`SelectiveScanFn`, run by `fused_scan`).

A fused backend is a module with two functions (see selective/cpu.py and selective/triton.py):

    forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus[, initial_state=h0])
        -> (out, last_state, saved)      # saved: tuple of tensors for backward
    backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, saved
             [, initial_state=h0])
        -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias[, dh0])

`D`, `z` and `delta_bias` may be None, and so are their gradients then. `dout`
or `dlast` may be None (that output was not used). `saved` holds what the
kernel needs beyond the inputs (a few chunk-boundary states, never the full
(batch, L, d_inner, N) state tensor): the backward recomputes the rest.
"""
from __future__ import annotations

import torch


class SelectiveScanFn(torch.autograd.Function):
    """out, last_state = SelectiveScanFn.apply(impl, u, delta, A, B, C, D, z, delta_bias, softplus,
    delta_proj, initial_state). With `delta_proj` (a backend that takes it: the cpu one), `delta`
    is the (batch, L, R) input of the delta projection and the kernels project it themselves.
    `initial_state` (batch, d_inner, N) or None: the state before the first step; its gradient
    is the adjoint after the reverse scan's last step."""

    @staticmethod
    def forward(ctx, impl, u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj, initial_state):
        extra = _extra(delta_proj, initial_state)
        out, last_state, saved = impl.forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, **extra)
        ctx.impl = impl
        ctx.delta_softplus = delta_softplus
        ctx.has_h0 = initial_state is not None
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, delta_proj, *saved)
        ctx.set_materialize_grads(False)
        return out, last_state

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, delta_proj, *saved = ctx.saved_tensors
        # the backward recomputes from the saved checkpoints (the first one is the initial
        # state): it needs only to know that one was given, for its gradient
        extra = _extra(delta_proj, u.new_empty(0) if ctx.has_h0 else None)
        grads = list(ctx.impl.backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias,
                                       ctx.delta_softplus, tuple(saved), **extra))
        dh0 = grads.pop() if ctx.has_h0 else None
        ddelta_proj = grads.pop() if delta_proj is not None else None
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = grads
        return (None, du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, None, ddelta_proj, dh0)


def _extra(delta_proj, initial_state) -> dict:
    """The optional keyword arguments of a backend's forward / backward that are set."""
    extra = {}
    if delta_proj is not None:
        extra["delta_proj"] = delta_proj
    if initial_state is not None:
        extra["initial_state"] = initial_state
    return extra


def fused_scan(impl, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
               delta_proj=None, initial_state=None):
    """Run a fused backend with autograd; returns (out, last_state)."""
    return SelectiveScanFn.apply(impl, u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                                 delta_proj, initial_state)
