"""sonata/kernels/selective/ops.py: the fused CPU selective scan (selective/cpu.py) as PyTorch
custom ops, so torch.compile traces a Mamba-1 model through its scan without a graph break:

    sonata::selective_scan(u, delta, A, B, C, D?, z?, delta_bias?, delta_softplus, delta_proj?,
                           initial_state?) -> (out, last_state, checkpoints)
    sonata::selective_scan_backward(dout?, dlast?, u, delta, A, B, C, D?, z?, delta_bias?,
                           delta_softplus, checkpoints, delta_proj?, initial_state?)
        -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, ddelta_proj, dinitial_state)

The arguments and outputs are cpu.forward's and cpu.backward's (the states saved every CHUNK
steps are the third output, read by the backward); a gradient whose input is absent comes back
empty (an op returns tensors only). Each has a fake implementation giving the real outputs'
shapes, dtypes and strides (out and du are transposed views of (batch, L, dim) tensors, dB and
dC are laid out like B and C), and the forward's autograd calls the backward op.
`torch.library.opcheck` checks both (tests/kernels/test_selective_ops.py). The Triton path keeps
its autograd Function (selective/autograd.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sonata.kernels.dispatch import compute_dtype


def _cpu():
    from sonata.kernels.selective import cpu     # numba, imported on first use
    return cpu


def _chunk() -> int:
    from sonata.kernels.selective.cpu import CHUNK
    return CHUNK


def _time_major(shape, like: Tensor, dtype) -> Tensor:
    """An empty (b, X, L) tensor stored as a transposed (b, L, X) one."""
    return like.new_empty((shape[0], shape[2], shape[1]), dtype=dtype).transpose(1, 2)


def _extra(delta_proj, initial_state) -> dict:
    return {**({} if delta_proj is None else {"delta_proj": delta_proj}),
            **({} if initial_state is None else {"initial_state": initial_state})}


@torch.library.custom_op("sonata::selective_scan", mutates_args=())
def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                   z: Optional[Tensor], delta_bias: Optional[Tensor], delta_softplus: bool,
                   delta_proj: Optional[Tensor], initial_state: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    out, last, (ckpt, _) = _cpu().forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                          **_extra(delta_proj, initial_state))
    return out, last, ckpt


@selective_scan.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj, initial_state):
    batch, dim, L = u.shape
    N, ct = A.shape[1], compute_dtype(u.dtype)
    return (_time_major((batch, dim, L), u, u.dtype), u.new_empty((batch, dim, N), dtype=ct),
            u.new_empty((batch, dim, -(-L // _chunk()), N), dtype=ct))


@torch.library.custom_op("sonata::selective_scan_backward", mutates_args=())
def selective_scan_backward(dout: Optional[Tensor], dlast: Optional[Tensor], u: Tensor, delta: Tensor, A: Tensor,
                            B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
                            delta_bias: Optional[Tensor], delta_softplus: bool, ckpt: Tensor,
                            delta_proj: Optional[Tensor], initial_state: Optional[Tensor]) -> list[Tensor]:
    grads = list(_cpu().backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                 (ckpt, _chunk()), **_extra(delta_proj, initial_state)))
    dh0 = grads.pop() if initial_state is not None else None
    dW = grads.pop() if delta_proj is not None else None
    return [u.new_empty(0) if g is None else g for g in grads + [dW, dh0]]   # each its own: no two alias


def _like(t, fn):
    return None if t is None else fn(t)


@selective_scan_backward.register_fake
def _(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, ckpt, delta_proj, initial_state):
    batch, dim, L = u.shape

    def laid_like(t):                     # dB, dC: as cpu._empty_like_layout lays them out
        if t.dim() == 3 and t.stride(1) < t.stride(2):
            return _time_major(t.shape, t, t.dtype)
        return t.new_empty(t.shape)

    grads = [_time_major((batch, dim, L), u, u.dtype), delta.new_empty(delta.shape), A.new_empty(A.shape),
             laid_like(B), laid_like(C), _like(D, lambda t: t.new_empty(t.shape)),
             _like(z, lambda t: t.new_empty(t.shape)), _like(delta_bias, lambda t: t.new_empty(t.shape)),
             _like(delta_proj, lambda t: t.new_empty(t.shape)),
             _like(initial_state, lambda t: t.new_empty(t.shape))]
    return [u.new_empty(0) if g is None else g for g in grads]


def _setup(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj, initial_state = inputs
    ctx.delta_softplus = delta_softplus
    ctx.present = [t is not None for t in (D, z, delta_bias, delta_proj, initial_state)]
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, delta_proj, initial_state, output[2])


def _grad(ctx, dout, dlast, _dckpt):
    u, delta, A, B, C, D, z, delta_bias, delta_proj, initial_state, ckpt = ctx.saved_tensors
    g = torch.ops.sonata.selective_scan_backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias,
                                                 ctx.delta_softplus, ckpt, delta_proj, initial_state)
    du, ddelta, dA, dB, dC, dD, dz, ddb, dW, dh0 = g
    hasD, hasz, hasb, hasW, hash0 = ctx.present
    return (du, ddelta, dA, dB, dC, dD if hasD else None, dz if hasz else None, ddb if hasb else None, None,
            dW if hasW else None, dh0 if hash0 else None)


selective_scan.register_autograd(_grad, setup_context=_setup)


__all__ = ["selective_scan", "selective_scan_backward"]
