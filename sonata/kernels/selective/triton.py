"""sonata/kernels/selective/triton.py: the fused Triton kernels of the Mamba-1 selective scan:
forward and backward.

Semantics are exactly those of `selective_scan_ref` (selective/reference.py): the
recurrence h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t, y_t = C_t . h_t + D u_t, gated by
silu(z), written out with its backward in docs/kernels.md.

Layout and grid. Inputs are made contiguous: u, delta, z, out (batch, d_inner, L);
A (d_inner, N); B, C (batch, N, L). One program per (sequence, block of BLOCK_D
channels): grid (batch, cdiv(d_inner, BLOCK_D)). A program holds the state of its
channels as one (BLOCK_D, N_PAD) tile in registers (N_PAD = N rounded up to a
power of two) and walks time sequentially: the recurrence is sequential per
channel, so the parallelism is batch x channel blocks, and every step is a handful
of tile operations plus one reduction over N for y_t.

Masked lanes. Channels past d_inner and states past N are loaded as 0 and dt is
forced to 0 there *after* bias and softplus, so the lane's decay is exp(0 * 0) = 1
and its input dt * u * B = 0: a padded lane is the identity on a zero state and can
never produce NaN or Inf, whatever garbage the bias or softplus would give.

Forward. Time goes in chunks of CHUNK_L steps. At the start of each chunk the
program stores its state into a checkpoint tensor `ckpt` (batch, d_inner,
n_chunks, N): that, with the inputs, is all the backward needs. The full
(batch, d_inner, L, N) state tensor is never written anywhere.

Backward. The adjoint g_t = dLoss/dh_t runs the recurrence backwards (g_t = C_t dy_t +
a_{t+1} g_{t+1}, dy = dout * silu(z)) and every gradient is local in time from g_t,
h_{t-1} and h_t: the derivation and the formulas are written once, in docs/kernels.md
("The scan and its backward, derived").

The program visits the chunks from last to first. For each chunk it reloads the
checkpoint, recomputes the chunk's states forward and writes h_{t-1} for each of
its steps into `scratch` (batch, d_inner, min(CHUNK_L, L), N) -- one chunk's worth
per channel, reused by every chunk, so its size is bounded by CHUNK_L, not L --
then walks the chunk backwards, reading h_{t-1} back and recomputing a_t and h_t in
registers. A barrier separates the two phases (a thread may read what another
thread of the program wrote). CHUNK_L ~ sqrt(L) balances checkpoint and scratch
memory, each about sqrt(L) times smaller than the full state tensor.

Determinism. No atomics. dB and dC are reduced over the program's own channels
inside the program (a fixed-order tile reduction) into per-program partials
(batch, n_dblocks, L, N); dA, dD and ddelta_bias go to per-(batch, channel)
partials. torch then sums the partials over the block and batch axes in a fixed
order. The same inputs give bit-identical gradients.

Precision. Every load is converted to the accumulation dtype ACC before any
arithmetic: float32 for float16 / bfloat16 / float32 inputs, float64 for float64
inputs (so `torch.autograd.gradcheck` runs through this backward). `out` and the
gradients are stored in their tensor's dtype; the last state is ACC.

CPU tensors run under the Triton interpreter, which needs TRITON_INTERPRET=1 in the
environment before `triton` and this module are first imported (both decorate
their jit functions at import). There per-op overhead dominates, so the channel
block is as wide as allowed and the small helpers run as plain Python (`_helper`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from sonata.kernels.dispatch import compute_dtype

# Tests set this to fill every output and partial with NaN before the kernels
# run, so an element a kernel forgets to write cannot pass a comparison.
POISON_OUTPUTS = False


# --------------------------------------------------------------------------- jit helpers

def _helper(fn):
    """`triton.jit` for a device function -- except under the interpreter.

    The interpreter re-patches all of `triton.language` on every device-function
    call (about half the run time of these kernels). There the helpers run as plain
    Python inside the interpreted kernel, which executes the same tl operations.
    """
    return fn if triton.knobs.runtime.interpret else triton.jit(fn)


@_helper
def _load(PTR, offs, mask, ACC: tl.constexpr):
    """Masked load converted to the accumulation dtype (0 on masked lanes)."""
    return tl.load(PTR + offs, mask=mask, other=0.0).to(ACC)


@_helper
def _sigmoid(x):
    """1 / (1 + exp(-x)) without overflow in either tail."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@_helper
def _softplus(x):
    """log1p(exp(x)), or x above 20 (torch's threshold); log1p by Kahan's trick (tiny exp(x))."""
    e = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + e
    lp = tl.where(w == 1.0, e, tl.log(w) * (e / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.where(x > 20.0, x, lp)


@_helper
def _dsoftplus(x):
    """d softplus / dx: sigmoid(x), or 1 above 20 (torch's convention)."""
    return tl.where(x > 20.0, 1.0, _sigmoid(x))


@_helper
def _load_dt(DELTA, offs, mask, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
             ACC: tl.constexpr):
    """(raw, dt) for one step: raw = delta + bias, dt = softplus(raw); dt = 0 on masked lanes."""
    raw = _load(DELTA, offs, mask, ACC)
    if HAS_BIAS:
        raw = raw + bias
    if SOFTPLUS:
        dt = _softplus(raw)
    else:
        dt = raw
    return raw, tl.where(mask, dt, 0.0)


@_helper
def _step(h, A, dt, u, Bt):
    """One step of the recurrence: (a_t, h_t) from h_{t-1}, tiles (BLOCK_D, N_PAD); Bt (1, N_PAD)."""
    a = tl.exp(dt[:, None] * A)
    return a, a * h + (dt * u)[:, None] * Bt


# --------------------------------------------------------------------------- kernels

@triton.jit
def _scan_fwd_kernel(
    U, DELTA, A, B, C, D, Z, DELTA_BIAS, H0,      # inputs
    OUT, LAST, CKPT,                              # outputs
    d_inner, L, N, n_chunks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_L: tl.constexpr, ACC: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)                  # (BLOCK_D,)
    offs_n = tl.arange(0, N_PAD)                                      # (N_PAD,)
    mask_d = offs_d < d_inner
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]

    A_t = _load(A, offs_d[:, None] * N + offs_n[None, :], mask_dn, ACC)   # (BLOCK_D, N_PAD)
    if HAS_D:
        Dv = _load(D, offs_d, mask_d, ACC)
    if HAS_BIAS:
        bias = _load(DELTA_BIAS, offs_d, mask_d, ACC)
    else:
        bias = tl.zeros([BLOCK_D], dtype=ACC)

    row = (pid_b * d_inner + offs_d) * L                              # x[b, d, 0]
    # B and C are read as (1, N_PAD) rows in the tile's own layout: no layout shuffles
    col = pid_b * N * L + offs_n[None, :] * L                         # B[b, n, 0]
    state = (pid_b * d_inner + offs_d)[:, None] * N + offs_n[None, :]  # LAST[b, d, n]
    ckpt = (pid_b * d_inner + offs_d)[:, None] * (n_chunks * N) + offs_n[None, :]

    if HAS_H0:
        h = _load(H0, state, mask_dn, ACC)                            # the state before step 0
    else:
        h = tl.zeros((BLOCK_D, N_PAD), dtype=ACC)
    for c in range(0, n_chunks):
        tl.store(CKPT + ckpt + c * N, h, mask=mask_dn)                # state entering chunk c
        t0 = c * CHUNK_L
        t1 = tl.minimum(t0 + CHUNK_L, L)
        for t in range(t0, t1):
            u = _load(U, row + t, mask_d, ACC)
            raw, dt = _load_dt(DELTA, row + t, mask_d, bias, HAS_BIAS, SOFTPLUS, ACC)
            Bt = _load(B, col + t, mask_n[None, :], ACC)
            Ct = _load(C, col + t, mask_n[None, :], ACC)
            a, h = _step(h, A_t, dt, u, Bt)
            y = tl.sum(h * Ct, axis=1)                                  # (BLOCK_D,)
            if HAS_D:
                y += Dv * u
            if HAS_Z:
                zt = _load(Z, row + t, mask_d, ACC)
                y = y * (zt * _sigmoid(zt))
            tl.store(OUT + row + t, y.to(OUT.dtype.element_ty), mask=mask_d)
    tl.store(LAST + state, h, mask=mask_dn)


@triton.jit
def _scan_bwd_kernel(
    U, DELTA, A, B, C, D, Z, DELTA_BIAS, DOUT, DLAST, CKPT,          # inputs
    SCRATCH,                                                          # (batch, d_inner, s_len, N)
    DU, DDELTA, DZ,                                                   # gradients, input layout
    DA_PART, DB_PART, DC_PART, DD_PART, DBIAS_PART,                   # partials, summed by torch
    DH0,                                                              # the initial state's gradient
    d_inner, L, N, n_chunks, n_dblocks, s_len,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_DOUT: tl.constexpr, HAS_DLAST: tl.constexpr, HAS_H0: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_L: tl.constexpr, ACC: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, N_PAD)
    mask_d = offs_d < d_inner
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]

    A_t = _load(A, offs_d[:, None] * N + offs_n[None, :], mask_dn, ACC)
    if HAS_D:
        Dv = _load(D, offs_d, mask_d, ACC)
    if HAS_BIAS:
        bias = _load(DELTA_BIAS, offs_d, mask_d, ACC)
    else:
        bias = tl.zeros([BLOCK_D], dtype=ACC)

    row = (pid_b * d_inner + offs_d) * L
    col = pid_b * N * L + offs_n[None, :] * L
    state = (pid_b * d_inner + offs_d)[:, None] * N + offs_n[None, :]
    ckpt = (pid_b * d_inner + offs_d)[:, None] * (n_chunks * N) + offs_n[None, :]
    scratch = (pid_b * d_inner + offs_d)[:, None] * (s_len * N) + offs_n[None, :]
    part = (pid_b * n_dblocks + pid_d) * L * N + offs_n[None, :]     # DB_PART[b, blk, 0, n]

    if HAS_DLAST:
        g = _load(DLAST, state, mask_dn, ACC)     # a_{t+1} * g_{t+1}, carried backwards
    else:
        g = tl.zeros((BLOCK_D, N_PAD), dtype=ACC)
    dA_acc = tl.zeros((BLOCK_D, N_PAD), dtype=ACC)
    dD_acc = tl.zeros([BLOCK_D], dtype=ACC)
    dbias_acc = tl.zeros([BLOCK_D], dtype=ACC)

    for ci in range(0, n_chunks):
        c = n_chunks - 1 - ci
        t0 = c * CHUNK_L
        t1 = tl.minimum(t0 + CHUNK_L, L)

        # 1) recompute the chunk's states from its checkpoint; keep h_{t-1} per step
        h = _load(CKPT, ckpt + c * N, mask_dn, ACC)
        for t in range(t0, t1):
            tl.store(SCRATCH + scratch + (t - t0) * N, h, mask=mask_dn)
            u = _load(U, row + t, mask_d, ACC)
            raw, dt = _load_dt(DELTA, row + t, mask_d, bias, HAS_BIAS, SOFTPLUS, ACC)
            Bt = _load(B, col + t, mask_n[None, :], ACC)
            a, h = _step(h, A_t, dt, u, Bt)
        tl.debug_barrier()

        # 2) reverse scan over the chunk
        for i in range(0, t1 - t0):
            t = t1 - 1 - i
            h_prev = _load(SCRATCH, scratch + (t - t0) * N, mask_dn, ACC)
            u = _load(U, row + t, mask_d, ACC)
            raw, dt = _load_dt(DELTA, row + t, mask_d, bias, HAS_BIAS, SOFTPLUS, ACC)
            Bt = _load(B, col + t, mask_n[None, :], ACC)
            Ct = _load(C, col + t, mask_n[None, :], ACC)
            a, h = _step(h_prev, A_t, dt, u, Bt)
            if HAS_DOUT:
                dy = _load(DOUT, row + t, mask_d, ACC)
            else:
                dy = tl.zeros([BLOCK_D], dtype=ACC)
            if HAS_Z:
                zt = _load(Z, row + t, mask_d, ACC)
                s = _sigmoid(zt)
                y = tl.sum(h * Ct, axis=1)
                if HAS_D:
                    y += Dv * u
                dz = dy * y * s * (1.0 + zt * (1.0 - s))                # d silu(z)/dz
                tl.store(DZ + row + t, dz.to(DZ.dtype.element_ty), mask=mask_d)
                dy = dy * zt * s
            g = g + dy[:, None] * Ct                                    # g_t
            dC_t = tl.sum(dy[:, None] * h, axis=0, keep_dims=True)       # (1, N_PAD)
            dB_t = tl.sum(g * (dt * u)[:, None], axis=0, keep_dims=True)
            tl.store(DC_PART + part + t * N, dC_t, mask=mask_n[None, :])
            tl.store(DB_PART + part + t * N, dB_t, mask=mask_n[None, :])
            gB = tl.sum(g * Bt, axis=1)                                 # (BLOCK_D,)
            q = g * a * h_prev
            dA_acc += q * dt[:, None]
            du = gB * dt
            if HAS_D:
                du += Dv * dy
                dD_acc += dy * u
            ddt = tl.sum(q * A_t, axis=1) + gB * u
            if SOFTPLUS:
                ddt = ddt * _dsoftplus(raw)
            ddt = tl.where(mask_d, ddt, 0.0)
            dbias_acc += ddt
            tl.store(DU + row + t, du.to(DU.dtype.element_ty), mask=mask_d)
            tl.store(DDELTA + row + t, ddt.to(DDELTA.dtype.element_ty), mask=mask_d)
            g = g * a                                                   # a_t * g_t, for step t-1
        tl.debug_barrier()   # the next chunk overwrites the scratch

    tl.store(DA_PART + state, dA_acc, mask=mask_dn)
    if HAS_H0:                                    # g = a_0 g_0 = dLoss/dh_{-1}
        tl.store(DH0 + state, g, mask=mask_dn)
    if HAS_D:
        tl.store(DD_PART + pid_b * d_inner + offs_d, dD_acc, mask=mask_d)
    if HAS_BIAS:
        tl.store(DBIAS_PART + pid_b * d_inner + offs_d, dbias_acc, mask=mask_d)


# --------------------------------------------------------------------------- launch configuration

@dataclass(frozen=True)
class LaunchConfig:
    block_d: int     # channels per program
    n_pad: int       # N rounded up to a power of two
    chunk_l: int     # time steps between checkpoints
    num_warps: int


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_config(batch: int, d_inner: int, N: int, L: int, device: torch.device,
                  block_d: int | None = None, chunk_l: int | None = None) -> LaunchConfig:
    """Tile sizes from the shapes alone (so forward and backward agree), with optional overrides.

    CHUNK_L is the smallest power of two >= sqrt(L), clamped to [16, 256]: checkpoints
    cost L / CHUNK_L states per channel and the backward scratch CHUNK_L. On a GPU,
    BLOCK_D is the widest block that still gives about two programs per SM (the work is
    latency-bound, so occupancy matters more than tile width); the tile is capped at
    1024 elements, about 4 per thread, which keeps the backward in registers on sm_90
    (checked with ptxas: at most a few bytes of stack). Under the interpreter per-op
    overhead dominates, so the block is as wide as allowed.
    """
    n_pad = triton.next_power_of_2(max(N, 1))
    if chunk_l is None:
        chunk_l = min(256, max(16, triton.next_power_of_2(math.isqrt(max(L - 1, 0)) + 1)))
    if chunk_l < 1 or chunk_l & (chunk_l - 1):
        raise ValueError(f"chunk_l must be a power of two, got {chunk_l}")
    max_block = max(1, 1024 // n_pad)
    if block_d is None:
        if device.type == "cuda":
            target = 2 * _sm_count(device.index if device.index is not None
                                   else torch.cuda.current_device())
            block_d = 4
            for cand in (64, 32, 16, 8):
                if cand <= max_block and batch * triton.cdiv(d_inner, cand) >= target:
                    block_d = cand
                    break
            block_d = min(block_d, max_block, triton.next_power_of_2(max(d_inner, 1)))
        else:
            block_d = min(256, max(1, 8192 // n_pad), triton.next_power_of_2(max(d_inner, 1)))
    if block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"block_d must be a power of two, got {block_d}")
    tile = block_d * n_pad
    num_warps = min(8, max(1, tile // 128))                # about 4 tile elements per thread
    return LaunchConfig(block_d, n_pad, chunk_l, num_warps)


# --------------------------------------------------------------------------- torch entry points

def _new(shape, dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _contig(t):
    return None if t is None else t.contiguous()


def _tl_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, *, initial_state=None, block_d=None,
            chunk_l=None):
    """out (batch, d_inner, L) in u's dtype, last_state (batch, d_inner, N), saved = (ckpt,).
    `initial_state` (batch, d_inner, N): the state before the first step (zeros when None); it
    is the first checkpoint, so the backward recomputes from it like from any other."""
    batch, d_inner, L = u.shape
    N = A.shape[1]
    acc = compute_dtype(u.dtype)
    cfg = launch_config(batch, d_inner, N, L, u.device, block_d, chunk_l)
    n_chunks = triton.cdiv(L, cfg.chunk_l)
    u, delta, A, B, C, D, z, delta_bias = map(_contig, (u, delta, A, B, C, D, z, delta_bias))
    h0 = None if initial_state is None else initial_state.to(acc).contiguous()

    out = _new((batch, d_inner, L), u.dtype, u.device)
    last = _new((batch, d_inner, N), acc, u.device)
    ckpt = _new((batch, d_inner, n_chunks, N), acc, u.device)       # state entering each chunk
    if batch * d_inner == 0:
        return out, last.zero_(), (ckpt,)
    grid = (batch, triton.cdiv(d_inner, cfg.block_d))
    _scan_fwd_kernel[grid](
        u, delta, A, B, C,
        D if D is not None else u, z if z is not None else u,
        delta_bias if delta_bias is not None else u, h0 if h0 is not None else u,
        out, last, ckpt,
        d_inner, L, N, n_chunks,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=bool(delta_softplus), HAS_H0=h0 is not None,
        BLOCK_D=cfg.block_d, N_PAD=cfg.n_pad, CHUNK_L=cfg.chunk_l, ACC=_tl_dtype(acc),
        num_warps=cfg.num_warps,
    )
    return out, last, (ckpt,)


def backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, saved, *,
             initial_state=None, block_d=None, chunk_l=None):
    """(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias) in their inputs' dtypes (None if absent);
    with `initial_state` (only its presence and dtype are read), its gradient follows."""
    (ckpt,) = saved
    batch, d_inner, L = u.shape
    N = A.shape[1]
    acc = compute_dtype(u.dtype)
    cfg = launch_config(batch, d_inner, N, L, u.device, block_d, chunk_l)
    n_chunks = triton.cdiv(L, cfg.chunk_l)
    if ckpt.shape != (batch, d_inner, n_chunks, N):
        raise ValueError(f"checkpoints of shape {tuple(ckpt.shape)} do not match "
                         f"chunk_l={cfg.chunk_l}")
    n_dblocks = triton.cdiv(d_inner, cfg.block_d)
    u, delta, A, B, C, D, z, delta_bias, dout, dlast = map(
        _contig, (u, delta, A, B, C, D, z, delta_bias, dout, dlast))
    dev = u.device

    du = _new(u.shape, u.dtype, dev)
    ddelta = _new(delta.shape, delta.dtype, dev)
    dz = _new(z.shape, z.dtype, dev) if z is not None else None
    s_len = min(cfg.chunk_l, max(L, 1))                               # steps of one chunk
    scratch = _new((batch, d_inner, s_len, N), acc, dev)
    dA_part = _new((batch, d_inner, N), acc, dev)
    dB_part = _new((batch, n_dblocks, L, N), acc, dev)
    dC_part = _new((batch, n_dblocks, L, N), acc, dev)
    dD_part = _new((batch, d_inner), acc, dev) if D is not None else None
    dbias_part = _new((batch, d_inner), acc, dev) if delta_bias is not None else None
    dh0 = _new((batch, d_inner, N), acc, dev) if initial_state is not None else None

    if batch * d_inner > 0:
        grid = (batch, n_dblocks)
        _scan_bwd_kernel[grid](
            u, delta, A, B, C,
            D if D is not None else u, z if z is not None else u,
            delta_bias if delta_bias is not None else u,
            dout if dout is not None else u, dlast if dlast is not None else u, ckpt,
            scratch,
            du, ddelta, dz if dz is not None else du,
            dA_part, dB_part, dC_part,
            dD_part if dD_part is not None else dA_part,
            dbias_part if dbias_part is not None else dA_part,
            dh0 if dh0 is not None else dA_part,
            d_inner, L, N, n_chunks, n_dblocks, s_len,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            SOFTPLUS=bool(delta_softplus), HAS_DOUT=dout is not None, HAS_DLAST=dlast is not None,
            HAS_H0=dh0 is not None,
            BLOCK_D=cfg.block_d, N_PAD=cfg.n_pad, CHUNK_L=cfg.chunk_l, ACC=_tl_dtype(acc),
            num_warps=cfg.num_warps,
        )
    else:  # nothing to launch: every gradient is an empty or zero sum
        for t in (dA_part, dB_part, dC_part, dD_part, dbias_part, dh0):
            if t is not None:
                t.zero_()

    # Fixed-order reductions of the per-program partials: deterministic.
    dA = dA_part.sum(0).to(A.dtype)                                   # (d_inner, N)
    dB = dB_part.sum(1).transpose(1, 2).to(B.dtype).contiguous()    # (batch, N, L)
    dC = dC_part.sum(1).transpose(1, 2).to(C.dtype).contiguous()
    dD = dD_part.sum(0).to(D.dtype) if D is not None else None
    ddelta_bias = dbias_part.sum(0).to(delta_bias.dtype) if delta_bias is not None else None
    grads = (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)
    if dh0 is None:
        return grads
    return grads + (dh0.to(initial_state.dtype),)


# Whether these kernels run in Triton's CPU interpreter: fixed when triton was
# imported (TRITON_INTERPRET=1 then), not by the environment at call time.
INTERPRETED = type(_scan_fwd_kernel).__name__ == "InterpretedFunction"
