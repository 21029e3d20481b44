"""sonata/kernels/layers/ops.py: the fused layer ops (layers/cpu.py's numba kernels) as PyTorch
custom ops, `torch.ops.sonata.*`: each forward and backward an op with a fake (meta)
implementation that gives its outputs' shapes, dtypes and strides without running it, and the
forward's autograd formula calling the backward op. torch.compile then traces a model through
them with no graph break (dynamo cannot trace numba itself), and `torch.library.opcheck` checks
each (tests/kernels/test_layers_ops.py).

    sonata::rms_norm(x, weight, eps) -> (out, rstd)
    sonata::rms_norm_gated(x, weight, z?, eps, group_size, norm_before_gate) -> (out, rstd)
    sonata::conv_silu(xz, weight, bias?) -> (u, z)            u a transposed view, as the kernel's
    sonata::causal_conv_silu(x, weight, bias?, out_dtype?) -> u
    sonata::cross_entropy(logits, target) -> (loss, ex, c)    ex, c: what the backward reads

and a `*_backward` op for each (an absent gradient, of a missing z or bias, comes back as an
empty tensor: an op returns tensors only). An op's outputs never alias its inputs (a custom
op's rule): where a kernel would hand an input back (the int64 targets), the op does not
return it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sonata.kernels.dispatch import compute_dtype


def _cpu():
    from sonata.kernels.layers import cpu        # numba, imported on first use
    return cpu


def _or_none(t, like: Tensor) -> Tensor:
    """An op returns tensors only: an absent gradient (no z, no bias) comes back empty."""
    return like.new_empty(0) if t is None else t


def _fake_bias_grad(bias, like: Tensor) -> Tensor:
    return like.new_empty(0) if bias is None else bias.new_empty(bias.shape)


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


# ---- RMSNorm

@torch.library.custom_op("sonata::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    out, rstd = _cpu().rms_norm_forward(x, weight, eps)
    return out, rstd


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(_rows(x), dtype=compute_dtype(x.dtype))


@torch.library.custom_op("sonata::rms_norm_backward", mutates_args=())
def rms_norm_backward(dout: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return _cpu().rms_norm_backward(dout, x, weight, rstd)


@rms_norm_backward.register_fake
def _(dout, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx, dout, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.sonata.rms_norm_backward(dout, x, weight, rstd)
    return dx, dw, None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# ---- the gated, grouped RMSNorm

@torch.library.custom_op("sonata::rms_norm_gated", mutates_args=())
def rms_norm_gated(x: Tensor, weight: Tensor, z: Optional[Tensor], eps: float, group_size: int,
                   norm_before_gate: bool) -> tuple[Tensor, Tensor]:
    return _cpu().rms_norm_gated_forward(x, weight, z, eps, group_size, norm_before_gate)


@rms_norm_gated.register_fake
def _(x, weight, z, eps, group_size, norm_before_gate):
    return x.new_empty(x.shape), x.new_empty((_rows(x), x.shape[-1] // group_size), dtype=compute_dtype(x.dtype))


@torch.library.custom_op("sonata::rms_norm_gated_backward", mutates_args=())
def rms_norm_gated_backward(dout: Tensor, x: Tensor, weight: Tensor, z: Optional[Tensor], rstd: Tensor,
                            group_size: int, norm_before_gate: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, dz = _cpu().rms_norm_gated_backward(dout, x, weight, z, rstd, group_size, norm_before_gate)
    return dx, dw, _or_none(dz, x)


@rms_norm_gated_backward.register_fake
def _(dout, x, weight, z, rstd, group_size, norm_before_gate):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty(0) if z is None else z.new_empty(z.shape)


def _gated_setup(ctx, inputs, output):
    x, weight, z, _, group_size, before = inputs
    ctx.group_size, ctx.before = group_size, before
    ctx.save_for_backward(x, weight, z, output[1])


def _gated_grad(ctx, dout, _drstd):
    x, weight, z, rstd = ctx.saved_tensors
    dx, dw, dz = torch.ops.sonata.rms_norm_gated_backward(dout, x, weight, z, rstd, ctx.group_size, ctx.before)
    return dx, dw, None if z is None else dz, None, None, None


rms_norm_gated.register_autograd(_gated_grad, setup_context=_gated_setup)


# ---- Mamba-1's conv + SiLU and gate split

@torch.library.custom_op("sonata::conv_silu", mutates_args=())
def conv_silu(xz: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _cpu().conv_silu_forward(xz, weight, bias)


@conv_silu.register_fake
def _(xz, weight, bias):
    b, L, dim = xz.shape[0], xz.shape[1], weight.shape[0]
    return xz.new_empty((b, L, dim)).transpose(1, 2), xz.new_empty((b, dim, L))


@torch.library.custom_op("sonata::conv_silu_backward", mutates_args=())
def conv_silu_backward(du: Tensor, dz: Tensor, xz: Tensor, weight: Tensor,
                       bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    dxz, dw, db = _cpu().conv_silu_backward(du, dz, xz, weight, bias)
    return dxz, dw, _or_none(db, xz)


@conv_silu_backward.register_fake
def _(du, dz, xz, weight, bias):
    return xz.new_empty(xz.shape), weight.new_empty(weight.shape), _fake_bias_grad(bias, xz)


def _conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_silu_grad(ctx, du, dz):
    xz, weight, bias = ctx.saved_tensors
    if du is None:
        du = xz.new_zeros((xz.shape[0], weight.shape[0], xz.shape[1]))
    if dz is None:
        dz = xz.new_zeros((xz.shape[0], weight.shape[0], xz.shape[1]))
    dxz, dw, db = torch.ops.sonata.conv_silu_backward(du, dz, xz, weight, bias)
    return dxz, dw, None if bias is None else db


conv_silu.register_autograd(_conv_silu_grad, setup_context=_conv_setup)


# ---- Mamba-2's causal conv + SiLU

@torch.library.custom_op("sonata::causal_conv_silu", mutates_args=())
def causal_conv_silu(x: Tensor, weight: Tensor, bias: Optional[Tensor], out_dtype: Optional[torch.dtype]) -> Tensor:
    return _cpu().causal_conv_silu_forward(x, weight, bias, out_dtype)


@causal_conv_silu.register_fake
def _(x, weight, bias, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@torch.library.custom_op("sonata::causal_conv_silu_backward", mutates_args=())
def causal_conv_silu_backward(dout: Tensor, x: Tensor, weight: Tensor,
                              bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _cpu().causal_conv_silu_backward(dout, x, weight, bias)
    return dx, dw, _or_none(db, x)


@causal_conv_silu_backward.register_fake
def _(dout, x, weight, bias):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), _fake_bias_grad(bias, x)


def _causal_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])


def _causal_grad(ctx, dout):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.sonata.causal_conv_silu_backward(dout, x, weight, bias)
    return dx, dw, None if bias is None else db, None


causal_conv_silu.register_autograd(_causal_grad, setup_context=_causal_setup)


# ---- cross-entropy

@torch.library.custom_op("sonata::cross_entropy", mutates_args=())
def cross_entropy(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    loss, (ex, c, _) = _cpu().cross_entropy_forward(logits, target)
    return loss, ex, c


@cross_entropy.register_fake
def _(logits, target):
    ct = compute_dtype(logits.dtype)
    return (logits.new_empty(()), logits.new_empty(logits.shape, dtype=ct),
            logits.new_empty(logits.shape[0], dtype=ct))


@torch.library.custom_op("sonata::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(dloss: Tensor, ex: Tensor, c: Tensor, target: Tensor, dtype: torch.dtype) -> Tensor:
    return _cpu().cross_entropy_backward(dloss, (ex, c, target.to(torch.int64)), dtype)


@cross_entropy_backward.register_fake
def _(dloss, ex, c, target, dtype):
    return ex.new_empty(ex.shape, dtype=dtype)


def _ce_setup(ctx, inputs, output):
    logits, target = inputs
    ctx.dtype = logits.dtype
    ctx.save_for_backward(output[1], output[2], target)


def _ce_grad(ctx, dloss, _dex, _dc):
    ex, c, target = ctx.saved_tensors
    return torch.ops.sonata.cross_entropy_backward(dloss, ex, c, target, ctx.dtype), None


cross_entropy.register_autograd(_ce_grad, setup_context=_ce_setup)


__all__ = ["causal_conv_silu", "conv_silu", "cross_entropy", "rms_norm", "rms_norm_gated"]
