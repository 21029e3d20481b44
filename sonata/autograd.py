"""torch.autograd glue between the fused scan kernels and the rest of PyTorch.

A fused backend is a module with two functions (see sonata/kernels/cpu.py and
sonata/kernels/triton.py):

    forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
        -> (out, last_state, saved)      # saved: tuple of tensors for backward
    backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, saved)
        -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)

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
    delta_proj). With `delta_proj` (a backend that takes it: the cpu one), `delta` is the
    (batch, L, R) input of the delta projection and the kernels project it themselves."""

    @staticmethod
    def forward(ctx, impl, u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj):
        proj = {} if delta_proj is None else {"delta_proj": delta_proj}
        out, last_state, saved = impl.forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, **proj)
        ctx.impl = impl
        ctx.delta_softplus = delta_softplus
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, delta_proj, *saved)
        ctx.set_materialize_grads(False)
        return out, last_state

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, delta_proj, *saved = ctx.saved_tensors
        proj = {} if delta_proj is None else {"delta_proj": delta_proj}
        grads = ctx.impl.backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias,
                                  ctx.delta_softplus, tuple(saved), **proj)
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, *ddelta_proj = grads
        return (None, du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, None,
                ddelta_proj[0] if ddelta_proj else None)


def fused_scan(impl, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
               delta_proj=None):
    """Run a fused backend with autograd; returns (out, last_state)."""
    return SelectiveScanFn.apply(impl, u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                                 delta_proj)
