"""torch.autograd glue between the fused scan kernels and the rest of PyTorch.

A fused backend is a module with two functions (see sonata/kernels/cpu.py and
sonata/kernels/triton.py):

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


class RMSNormFn(torch.autograd.Function):
    """out = RMSNormFn.apply(impl, x, weight, eps): a backend's fused RMSNorm
    (rms_norm_forward(x, weight, eps) -> (out, rstd); rms_norm_backward(dout, x, weight, rstd)
    -> (dx, dweight)). Saves x and the per-row 1/rms."""

    @staticmethod
    def forward(ctx, impl, x, weight, eps):
        out, rstd = impl.rms_norm_forward(x, weight, eps)
        ctx.impl = impl
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.impl.rms_norm_backward(dout, x, weight, rstd)
        return None, dx, dw, None


class ConvSiluFn(torch.autograd.Function):
    """u, z = ConvSiluFn.apply(impl, xz, weight, bias): a backend's fused depthwise causal conv +
    SiLU of xz's first half and the gate z (its second half), both in the scan's layout
    (conv_silu_forward(xz, weight, bias) -> (u, z); conv_silu_backward(du, dz, xz, weight, bias)
    -> (dxz, dweight, dbias)). Saves only the input: the backward recomputes the pre-activation."""

    @staticmethod
    def forward(ctx, impl, xz, weight, bias):
        ctx.impl = impl
        ctx.save_for_backward(xz, weight, bias)
        return impl.conv_silu_forward(xz, weight, bias)

    @staticmethod
    def backward(ctx, du, dz):
        xz, weight, bias = ctx.saved_tensors
        dxz, dw, db = ctx.impl.conv_silu_backward(du, dz, xz, weight, bias)
        return None, dxz, dw, db


class CausalConvSiluFn(torch.autograd.Function):
    """u = CausalConvSiluFn.apply(impl, x, weight, bias, out_dtype): a backend's fused depthwise
    causal conv + SiLU over all of x's channels, (batch, L, dim) in and out (Mamba-2's conv over
    x, B, C; causal_conv_silu_forward(x, weight, bias, out_dtype) -> u in out_dtype (None: x's);
    causal_conv_silu_backward(du, x, weight, bias) -> (dx, dweight, dbias)). Saves only the
    input: the backward recomputes the rest."""

    @staticmethod
    def forward(ctx, impl, x, weight, bias, out_dtype):
        ctx.impl = impl
        ctx.save_for_backward(x, weight, bias)
        return impl.causal_conv_silu_forward(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, du):
        x, weight, bias = ctx.saved_tensors
        dx, dw, db = ctx.impl.causal_conv_silu_backward(du, x, weight, bias)
        return None, dx, dw, db, None


class RMSNormGatedFn(torch.autograd.Function):
    """out = RMSNormGatedFn.apply(impl, x, weight, z, eps, group_size, norm_before_gate): a
    backend's fused gated, grouped RMSNorm (rms_norm_gated_forward(...) -> (out, rstd);
    rms_norm_gated_backward(dout, x, weight, z, rstd, group_size, norm_before_gate) -> (dx,
    dweight, dz)). Saves x, z and the per-row, per-group 1/rms."""

    @staticmethod
    def forward(ctx, impl, x, weight, z, eps, group_size, norm_before_gate):
        out, rstd = impl.rms_norm_gated_forward(x, weight, z, eps, group_size, norm_before_gate)
        ctx.impl, ctx.group_size, ctx.before = impl, group_size, norm_before_gate
        ctx.save_for_backward(x, weight, z, rstd)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, z, rstd = ctx.saved_tensors
        dx, dw, dz = ctx.impl.rms_norm_gated_backward(dout, x, weight, z, rstd, ctx.group_size, ctx.before)
        return None, dx, dw, dz, None, None, None


class CrossEntropyFn(torch.autograd.Function):
    """loss = CrossEntropyFn.apply(impl, logits, target): a backend's fused mean cross-entropy
    (cross_entropy_forward(logits, target) -> (loss, saved); cross_entropy_backward(dloss, saved,
    dtype) -> dlogits). `saved` holds a (rows, V) tensor, as PyTorch's log-softmax does."""

    @staticmethod
    def forward(ctx, impl, logits, target):
        loss, saved = impl.cross_entropy_forward(logits, target)
        ctx.impl = impl
        ctx.dtype = logits.dtype
        ctx.save_for_backward(*saved)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        return None, ctx.impl.cross_entropy_backward(dloss, ctx.saved_tensors, ctx.dtype), None


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
