"""The fused numba CPU kernels behind `sonata.kernels`' `cpu` backend: the torch glue.

The kernels live by family, each file beside the others' shared maths:

    cpu_simd.py   lane widths (W, WC), compile flags, vectorizable exp / softplus / sigmoid,
                  the work queue
    cpu_scan.py   the selective scan, forward and hand-written backward (its docstring says
                  how the work is laid out; docs/kernels.md derives the backward)
    cpu_conv.py   the depthwise causal conv + SiLU and the gate's move into the scan's layout
                  (or the conv alone: Mamba-2's over x, B, C)
    cpu_norm.py   RMSNorm, and Mamba-2's gated, grouped RMSNorm
    cpu_loss.py   the cross-entropy loss

This module turns torch tensors into the arrays the kernels read (no copy when a tensor
already is one), allocates their outputs and partials, and is what `sonata.kernels` loads
as the backend: forward / backward, conv_silu_forward / _backward, causal_conv_silu_forward /
_backward, rms_norm_forward / _backward, rms_norm_gated_forward / _backward,
cross_entropy_forward / _backward. numba compiles each kernel on first use and
caches it on disk, keyed by every source of this folder (`numba_cache`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from sonata.kernels.cpu_conv import _conv_silu_backward_kernel, _conv_silu_forward_kernel, _sum_batch
from sonata.kernels.cpu_loss import _cross_entropy_backward_kernel, _cross_entropy_forward_kernel
from sonata.kernels.cpu_norm import (_rms_norm_backward_kernel, _rms_norm_forward_kernel,
                                     _rms_norm_gated_backward_kernel, _rms_norm_gated_forward_kernel)
from sonata.kernels.cpu_scan import _backward_kernel, _forward_kernel
from sonata.kernels.cpu_simd import W, for_workers, workers
from sonata.kernels.reference import compute_dtype

# Time steps between saved states. The backward's per-thread scratch is about
# 2 * CHUNK * N * W floats (states and decays of a block): 256 KiB at N = 16 and W = 16,
# 512 KiB at W = 32 (AVX-512 hosts; the one measured has 1 MiB of L2 per core), in L2.
# Longer chunks spread the per-chunk costs (copies in and out of the lane buffers).
CHUNK = 128
# Target number of (batch, group of channel blocks) work items in the backward; the dB / dC
# partials are (batch, n_groups, L, N) with n_groups <= ceil(WORK_ITEMS / batch).
WORK_ITEMS = 64


# --------------------------------------------------------------------------- torch glue

# The glue below runs once per kernel call, about 20 calls per training step: each torch call
# in it costs 1-2.5 us, so it takes the cheap path (no .to(), .contiguous() or transpose through
# torch) when the tensor already is what the kernels read. A set of the six kernel calls (scan,
# conv, RMSNorm, forward and backward) at the smallest size, where only the glue costs, went from
# 972 to 689 us with it (paired, 40 rounds): about 0.6 ms per training step.


def _np(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """A numpy view of `t` in dtype `ct`: no copy when `t` already has that dtype, whatever its
    strides (torch strides are never negative; numba takes any others)."""
    return (t if t.dtype == ct else t.to(ct)).detach().numpy()


def _activation(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """A (batch, dim, L) activation as the kernels read it: C-contiguous, dtype `ct` (a copy
    when the model stores it otherwise, e.g. as a (batch, L, dim) tensor transposed)."""
    if t.dtype != ct or not t.is_contiguous():
        t = t.to(ct).contiguous()
    return t.detach().numpy()


def _either_layout(t: torch.Tensor, ct: torch.dtype) -> tuple[np.ndarray, bool]:
    """A (batch, dim, L) activation as the kernels read it -> (array, time_major): the
    C-contiguous (batch, L, dim) array behind a transposed view (the model's layout, read in
    place), else `_activation`'s C-contiguous (batch, dim, L) array."""
    t = _as(t, ct)                    # .to() keeps a transposed layout
    if not t.is_contiguous() and t.transpose(1, 2).is_contiguous():
        return t.detach().transpose(1, 2).numpy(), True
    return _activation(t, ct), False


def _transposed(t: torch.Tensor, ct: torch.dtype) -> np.ndarray:
    """(batch, N, L) -> (batch, L, N) view: the kernels read B_t[n], C_t[n] for all n at each
    time step. A copy only when its dtype differs, or when n is not its innermost stride."""
    a = _np(t, ct).transpose(0, 2, 1)
    return a if a.strides[2] == a.itemsize else np.ascontiguousarray(a)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` (itself when it already is: .to() costs a torch call even then)."""
    return t if t.dtype == dtype else t.to(dtype)


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


def _optional(t, ct, shape, convert=_np):
    """Array for an optional input: `convert(t, ct)` (`_np`, or `_activation` for a (batch, dim,
    L) activation), or zeros / a dummy of `shape` when it is None."""
    if t is None:
        return np.zeros(shape, dtype=np.float64 if ct == torch.float64 else np.float32)
    return convert(t, ct)


def _n_groups(batch: int, dim: int) -> int:
    """Groups of W-channel blocks per sequence in the backward (shapes only, see WORK_ITEMS)."""
    return max(1, min(-(-dim // W), -(-WORK_ITEMS // max(batch, 1))))


def _delta_args(delta, delta_proj, ct):
    """(delta array, dt_proj weight array) for the kernels: delta as a (batch, dim, L) activation
    and a (1, 0) weight; or, with a delta projection, the low-rank (batch, L, R) input and the
    (dim, R) weight, both C-contiguous (like the plain case's arrays: the kernels compile once
    for both)."""
    if delta_proj is None:
        return _activation(delta, ct), np.zeros((1, 0), dtype=np.float64 if ct == torch.float64 else np.float32)
    return _activation(delta, ct), _activation(delta_proj, ct)   # C-contiguous: small copies


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
    return ScanInputs(*_either_layout(u, ct), *_delta_args(delta, delta_proj, ct), _np(A, ct), _transposed(B, ct),
                      _transposed(C, ct), _optional(D, ct, (dim,)), _optional(z, ct, (1, 1, 1), _activation),
                      _optional(delta_bias, ct, (dim,)), bool(delta_softplus), z is not None)


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
    h0 = _optional(initial_state, ct, (1, 1, 1), _activation)           # a placeholder when absent
    for_workers(_forward_kernel, n_workers)(*inputs, h0, initial_state is not None, chunk, n_workers,
                    out.numpy(), last_state.numpy(), ckpt.numpy())
    return _as(out, u.dtype).transpose(1, 2), last_state, (ckpt, _chunk_length(chunk))


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
    dout_args = (_optional(None, ct, (batch, dim, L)), False) if dout is None else _either_layout(dout, ct)
    inputs = _scan_inputs(u, delta, A, B, C, D, z, delta_bias, delta_softplus, delta_proj, ct)
    grads_out = dict(du=du.numpy(), ddelta=ddelta.numpy(), dz=dz.numpy(), dA=dA.numpy(), dB=dB.numpy(),
                     dC=dC.numpy(), dD=dD.numpy(), ddb=ddb.numpy(), dW=dW.numpy(),
                     dX=ddelta.numpy() if R else dW.numpy()[None],    # the projection's input gradient
                     dh0=dh0.numpy(), want_dh0=initial_state is not None)
    for_workers(_backward_kernel, n_workers)(*dout_args, _optional(dlast, ct, (batch, dim, N)), *inputs,
                     int(chunk), _np(ckpt, ct), _n_groups(batch, dim), n_workers, *grads_out.values())
    grads = (_as(du, u.dtype).transpose(1, 2), _as(ddelta, delta.dtype), _as(dA, A.dtype), _as(dB, B.dtype), _as(dC, C.dtype),
             None if D is None else _as(dD, D.dtype),
             None if z is None else _as(dz, z.dtype),
             None if delta_bias is None else _as(ddb, delta_bias.dtype))
    if delta_proj is not None:
        grads += (_as(dW, delta_proj.dtype),)
    return grads if initial_state is None else grads + (_as(dh0, initial_state.dtype),)


def conv_silu_forward(xz, weight, bias):
    """xz (batch, L, 2 dim), any strides (in_proj's output) -> (u, z), each (batch, dim, L) in
    xz's dtype: u = silu(depthwise causal conv of xz[..., :dim] + bias), a transposed view of a
    C-contiguous (batch, L, dim) tensor (x_proj and the scan read it in place); z =
    xz[..., dim:] moved into a C-contiguous (batch, dim, L) tensor. weight (dim, 1, K) or
    (dim, K); bias (dim,) or None."""
    n_workers = workers()
    ct = compute_dtype(xz.dtype)
    batch, L, dim = xz.shape[0], xz.shape[1], weight.shape[0]
    out = torch.empty((batch, L, dim), dtype=ct)
    zout = torch.empty((batch, dim, L), dtype=ct)
    for_workers(_conv_silu_forward_kernel, n_workers)(_np(xz[..., :dim], ct), _np(xz[..., dim:], ct),
                              _np(weight.reshape(dim, -1), ct), _optional(bias, ct, (dim,)), n_workers,
                              True, out.numpy(), zout.numpy())
    return _as(out, xz.dtype).transpose(1, 2), _as(zout, xz.dtype)


def conv_silu_backward(du, dz, xz, weight, bias):
    """du, dz (batch, dim, L) (du in either layout, see `forward`) -> (dxz (batch, L, 2 dim) in xz's dtype, dweight like weight, dbias
    like bias or None)."""
    n_workers = workers()
    ct = compute_dtype(xz.dtype)
    batch, L, dim = xz.shape[0], xz.shape[1], weight.shape[0]
    K = weight.shape[-1]
    dxz = torch.empty((batch, L, 2 * dim), dtype=ct)
    dw_part = torch.empty((batch, dim * K), dtype=ct)
    db_part = torch.empty((batch, dim), dtype=ct)
    for_workers(_conv_silu_backward_kernel, n_workers)(*_either_layout(du, ct), _activation(dz, ct), _np(xz[..., :dim], ct),
                               _np(weight.reshape(dim, K), ct), _optional(bias, ct, (dim,)), n_workers,
                               True, dxz[..., :dim].numpy(), dxz[..., dim:].numpy(),
                               dw_part.numpy().reshape(batch, dim, K), db_part.numpy())
    return (_as(dxz, xz.dtype), *_conv_param_grads(dw_part, db_part, weight, bias, ct))


def causal_conv_silu_forward(x, weight, bias, out_dtype=None):
    """x (batch, L, dim), any strides (Mamba-2's xBC slice of in_proj's output) -> silu(depthwise
    causal conv of x + bias), a C-contiguous (batch, L, dim) tensor in out_dtype (None: x's).
    The convolution of `conv_silu_forward` without the gate (any width)."""
    n_workers = workers()
    ct = compute_dtype(x.dtype)
    batch, L, dim = x.shape
    out = torch.empty((batch, L, dim), dtype=ct)
    xa = _np(x, ct)
    for_workers(_conv_silu_forward_kernel, n_workers)(xa, xa, _np(weight.reshape(dim, -1), ct), _optional(bias, ct, (dim,)),
                              n_workers, False, out.numpy(), np.empty((1, 1, 1), dtype=xa.dtype))
    return _as(out, out_dtype or x.dtype)


def causal_conv_silu_backward(dout, x, weight, bias):
    """dout (batch, L, dim) -> (dx (batch, L, dim) in x's dtype, dweight like weight, dbias like
    bias or None)."""
    n_workers = workers()
    ct = compute_dtype(x.dtype)
    batch, L, dim = x.shape
    K = weight.shape[-1]
    dx = torch.empty((batch, L, dim), dtype=ct)
    dw_part = torch.empty((batch, dim * K), dtype=ct)
    db_part = torch.empty((batch, dim), dtype=ct)
    dxa = dx.numpy()
    no_gate = np.empty((1, 1, 1), dtype=dxa.dtype)
    for_workers(_conv_silu_backward_kernel, n_workers)(*_either_layout(dout.transpose(1, 2), ct), no_gate,
                               _np(x, ct), _np(weight.reshape(dim, K), ct), _optional(bias, ct, (dim,)),
                               n_workers, False, dxa, dxa, dw_part.numpy().reshape(batch, dim, K),
                               db_part.numpy())
    return (_as(dx, x.dtype), *_conv_param_grads(dw_part, db_part, weight, bias, ct))


def _conv_param_grads(dw_part, db_part, weight, bias, ct):
    """The conv's weight and bias gradients from the kernels' per-sequence parts (summed here)."""
    dim, K = weight.shape[0], weight.shape[-1]
    dw = torch.empty(dim * K, dtype=ct)
    _sum_batch(dw_part.numpy(), dw.numpy())
    db = None
    if bias is not None:
        db = torch.empty(dim, dtype=ct)
        _sum_batch(db_part.numpy(), db.numpy())
        db = _as(db, bias.dtype)
    return _as(dw.reshape(weight.shape), weight.dtype), db


def rms_norm_gated_forward(x, weight, z, eps, group_size, norm_before_gate):
    """x (..., d), z like x or None, any strides -> (out like x, rstd (rows, d // group_size) in
    the compute dtype, saved for the backward). The semantics of `rms_norm_gated_ref` (no bias)."""
    ct = compute_dtype(x.dtype)
    d = x.shape[-1]
    x2 = _np(x.reshape(-1, d), ct)
    z2 = x2 if z is None else _np(z.reshape(-1, d), ct)
    out = torch.empty(x2.shape, dtype=ct)
    rstd = torch.empty((x2.shape[0], d // group_size), dtype=ct)
    _rms_norm_gated_forward_kernel(x2, z2, _np(weight, ct), float(eps), int(group_size), z is not None,
                                   bool(norm_before_gate), out.numpy(), rstd.numpy())
    return _as(out.reshape(x.shape), x.dtype), rstd


def rms_norm_gated_backward(dout, x, weight, z, rstd, group_size, norm_before_gate):
    """-> (dx like x, dweight like weight, dz like z or None)."""
    ct = compute_dtype(x.dtype)
    d = x.shape[-1]
    x2 = _np(x.reshape(-1, d), ct)
    z2 = x2 if z is None else _np(z.reshape(-1, d), ct)
    dx = torch.empty(x2.shape, dtype=ct)
    dz = torch.empty(x2.shape, dtype=ct) if z is not None else dx
    dw = torch.empty(d, dtype=ct)
    _rms_norm_gated_backward_kernel(_np(dout.reshape(-1, d), ct), x2, z2, _np(weight, ct), rstd.numpy(),
                                    int(group_size), z is not None, bool(norm_before_gate),
                                    dx.numpy(), dz.numpy(), dw.numpy())
    return (_as(dx.reshape(x.shape), x.dtype), _as(dw, weight.dtype),
            None if z is None else _as(dz.reshape(z.shape), z.dtype))


def rms_norm_forward(x, weight, eps):
    """x (..., d) -> (out like x, rstd (rows,) in the compute dtype, saved for the backward)."""
    ct = compute_dtype(x.dtype)
    x2 = _np(x.reshape(-1, x.shape[-1]), ct)
    out = torch.empty(x2.shape, dtype=ct)
    rstd = torch.empty(x2.shape[0], dtype=ct)
    _rms_norm_forward_kernel(x2, _np(weight, ct), float(eps), out.numpy(), rstd.numpy())
    return _as(out.reshape(x.shape), x.dtype), rstd


def rms_norm_backward(dout, x, weight, rstd):
    """-> (dx like x, dweight like weight)."""
    ct = compute_dtype(x.dtype)
    d = x.shape[-1]
    dx = torch.empty((rstd.shape[0], d), dtype=ct)
    dw = torch.empty(d, dtype=ct)
    _rms_norm_backward_kernel(_np(dout.reshape(-1, d), ct), _np(x.reshape(-1, d), ct),
                              _np(weight, ct), rstd.numpy(), dx.numpy(), dw.numpy())
    return _as(dx.reshape(x.shape), x.dtype), _as(dw, weight.dtype)


def cross_entropy_forward(logits, target):
    """logits (rows, V), target (rows,) integers in [0, V) -> (mean cross-entropy as a 0-d tensor
    in the logits' dtype, saved = (exponentials (rows, V), c (rows,), target) for the backward).
    float32 arithmetic for half logits; the row losses are summed in float64, in row order."""
    ct = compute_dtype(logits.dtype)
    n, V = logits.shape
    target = _as(target, torch.int64)
    t = target.detach().numpy()
    if n and (t.min() < 0 or t.max() >= V):
        raise IndexError(f"cross-entropy target out of range: targets must lie in [0, {V})")
    ex = torch.empty((n, V), dtype=ct)
    c = torch.empty(n, dtype=ct)
    loss_rows = np.empty(n, dtype=np.float64 if ct == torch.float64 else np.float32)
    n_workers = workers()
    for_workers(_cross_entropy_forward_kernel, n_workers)(_np(logits, ct), t, n_workers, loss_rows, ex.numpy(), c.numpy())
    loss = loss_rows.sum(dtype=np.float64) / n if n else math.nan
    return torch.tensor(loss, dtype=logits.dtype), (ex, c, target)


def cross_entropy_backward(dloss, saved, dtype):
    """The upstream gradient dloss (0-d) -> dlogits (rows, V) in `dtype`."""
    ex, c, target = saved
    dx = torch.empty(ex.shape, dtype=ex.dtype)
    n_workers = workers()
    for_workers(_cross_entropy_backward_kernel, n_workers)(
        ex.numpy(), c.numpy(), target.numpy(), ex.numpy().dtype.type(float(dloss)), n_workers, dx.numpy())
    return _as(dx, dtype)
