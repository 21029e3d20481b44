"""sonata/kernels/layers/: the fused layer ops around the scans, each beside its reference.

    rms_norm(x, weight, eps, backend)                the blocks' RMSNorm
    conv_silu(xz, weight, bias, backend)             Mamba-1's depthwise causal conv + SiLU of
                                                     in_proj's first half, and the gate
    causal_conv_silu(x, weight, bias, backend)       Mamba-2's conv alone (over x, B and C)
    rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate, backend)
                                                     Mamba-2's gated, grouped output norm
    cross_entropy(logits, target, backend)           the training loss (mean over rows)

The folder: reference.py (the oracles), cpu.py (the `cpu` backend's torch glue) and its numba
kernels cpu_conv.py, cpu_norm.py, cpu_loss.py, ops.py (each forward and backward a PyTorch
custom op, torch.ops.sonata.*, with its fake implementation and autograd: torch.compile traces
through them without a graph break).
Fused in numba for the `cpu` backend; PyTorch ops for the others, which is their design and not
a fallback (there are no Triton kernels here); `cpu` falling back (no numba, a GPU tensor, a
dtype the kernels do not take) counts (sonata.kernels.dispatch, `LAYERS` below).
"""
from __future__ import annotations

from sonata.kernels import dispatch
from sonata.kernels.layers.reference import conv_silu_ref, cross_entropy_ref, rms_norm_gated_ref, rms_norm_ref

# "scan" in its errors: the layers take the model's one backend setting, the scan's
LAYERS = dispatch.Family("layers", "scan", cpu="layers.cpu", triton=None)


def fused_cpu(backend, x):
    """The layers' custom ops (layers/ops.py, on the cpu backend's kernels) when `backend`
    resolves to cpu for x, else None (a `cpu` request that cannot run counts as a fallback;
    other backends use PyTorch ops by design). The ops module is imported here, on first use:
    registering an op imports torch._dynamo (and triton), which sonata's import must not."""
    name, reason = dispatch.resolve(LAYERS, backend, x)
    if name == "cpu":
        from sonata.kernels.layers import ops
        return ops
    if reason is not None and backend == "cpu":
        dispatch.record_fallback(reason)
    return None


def rms_norm(x, weight, eps, backend="auto"):
    """x * rsqrt(mean(x^2, -1) + eps) * weight for x (..., d), weight (d,)."""
    impl = fused_cpu(backend, x)
    if impl is not None:
        return impl.rms_norm(x, weight, float(eps))[0]
    return rms_norm_ref(x, weight, eps)


def conv_silu(xz, weight, bias, backend="auto"):
    """The mixer's convolution and gate split: xz (batch, L, 2 dim), in_proj's output, any
    strides -> (u, z), each (batch, L, dim): u = silu(depthwise causal conv1d(xz[..., :dim]) +
    bias) and the gate z = xz[..., dim:]. weight (dim, 1, K), bias (dim,). Fused in numba for
    the `cpu` backend: u C-contiguous (x_proj and the cpu scan read it in place), z moved into
    the scan's (batch, dim, L) layout (a transposed view comes back), and the backward writes
    the whole projection's gradient at once; PyTorch ops for the others (z a view of xz)."""
    impl = fused_cpu(backend, xz)
    if impl is not None:
        u, z = impl.conv_silu(xz, weight, bias)
        return u.transpose(1, 2), z.transpose(1, 2)
    dim = weight.shape[0]
    return conv_silu_ref(xz[..., :dim], weight, bias), xz[..., dim:]


def causal_conv_silu(x, weight, bias, backend="auto", out_dtype=None):
    """Mamba-2's convolution: x (batch, L, dim), any strides (the xBC slice of in_proj's
    output) -> silu(depthwise causal conv1d(x) + bias), (batch, L, dim); `conv_silu_ref`'s
    semantics. weight (dim, 1, K), bias (dim,) or None. Fused in numba for the `cpu` backend
    (the output C-contiguous), PyTorch's conv1d + SiLU otherwise. out_dtype: the output's
    dtype (None: x's); the fused kernel computes in float32, so a float32 output of bfloat16
    input skips one rounding and the next kernel's conversion."""
    impl = fused_cpu(backend, x)
    if impl is not None:
        return impl.causal_conv_silu(x, weight, bias, out_dtype)
    out = conv_silu_ref(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


def rms_norm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True, backend="auto"):
    """Mamba-2's gated, grouped RMSNorm, `rms_norm_gated_ref`'s semantics (no bias): with z and
    not norm_before_gate (the block's order) norm(x * silu(z)), with norm_before_gate norm(x) *
    silu(z), over groups of `group_size` channels (None: one group). Fused in numba for the
    `cpu` backend (float32 arithmetic, the result in x's dtype), PyTorch ops otherwise."""
    d = x.shape[-1]
    g = group_size or d
    if d % g:
        raise ValueError(f"rms_norm_gated: group_size {g} must divide the {d} channels")
    impl = fused_cpu(backend, x)
    if impl is not None:
        return impl.rms_norm_gated(x, weight, z, float(eps), int(g), bool(norm_before_gate))[0]
    return rms_norm_gated_ref(x, weight, z, eps, g, norm_before_gate)


def cross_entropy(logits, target, backend="auto"):
    """Mean cross-entropy of logits (..., V) against integer targets (...) in [0, V): the
    training loss. A target outside the range raises IndexError (no ignored index)."""
    logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    impl = fused_cpu(backend, logits)
    if impl is not None:
        return impl.cross_entropy(logits, target)[0]
    return cross_entropy_ref(logits, target)


__all__ = ["LAYERS", "causal_conv_silu", "conv_silu", "conv_silu_ref", "cross_entropy", "cross_entropy_ref",
           "fused_cpu", "rms_norm", "rms_norm_gated", "rms_norm_gated_ref", "rms_norm_ref"]
