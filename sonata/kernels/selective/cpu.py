"""sonata/kernels/selective/cpu.py: the Mamba-1 selective scan's `cpu` backend, the torch glue
in front of its numba kernels (selective/cpu_kernels.py: forward and hand-written backward, its
docstring says how the work is laid out; docs/kernels.md derives the backward).

It turns torch tensors into the arrays the kernels read (sonata/kernels/cpu_arrays.py), allocates
their outputs and partials, and is what `sonata.kernels.selective` loads as the backend: forward /
backward (the interface of selective/autograd.py). numba compiles each kernel on first use and
caches it on disk, keyed by every source of sonata/kernels (`numba_cache`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from sonata.kernels.cpu_arrays import activation_array, as_dtype, either_layout, np_view, optional_array
from sonata.kernels.cpu_simd import W, for_workers, workers
from sonata.kernels.dispatch import compute_dtype
from sonata.kernels.selective.cpu_kernels import scan_backward_kernel, scan_forward_kernel

# Time steps between saved states. The backward's per-thread scratch is about
# 2 * CHUNK * N * W floats (states and decays of a block): 256 KiB at N = 16 and W = 16,
# 512 KiB at W = 32 (AVX-512 hosts; the one measured has 1 MiB of L2 per core), in L2.
# Longer chunks spread the per-chunk costs (copies in and out of the lane buffers).
CHUNK = 128
# Target number of (batch, group of channel blocks) work items in the backward; the dB / dC
# partials are (batch, n_groups, L, N) with n_groups <= ceil(WORK_ITEMS / batch).
WORK_ITEMS = 64


def _transposed(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """(batch, N, L) -> (batch, L, N) view: the kernels read B_t[n], C_t[n] for all n at each
    time step. A copy only when its dtype differs, or when n is not its innermost stride."""
    a = np_view(t, ct).transpose(0, 2, 1)
    return a if a.strides[2] == a.itemsize else np.ascontiguousarray(a)


_chunk_lengths: dict[int, torch.Tensor] = {}


def _chunk_length(chunk: int) -> torch.Tensor:
    """The chunk length as a 0-d tensor (saved for the backward), made once per value, and
    never as an inference tensor: made first under torch.inference_mode (generation), it
    could not be saved for a backward later in the same process."""
    t = _chunk_lengths.get(chunk)
    if t is None:
        with torch.inference_mode(False):
            t = _chunk_lengths[chunk] = torch.tensor(chunk)
    return t


def _empty_like_layout(t: torch.Tensor, shape, ct: torch.dtype) -> torch.Tensor:
    """An empty (batch, X, L) tensor stored like `t`: as a (batch, L, X) tensor transposed when
    t's time steps are its outer stride, contiguous otherwise (dB, dC come out like B, C)."""
    if t is not None and t.dim() == 3 and t.stride(1) < t.stride(2):
        return torch.empty((shape[0], shape[2], shape[1]), dtype=ct).transpose(1, 2)
    return torch.empty(shape, dtype=ct)


def _n_groups(batch: int, dim: int) -> int:
    """Groups of W-channel blocks per sequence in the backward (shapes only, see WORK_ITEMS)."""
    return max(1, min(-(-dim // W), -(-WORK_ITEMS // max(batch, 1))))


def _delta_args(delta, delta_proj, ct):
    """(delta array, dt_proj weight array) for the kernels: delta as a (batch, dim, L) activation
    and a (1, 0) weight; or, with a delta projection, the low-rank (batch, L, R) input and the
    (dim, R) weight, both C-contiguous (like the plain case's arrays: the kernels compile once
    for both)."""
    if delta_proj is None:
        return activation_array(delta, ct), np.zeros((1, 0), dtype=np.float64 if ct == torch.float64 else np.float32)
    return activation_array(delta, ct), activation_array(delta_proj, ct)   # C-contiguous: small copies


class ScanInputs(NamedTuple):
    """The scan kernels' inputs, in their argument order (forward and backward take the same
    twelve). numba compiles one array type per argument, so an absent input (D, z,
    delta_bias, the delta projection) is a small placeholder array beside a flag or a size
    that says it is absent (has_z; dtw of width 0), never None."""
    u: np.ndarray            # (batch, dim, L), or the (batch, L, dim) array behind a transposed view
    u_tm: bool               # u is time-major
    delta: np.ndarray        # (batch, dim, L), or (batch, L, R): the delta projection's input
    dtw: np.ndarray          # (dim, R) delta projection weight; (1, 0) without one
    A: np.ndarray            # (dim, N)
    Bt: np.ndarray           # (batch, L, N) view of B
    Ct: np.ndarray           # (batch, L, N) view of C
    D: np.ndarray            # (dim,), zeros when absent
    z: np.ndarray            # (batch, dim, L), a (1, 1, 1) placeholder when absent
    delta_bias: np.ndarray   # (dim,), zeros when absent
    softplus: bool
    has_z: bool


def _scan_inputs(u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj, ct) -> ScanInputs:
    dim = u.shape[1]
    return ScanInputs(*either_layout(u, ct), *_delta_args(delta, delta_proj, ct), np_view(A, ct), _transposed(B, ct),
                      _transposed(C, ct), optional_array(D, ct, (dim,)), optional_array(z, ct, (1, 1, 1), activation_array),
                      optional_array(delta_bias, ct, (dim,)), bool(delta_softplus), z is not None)


def forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj=None, initial_state=None):
    """-> (out (batch, dim, L) in u's dtype, last_state (batch, dim, N) in the compute dtype,
    saved = (checkpoints (batch, dim, n_chunks, N), chunk length as a 0-d tensor)). u may come
    as a (batch, dim, L) tensor or as a transposed view of a (batch, L, dim) one (read in place);
    out is a transposed view of a C-contiguous (batch, L, dim) tensor: the projection after
    the scan reads it without a copy.
    With `delta_proj` (dim, R), `delta` is the (batch, L, R) input of the delta projection and
    the kernels use delta = (delta @ delta_proj.T).transpose(1, 2), computed block by block.
    `initial_state` (batch, dim, N): the state before the first step (zeros when None); the
    first checkpoint is that state, so the backward needs nothing more to recompute from it."""
    n_workers = workers()
    ct = compute_dtype(u.dtype)
    batch, dim, L = u.shape
    N = A.shape[1]
    chunk = CHUNK
    n_chunks = -(-L // chunk)
    out = torch.empty((batch, L, dim), dtype=ct)
    last_state = torch.empty((batch, dim, N), dtype=ct)
    ckpt = torch.empty((batch, dim, n_chunks, N), dtype=ct)
    inputs = _scan_inputs(u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj, ct)
    h0 = optional_array(initial_state, ct, (1, 1, 1), activation_array)           # a placeholder when absent
    for_workers(scan_forward_kernel, n_workers)(*inputs, h0, initial_state is not None, chunk, n_workers,
                    out.numpy(), last_state.numpy(), ckpt.numpy())
    return as_dtype(out, u.dtype).transpose(1, 2), last_state, (ckpt, _chunk_length(chunk))


def backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, saved, delta_proj=None,
             initial_state=None):
    """-> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias), each in its input's dtype
    (None for a None input among D, z, delta_bias); with `delta_proj`, ddelta is the gradient
    of the (batch, L, R) input and d delta_proj follows as a ninth gradient; with
    `initial_state`, its gradient follows last (the state the forward started from is the
    first saved checkpoint: the tensor itself is not read here). dout and u are
    read in either layout (see `forward`); du comes back as out does, a transposed view of a
    C-contiguous (batch, L, dim) tensor."""
    n_workers = workers()
    ckpt, chunk = saved
    ct = compute_dtype(u.dtype)
    batch, dim, L = u.shape
    N = A.shape[1]
    R = 0 if delta_proj is None else delta_proj.shape[1]
    du = torch.empty((batch, L, dim), dtype=ct)
    ddelta = torch.empty((batch, dim, L) if R == 0 else (batch, L, R), dtype=ct)
    dW = torch.empty((dim, R), dtype=ct)
    dz = torch.empty((batch, dim, L) if z is not None else (1, 1, 1), dtype=ct)
    dA = torch.empty((dim, N), dtype=ct)
    dB = _empty_like_layout(B, (batch, N, L), ct)
    dC = _empty_like_layout(C, (batch, N, L), ct)
    dD = torch.empty((dim,), dtype=ct)
    ddb = torch.empty((dim,), dtype=ct)
    dh0 = torch.empty((batch, dim, N) if initial_state is not None else (1, 1, 1), dtype=ct)
    # the output's gradient (zeros when only the last state has one) and the last state's
    dout_args = (optional_array(None, ct, (batch, dim, L)), False) if dout is None else either_layout(dout, ct)
    inputs = _scan_inputs(u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj, ct)
    grads_out = dict(du=du.numpy(), ddelta=ddelta.numpy(), dz=dz.numpy(), dA=dA.numpy(), dB=dB.numpy(),
                     dC=dC.numpy(), dD=dD.numpy(), ddb=ddb.numpy(), dW=dW.numpy(),
                     dX=ddelta.numpy() if R else dW.numpy()[None],    # the projection's input gradient
                     dh0=dh0.numpy(), want_dh0=initial_state is not None)
    for_workers(scan_backward_kernel, n_workers)(*dout_args, optional_array(dlast, ct, (batch, dim, N)), *inputs,
                     int(chunk), np_view(ckpt, ct), _n_groups(batch, dim), n_workers, *grads_out.values())
    grads = (as_dtype(du, u.dtype).transpose(1, 2), as_dtype(ddelta, delta.dtype), as_dtype(dA, A.dtype), as_dtype(dB, B.dtype), as_dtype(dC, C.dtype),
             None if D is None else as_dtype(dD, D.dtype),
             None if z is None else as_dtype(dz, z.dtype),
             None if delta_bias is None else as_dtype(ddb, delta_bias.dtype))
    if delta_proj is not None:
        grads += (as_dtype(dW, delta_proj.dtype),)
    return grads if initial_state is None else grads + (as_dtype(dh0, initial_state.dtype),)
