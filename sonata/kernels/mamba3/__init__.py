"""The Mamba-3 scan (mamba_ssm's released semantics, SISO and MIMO): one entry point, its
backends and the one-token step.

    mamba3_scan(q, k, x, dt, A, trap, angle, D=None, mimo_x=None, pairing="adjacent",
                state=None, chunk_size=64, backend="auto") -> y (b, L, R, h, p), final state
    mamba3_step(q, k, x, dt, A, trap, angle, D, mimo_x, pairing, state) -> y (b, R, h, p),
                the state updated in place

Shapes, meaning and the state's layout are `reference.py`'s (trap None: exponential Euler).
Backends:
  reference  the scan token by token (`mamba3_ref`: the float64 oracle)
  chunked    chunks of matrix products in PyTorch, any rank (`chunked.py`)
  cpu        SISO: the SSD kernel's fused numba backend (`ssd_form.py`); MIMO: `chunked`
  triton     SISO: the SSD kernel's Triton backend; MIMO: `chunked` (PyTorch ops, by design)
  auto       triton on CUDA, cpu on CPU
Which one runs is sonata.kernels.dispatch's rule (`MAMBA3` below); the SISO path passes the
request on to the SSD kernel, whose own resolution (and fallback record) applies.
The folder: reference.py, chunked.py, ssd_form.py.
"""
from __future__ import annotations

import torch

from sonata.kernels import dispatch
from sonata.kernels.mamba3.chunked import mamba3_chunked
from sonata.kernels.mamba3.reference import PAIRINGS, empty_state, mamba3_ref, ranked, rotate, step_ref
from sonata.kernels.mamba3.ssd_form import mamba3_siso_ssd

MAMBA3 = dispatch.Family("mamba3", "mamba3", cpu=None, triton=None, label="mamba3 ", extra=("chunked",),
                         dtypes=None)


def mamba3_scan(q, k, x, dt, A, trap, angle, D=None, mimo_x=None, pairing="adjacent", state=None,
                chunk_size=64, backend="auto"):
    """The Mamba-3 scan (module docstring)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {', '.join(PAIRINGS)}, not {pairing!r}")
    name, why = dispatch.resolve(MAMBA3, backend, x)
    if why is not None:
        dispatch.record_fallback(why)
    b, L, R, h, n = q.shape
    if L == 0:
        st = state if state is not None else empty_state(b, R, h, x.shape[-1], n, angle.shape[-1], x.device,
                                                         x.dtype)
        return x.new_zeros(b, 0, R, h, x.shape[-1]), st
    if name == "reference":
        trap = trap if trap is not None else torch.ones_like(dt)
        return mamba3_ref(q, k, x, dt, A, trap, angle, D, mimo_x, pairing, state)
    if name == "chunked" or R > 1:
        return mamba3_chunked(q, k, x, dt, A, trap, angle, D, mimo_x, pairing, state, chunk_size)
    ssd_backend = "auto" if backend == "auto" else name
    return mamba3_siso_ssd(q, k, x, dt, A, trap, angle, D, pairing, state, chunk_size, ssd_backend)


def mamba3_step(q, k, x, dt, A, trap, angle, D, mimo_x, pairing, state):
    """One token (q, k (b, R, h, n); x (b, h, p); dt, A, trap (b, h), trap None: Euler; angle
    (b, h, n_angles)) -> y (b, R, h, p); `state` (Theta, S, k_prev, x_prev) updated in place."""
    trap = trap if trap is not None else torch.ones_like(dt)
    y, new = step_ref(q, k, x, dt, A, trap, angle, D, mimo_x, pairing, state)
    for old, nw in zip(state, new):
        old.copy_(nw)
    return y


__all__ = ["MAMBA3", "PAIRINGS", "empty_state", "mamba3_chunked", "mamba3_ref", "mamba3_scan", "mamba3_siso_ssd",
           "mamba3_step", "ranked", "rotate", "step_ref"]
