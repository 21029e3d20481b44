"""sonata/kernels/cpu_arrays.py: the torch <-> numpy glue every family's fused numba backend
shares (shared numba infrastructure, beside cpu_simd.py and numba_cache.py): torch tensors as
the arrays the kernels read, with no copy when a tensor already is one.
"""
from __future__ import annotations

import numpy as np
import torch

# The glue below runs once per kernel call, about 20 calls per training step: each torch call
# in it costs 1-2.5 us, so it takes the cheap path (no .to(), .contiguous() or transpose through
# torch) when the tensor already is what the kernels read. A set of the six kernel calls (scan,
# conv, RMSNorm, forward and backward) at the smallest size, where only the glue costs, went from
# 972 to 689 us with it (paired, 40 rounds): about 0.6 ms per training step.


def np_view(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """A numpy view of `t` in dtype `ct`: no copy when `t` already has that dtype, whatever its
    strides (torch strides are never negative; numba takes any others)."""
    return (t if t.dtype == ct else t.to(ct)).detach().numpy()


def activation_array(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """A (batch, dim, L) activation as the kernels read it: C-contiguous, dtype `ct` (a copy
    when the model stores it otherwise, e.g. as a (batch, L, dim) tensor transposed)."""
    if t.dtype != ct or not t.is_contiguous():
        t = t.to(ct).contiguous()
    return t.detach().numpy()


def either_layout(t: torch.Tensor, ct: torch.dtype) -> tuple[np.ndarray, bool]:
    """A (batch, dim, L) activation as the kernels read it -> (array, time_major): the
    C-contiguous (batch, L, dim) array behind a transposed view (the model's layout, read in
    place), else `activation_array`'s C-contiguous (batch, dim, L) array."""
    t = as_dtype(t, ct)                    # .to() keeps a transposed layout
    if not t.is_contiguous() and t.transpose(1, 2).is_contiguous():
        return t.detach().transpose(1, 2).numpy(), True
    return activation_array(t, ct), False


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` (itself when it already is: .to() costs a torch call even then)."""
    return t if t.dtype == dtype else t.to(dtype)


def optional_array(t, ct, shape, convert=np_view):
    """Array for an optional input: `convert(t, ct)` (`np_view`, or `activation_array` for a (batch, dim,
    L) activation), or zeros / a dummy of `shape` when it is None."""
    if t is None:
        return np.zeros(shape, dtype=np.float64 if ct == torch.float64 else np.float32)
    return convert(t, ct)
