"""sonata/kernels/layers/autograd.py: torch.autograd glue between the fused layer ops' kernels
(a backend module such as layers/cpu.py, passed in as `impl`) and the rest of PyTorch: RMSNorm,
the gated RMSNorm, the two causal conv + SiLU forms and the cross-entropy loss."""
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
