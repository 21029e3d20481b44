"""The fused layer ops as PyTorch custom ops (sonata.kernels.layers.ops): torch.library.opcheck
on each (schema, fake implementation against the real one, autograd registration), with and
without the optional arguments, in float32 and float64."""
import pytest
import torch

from sonata.kernels.layers import ops


def _t(*shape, dtype=torch.float64, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_layer_op_passes_opcheck(dtype):
    b, L, d = 2, 7, 8
    cases = [
        (ops.rms_norm, (_t(b, L, d, dtype=dtype), _t(d, dtype=dtype), 1e-5)),
        (ops.rms_norm_gated, (_t(b, L, d, dtype=dtype), _t(d, dtype=dtype), _t(b, L, d, dtype=dtype), 1e-5, 4, False)),
        (ops.rms_norm_gated, (_t(b, L, d, dtype=dtype), _t(d, dtype=dtype), None, 1e-5, 8, True)),
        (ops.conv_silu, (_t(b, L, 2 * d, dtype=dtype), _t(d, 1, 4, dtype=dtype), _t(d, dtype=dtype))),
        (ops.conv_silu, (_t(b, L, 2 * d, dtype=dtype), _t(d, 1, 4, dtype=dtype), None)),
        (ops.causal_conv_silu, (_t(b, L, d, dtype=dtype), _t(d, 1, 4, dtype=dtype), _t(d, dtype=dtype), None)),
        (ops.causal_conv_silu, (_t(b, L, d, dtype=dtype), _t(d, 1, 4, dtype=dtype), None, None)),
        (ops.cross_entropy, (_t(b * L, 11, dtype=dtype), torch.randint(0, 11, (b * L,)))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
