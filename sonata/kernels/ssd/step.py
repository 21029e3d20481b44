"""One recurrent step of the SSD (Mamba-2) state: the decoding update, mamba_ssm's per-head
`selective_state_update`, with the state updated in place.

    state (b, h, p, n)   x, z (b, h, p)   dt (b, h)   A (h,)   B, C (b, g, n)   D (h,) | (h, p)
    dt    <- dt + dt_bias;  softplus(dt) (identity above 20) if dt_softplus;  clamp to dt_limit
    state <- exp(dt A) state + dt x B^T                      (head i reads group i // (h // g))
    y      = state C + D x;   y *= silu(z)                    -> (b, h, p) in x's dtype

`ssd_step_ref` is that in torch ops (any dtype and device; arithmetic in the state's dtype,
at least float32). `ssd_step` runs one fused numba pass over the state on CPU (decay, add,
contract with C, write back: the state is read and written once) for a float32 contiguous
state when no input asks for a gradient, and the reference otherwise. Measured at batch 1 on
a 2-core AVX2 host, one thread (benchmarks/ssd.py, table 2): 50 us against 182 us for the
torch ops at the seed's size (12 heads of 16, N 16), where dispatch dominates, and 119 us
against 884 us at mamba2-130m's layer (24 heads of 64, N 128), where the passes over the
state do (transformers' torch step: 151 and 1813 us).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sonata.kernels.dispatch import opaque

POISON = False      # tests: fill the preallocated output with NaN first


def _dt(dt, dt_bias, softplus, limit):
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    lo, hi = limit
    return dt.clamp(min=lo, max=hi) if (lo > 0.0 or hi < math.inf) else dt


def check_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None):
    """ValueError naming the first argument whose shape does not fit."""
    if state.dim() != 4:
        raise ValueError(f"ssd_step: state must be (batch, heads, headdim, dstate), got {tuple(state.shape)}")
    b, h, p, n = state.shape
    want = {"x": (x, (b, h, p)), "dt": (dt, (b, h)), "A": (A, (h,)), "z": (z, (b, h, p)),
            "dt_bias": (dt_bias, (h,))}
    for name, (t, shape) in want.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"ssd_step: {name} must be {shape} for state {tuple(state.shape)}, "
                             f"got {tuple(t.shape)}")
    for name, t in (("B", B), ("C", C)):
        if t.dim() != 3 or t.shape[0] != b or t.shape[2] != n or h % t.shape[1]:
            raise ValueError(f"ssd_step: {name} must be (batch, groups, dstate) = ({b}, g, {n}) with "
                             f"{h} heads a multiple of g, got {tuple(t.shape)}")
    if B.shape != C.shape:
        raise ValueError(f"ssd_step: B {tuple(B.shape)} and C {tuple(C.shape)} differ")
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise ValueError(f"ssd_step: D must be ({h},) or ({h}, {p}), got {tuple(D.shape)}")


def ssd_step_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                 dt_limit=(0.0, math.inf)):
    """The step in torch ops; `state` is updated in place."""
    ct = torch.float64 if state.dtype == torch.float64 else torch.float32
    h, g = state.shape[1], B.shape[1]
    dtc = _dt(dt.to(ct), None if dt_bias is None else dt_bias.to(ct), dt_softplus, dt_limit)
    Bh = B.to(ct).repeat_interleave(h // g, dim=1)                        # (b, h, n)
    Ch = C.to(ct).repeat_interleave(h // g, dim=1)
    xc = x.to(ct)
    decay = torch.exp(dtc * A.to(ct))[..., None, None]                    # (b, h, 1, 1)
    new = state.to(ct) * decay + (dtc[..., None] * xc)[..., None] * Bh[:, :, None, :]
    state.copy_(new)
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        Dc = D.to(ct)
        y = y + xc * (Dc[:, None] if Dc.dim() == 1 else Dc)
    if z is not None:
        y = y * F.silu(z.to(ct))
    return y.to(x.dtype)


try:
    import numpy as np
    from numba import njit

    from sonata.kernels import numba_cache

    numba_cache.install()

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz"})
    def _step_kernel(state, x, dt, A, B, C, D, z, bias, softplus, lo, hi, clamp, y):
        b, h, p, n = state.shape
        hg = h // B.shape[1]
        pd = D.shape[1]
        for bi in range(b):
            for hi_ in range(h):
                v = dt[bi, hi_]
                if bias.shape[0] > 0:
                    v += bias[hi_]
                if softplus and v <= 20.0:
                    v = np.log1p(np.exp(v))
                if clamp:
                    v = min(max(v, lo), hi)
                decay = np.exp(v * A[hi_])
                Bg, Cg = B[bi, hi_ // hg], C[bi, hi_ // hg]
                for pi in range(p):
                    xv = x[bi, hi_, pi]
                    dx = v * xv
                    row = state[bi, hi_, pi]
                    acc = np.float32(0.0)
                    for ni in range(n):
                        s = row[ni] * decay + dx * Bg[ni]
                        row[ni] = s
                        acc += s * Cg[ni]
                    if D.shape[0] > 0:
                        acc += D[hi_, pi if pd > 1 else 0] * xv
                    if z.shape[0] > 0:
                        zv = z[bi, hi_, pi]
                        acc *= zv / (1.0 + np.exp(-zv))
                    y[bi, hi_, pi] = acc
except ImportError:         # no numba: the torch step everywhere
    _step_kernel = None


def _f32(t):
    """A float32 C-contiguous numpy view (a copy only when t is not one already)."""
    t = t.detach()
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(torch.float32).contiguous()
    return t.numpy()


@opaque
def ssd_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, math.inf)):
    """The step (module docstring); `state` is updated in place, y (b, h, p) returned."""
    check_step(state, x, dt, A, B, C, D, z, dt_bias)
    tensors = (state, x, dt, A, B, C, D, z, dt_bias)
    fused = (_step_kernel is not None and state.device.type == "cpu" and state.dtype == torch.float32
             and state.is_contiguous()
             and (not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors)))
    if not fused:
        return ssd_step_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    empty1, empty2 = np.empty(0, np.float32), np.empty((0, 1), np.float32)
    y = np.empty(tuple(x.shape), np.float32)
    if POISON:
        y.fill(np.nan)
    Dn = empty2 if D is None else _f32(D.reshape(D.shape[0], -1))
    _step_kernel(state.numpy(), _f32(x), _f32(dt), _f32(A), _f32(B), _f32(C), Dn,
                 np.empty((0, 0, 0), np.float32) if z is None else _f32(z),
                 empty1 if dt_bias is None else _f32(dt_bias), bool(dt_softplus), lo, hi,
                 lo > 0.0 or hi < math.inf, y)
    return torch.from_numpy(y).to(x.dtype)
