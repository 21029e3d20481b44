"""Fused Triton kernels for the state-space dual (SSD, Mamba-2): forward and backward.

STATUS: these kernels have been checked only under Triton's CPU interpreter
(TRITON_INTERPRET=1, tests/kernels/test_ssd_triton.py); they have NOT run on a GPU yet
("ssd" is not in sonata.kernels.GPU_VERIFIED, and `auto` says so once per process when it
picks them for CUDA tensors; docs/kernels.md's table; benchmarks/gpu_check.sh runs the test
file compiled on a GPU). They were compiled ahead of time for sm_90 without a GPU (Triton 3.9
and its bundled ptxas: every kernel builds, fp32/bf16 and fp64), never launched: results on
a GPU, speed and occupancy are unverified. ptxas reports register spills at Mamba-2 sizes
(p 64, n 128), worst in the backward chunk kernel, which holds a whole head; nothing here is
tuned. (That compile predates the log-decay gradient's direct sums below.)

Semantics are those of `ssd_recurrent_ref` (sonata/kernels/ssd/reference.py), with
mamba_ssm's `mamba_chunk_scan_combined` shapes: x (b, l, h, p), dt (b, l, h), A (h,),
B, C (b, l, g, n), head i reading group i // (h // g). Written from the chunked algorithm
of the Mamba-2 paper (section 6), the same four steps as `ssd_chunked_ref`.

Algorithm. Time is cut into chunks of Q = min(chunk_size, chunk_cap(n)) steps. The
result does not depend on the chunking (only the rounding does) and a program holds a
whole chunk, so longer chunks (mamba_ssm's default is 256) run as shorter ones: 64 steps,
fewer for wide states (Q * n <= 4096: 32 for n = 128). At Q = 256 ptxas spilled tens of
kilobytes and the chunk-scan kernel had not compiled after 15 minutes.
With a_t = dt_t A the log-decay of step t, inside a chunk:
  1. `dt_kernel`: dt (bias, softplus, clamp) and the whole chunk's decay G_c = exp(sum a);
  2. `chunk_state_kernel`: the chunk's own state, B^T (decay-to-end * dt * x), one dot;
  3. `state_pass_kernel`: S_{c+1} = G_c S_c + state_c from the initial state, sequential
     over the chunks (short: L / Q steps); S_c, the state each chunk starts from, is stored;
  4. `chunk_scan_kernel`: y = ((C B^T) o decay) (dt x) + decay-from-start * (C S_c^T) + D x,
     then out = y * silu(z): three dots per (chunk, head, channel block).
Backward, the same in reverse: `dstate_kernel` (what each chunk's outputs ask of S_c),
`state_pass_bwd_kernel` (the reverse recurrence dS_c = G_c dS_{c+1} + E_c from dfinal,
giving d initial_states and dG), `chunk_bwd_kernel` (every gradient local to a chunk).
The log-decay gradient: every exponent is a sum of a over a range of the chunk, so da_k
collects the terms whose range holds step k, each family summed directly: the (Q, Q)
segments [i, j] with j < k <= i (a reverse cumulative sum down the columns, then a masked
row sum), the decays from the chunk's start (i >= k), those to its end (j < k), and the
whole chunk's G; then ddt += A da, dA = sum dt da. Not as d/d prefix-sum turned into da by
one reverse cumulative sum: that subtracts long sums which cancel (the diagonal's row and
column sums, a total minus its tail), and left float32 dA and ddt_bias 6-33x further from
the float64 oracle than the CPU recurrence on three of the tests' shapes (geometric mean over
six seeds; now 0.7-2.1x, and tests/kernels/test_ssd_triton.py holds it under 3x).

Grid and layout. Inputs are made contiguous in their own layouts, nothing is transposed
in torch. Chunk kernels run one program per (batch, chunk, head x channel block):
grid (b, n_chunks, h * cdiv(p, BLOCK_P)); the two state passes per (batch, head, channel
block); the backward chunk kernel holds all p channels of a head (it sums over them).
Intermediates, all in the accumulation dtype ACC: dt (b, h, l), G (b, h, n_chunks),
states, chunk start states and their gradients (b, n_chunks, h, p, n), y before the gate
(b, l, h, p, only with z). The saved tensors are the start states (one per chunk, never a
per-step state) plus dt, G and y.

Masks and padding. Tiles are powers of two: BLOCK_Q >= chunk, P and N padded to >= 16
(tl.dot needs every dimension >= 16). Lanes past the chunk, past L, past p or past n
load 0 (dt = 0 there: decay 1, input 0, so padding changes nothing) and are never stored.
Resets (seq_idx) are counts: RST[b, t] = the number of sequence starts at or before t
(int32, from torch); a decay from step j to step i survives exactly when the counts
agree, so every decay that crosses a start is masked to 0 (a mask, never -inf in a sum).

Precision. Every load is converted to ACC before arithmetic: float32 for fp16 / bf16 /
fp32 inputs, float64 for float64 (so gradcheck runs through this backward). Dots are IEEE
(input_precision="ieee": no TF32). Decays are exponentials of directly summed ranges
(forward and reverse cumulative sums, a column cumsum for the (Q, Q) segments), never of
differences of long prefix sums. `out` and the gradients are stored in their inputs'
dtypes, the final state in ACC.

Determinism. No atomics. Sums over heads (dB, dC of a group), chunks and batch (dA, dD,
ddt_bias) and channel blocks (dG) are written as per-program partials and reduced by
torch in a fixed order: the same inputs give bit-identical results.

Under the interpreter, TRITON_INTERPRET=1 must be set before triton is first imported;
the device helpers then run as plain Python (see `triton_fwd._helper`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sonata.kernels.dispatch import compute_dtype
from sonata.kernels.ssd.reference import boundaries
from sonata.kernels.ssd.triton_bwd import (
    chunk_bwd_kernel,
    dstate_kernel,
    state_pass_bwd_kernel,
)
from sonata.kernels.ssd.triton_fwd import (
    chunk_scan_kernel,
    chunk_state_kernel,
    dt_kernel,
    state_pass_kernel,
)

# Tests set this so every output and intermediate starts as NaN: an element a kernel
# forgets to write cannot pass a comparison.
POISON_OUTPUTS = False

# The longest chunk the kernels tile (see the module docstring and `chunk_cap`).
MAX_CHUNK = 64

# Whether these kernels run in Triton's CPU interpreter (fixed when triton was imported).
INTERPRETED = type(dt_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class LaunchConfig:
    block_q: int     # chunk lanes (power of two >= chunk_size, >= 16)
    block_p: int     # channels per program in the kernels that do not sum over them
    p_pad: int       # head dim padded (power of two >= 16)
    n_pad: int       # state dim padded (power of two >= 16)
    block_h: int     # heads per program of the dt kernel
    num_warps: int


def chunk_cap(n: int) -> int:
    """The longest chunk run for state size n: MAX_CHUNK, fewer steps for wide states."""
    return max(16, min(MAX_CHUNK, 4096 // triton.next_power_of_2(max(int(n), 16))))


def launch_config(chunk: int, h: int, p: int, n: int, block_p: int | None = None) -> LaunchConfig:
    """Tile sizes from the shapes alone (forward and backward agree). Under the
    interpreter per-op overhead dominates, so channel blocks are as wide as allowed."""
    pow2 = lambda v: triton.next_power_of_2(max(int(v), 16))
    block_q, p_pad, n_pad = pow2(chunk), pow2(p), pow2(n)
    if block_p is None:
        block_p = p_pad if INTERPRETED else min(p_pad, 64)
    if block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"block_p must be a power of two >= 16, got {block_p}")
    block_h = min(triton.next_power_of_2(max(h, 1)), 16 if not INTERPRETED else 1024)
    num_warps = 4 if block_q * max(p_pad, n_pad) <= 64 * 64 else 8
    return LaunchConfig(block_q, min(block_p, p_pad), p_pad, n_pad, block_h, num_warps)


def _new(shape, dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _acc(t: torch.Tensor):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def reset_counts(seq_idx, L, device):
    """(b, l) int32: sequence starts at or before t (seq_idx changes between t-1 and t)."""
    starts = boundaries(seq_idx, L, device)
    return starts.to(torch.int32).cumsum(1, dtype=torch.int32).contiguous()


def _forward(x, dt, A, B, C, D, z, dt_bias, init, rst, chunk, softplus, limit, cfg):
    """out, final, and what the backward needs: (dt_p, G, start, y)."""
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    acc, dev = compute_dtype(x.dtype), x.device
    nc = triton.cdiv(L, chunk)
    n_pb = triton.cdiv(p, cfg.block_p)
    lo, hi = float(limit[0]), float(limit[1])
    flags = {"HAS_SEQ": rst is not None, "BLOCK_Q": cfg.block_q, "N_PAD": cfg.n_pad,
             "ACC": _acc(x)}
    rst_ = rst if rst is not None else dt
    dt_p = _new((b, h, L), acc, dev)
    G = _new((b, h, nc), acc, dev)
    dt_kernel[(b, nc, triton.cdiv(h, cfg.block_h))](
        dt, dt_bias if dt_bias is not None else dt, A, rst_, dt_p, G, L, h, chunk, nc, lo, hi,
        HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus, HAS_LIMIT=lo > 0.0 or hi < math.inf,
        HAS_SEQ=rst is not None, BLOCK_Q=cfg.block_q, BLOCK_H=cfg.block_h, ACC=_acc(x))
    states = _new((b, nc, h, p, n), acc, dev)
    chunk_state_kernel[(b, nc, h * n_pb)](
        x, B, dt_p, A, rst_, states, L, h, p, n, chunk, nc, h // g, n_pb,
        BLOCK_P=cfg.block_p, num_warps=cfg.num_warps, **flags)
    start = _new((b, nc, h, p, n), acc, dev)
    final = _new((b, h, p, n), acc, dev)
    state_pass_kernel[(b, h, n_pb)](
        states, G, init if init is not None else states, start, final, h, p, n, nc, n_pb,
        HAS_INIT=init is not None, BLOCK_P=cfg.block_p, N_PAD=cfg.n_pad, ACC=_acc(x))
    del states
    out = _new((b, L, h, p), x.dtype, dev)
    y = _new((b, L, h, p), acc, dev) if z is not None else None
    chunk_scan_kernel[(b, nc, h * n_pb)](
        x, B, C, D if D is not None else x, z if z is not None else x, dt_p, A, rst_, start,
        out, y if y is not None else out, L, h, p, n, chunk, nc, h // g, n_pb,
        HAS_D=D is not None, HAS_Z=z is not None, BLOCK_P=cfg.block_p,
        num_warps=cfg.num_warps, **flags)
    return out, final, (dt_p, G, start, y)


def _backward(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, init, rst, chunk, softplus, limit,
              cfg, saved):
    """(dx, ddt, dA, dB_h, dC_h, dD (h, p), dz, ddt_bias, dinit) in ACC or input dtypes."""
    dt_p, G, start, y = saved
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    acc, dev = compute_dtype(x.dtype), x.device
    nc = triton.cdiv(L, chunk)
    n_pb = triton.cdiv(p, cfg.block_p)
    lo, hi = float(limit[0]), float(limit[1])
    flags = {"HAS_SEQ": rst is not None, "BLOCK_Q": cfg.block_q, "N_PAD": cfg.n_pad,
             "ACC": _acc(x)}
    rst_ = rst if rst is not None else dt
    z_ = z if z is not None else x

    E = _new((b, nc, h, p, n), acc, dev)
    dstate_kernel[(b, nc, h * n_pb)](
        dout, z_, C, dt_p, A, rst_, E, L, h, p, n, chunk, nc, h // g, n_pb,
        HAS_Z=z is not None, BLOCK_P=cfg.block_p, num_warps=cfg.num_warps, **flags)
    dnext = _new((b, nc, h, p, n), acc, dev)
    dG_part = _new((b, h, nc, n_pb), acc, dev)
    dinit = _new((b, h, p, n), acc, dev) if init is not None else None
    state_pass_bwd_kernel[(b, h, n_pb)](
        E, G, start, dfinal, dnext, dG_part, dinit if dinit is not None else dG_part,
        h, p, n, nc, n_pb,
        HAS_INIT=init is not None, BLOCK_P=cfg.block_p, N_PAD=cfg.n_pad, ACC=_acc(x))
    del E
    dG = dG_part.sum(-1).contiguous()                                        # (b, h, nc)

    dx = _new(x.shape, x.dtype, dev)
    dz = _new(z.shape, z.dtype, dev) if z is not None else None
    ddt = _new(dt.shape, dt.dtype, dev)
    dB_h = _new((b, L, h, n), acc, dev)
    dC_h = _new((b, L, h, n), acc, dev)
    dA_part = _new((b, nc, h), acc, dev)
    dD_part = _new((b, nc, h, p), acc, dev) if D is not None else None
    dbias_part = _new((b, nc, h), acc, dev) if dt_bias is not None else None
    chunk_bwd_kernel[(b, nc, h)](
        x, dt, dt_bias if dt_bias is not None else dt, A, B, C, D if D is not None else x, z_,
        dout, y if y is not None else x, rst_, dt_p, G, start, dnext, dG,
        dx, dz if dz is not None else dx, ddt, dB_h, dC_h, dA_part,
        dD_part if dD_part is not None else dA_part,
        dbias_part if dbias_part is not None else dA_part,
        L, h, p, n, chunk, nc, h // g, lo, hi,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None,
        SOFTPLUS=softplus, HAS_LIMIT=lo > 0.0 or hi < math.inf, HAS_SEQ=rst is not None,
        BLOCK_Q=cfg.block_q, P_PAD=cfg.p_pad, N_PAD=cfg.n_pad, ACC=_acc(x),
        num_warps=cfg.num_warps)
    # fixed-order reductions of the partials
    dA = dA_part.sum((0, 1))
    dD = dD_part.sum((0, 1)) if dD_part is not None else None
    dbias = dbias_part.sum((0, 1)) if dbias_part is not None else None
    return dx, ddt, dA, dB_h, dC_h, dD, dz, dbias, dinit


def _contig(t):
    return None if t is None else t.contiguous()


class SSDTriton(torch.autograd.Function):
    """Joins the kernels to autograd. Returns (out, final_states); the wrapper drops the
    final state when it was not asked for (its gradient then arrives as zeros)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, rst, chunk_size,
                dt_softplus, dt_limit, cfg):
        b, L, h, p = x.shape
        n = B.shape[3]
        acc = compute_dtype(x.dtype)
        D2 = None if D is None else (D[:, None].expand(h, p) if D.dim() == 1 else D)
        ins = [_contig(t) for t in (x, dt, A, B, C, D2, z, dt_bias)]
        init = None if initial_states is None else initial_states.to(acc).contiguous()
        if b * L == 0:
            final = init.clone() if init is not None else x.new_zeros((b, h, p, n), dtype=acc)
            saved = None
            out = x.new_empty((b, L, h, p))
        else:
            out, final, saved = _forward(*ins, init, rst, chunk_size, dt_softplus, dt_limit, cfg)
        ctx.save_for_backward(*ins, init, rst, *(saved or ()))
        # dtypes and shapes only: input tensors kept on ctx would outlive the graph's needs
        ctx.meta = (None if D is None else (D.dim(), D.dtype), B.dtype, C.dtype,
                    None if dt_bias is None else dt_bias.dtype,
                    None if initial_states is None else initial_states.dtype,
                    chunk_size, dt_softplus, dt_limit, cfg, saved is None)
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        D_kind, B_dtype, C_dtype, bias_dtype, init_dtype, chunk, softplus, limit, cfg, empty = \
            ctx.meta
        tensors = ctx.saved_tensors
        x, dt, A, B, C, D2, z, dt_bias, init, rst = tensors[:10]
        b, L, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        acc = compute_dtype(x.dtype)
        if empty:
            dx, ddt, dz = torch.zeros_like(x), torch.zeros_like(dt), _zeros_like(z)
            dA = A.new_zeros(A.shape, dtype=acc)
            dB_h = dC_h = x.new_zeros((b, L, h, n), dtype=acc)
            dD = None if D_kind is None else x.new_zeros((h, p), dtype=acc)
            dbias = None if dt_bias is None else x.new_zeros((h,), dtype=acc)
            dinit = None if init is None else dfinal.to(acc)
        else:
            dx, ddt, dA, dB_h, dC_h, dD, dz, dbias, dinit = _backward(
                dout.contiguous(), dfinal.to(acc).contiguous(), x, dt, A, B, C, D2, z, dt_bias,
                init, rst, chunk, softplus, limit, cfg, tuple(tensors[10:]))
        dB = dB_h.view(b, L, g, h // g, n).sum(3).to(B_dtype)               # heads -> groups
        dC = dC_h.view(b, L, g, h // g, n).sum(3).to(C_dtype)
        if D_kind is not None:
            dD = (dD.sum(-1) if D_kind[0] == 1 else dD).to(D_kind[1])
        return (dx, ddt, dA.to(A.dtype), dB, dC, dD, dz,
                None if dbias is None else dbias.to(bias_dtype),
                None if dinit is None else dinit.to(init_dtype),
                None, None, None, None, None)


def _zeros_like(t):
    return None if t is None else torch.zeros_like(t)


def ssd_triton(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
               seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf),
               return_final_states=False, *, block_p=None):
    """The SSD with `mamba_chunk_scan_combined`'s arguments (see the module docstring).
    `chunk_size` is a tiling choice (capped by `chunk_cap`): the function computed does
    not depend on it. Returns out (b, l, h, p) in x's dtype, and with
    `return_final_states` also the final state (b, h, p, n) in the accumulation dtype
    (float32; float64 for float64 input).
    `block_p` overrides the channel tile (tests, benchmarks)."""
    b, L, h, p = x.shape
    if dt.shape != (b, L, h) or A.shape != (h,):
        raise ValueError(f"ssd_triton: dt {tuple(dt.shape)} / A {tuple(A.shape)} do not match "
                         f"x {tuple(x.shape)}")
    if B.shape[:2] != (b, L) or C.shape != B.shape or h % B.shape[2]:
        raise ValueError(f"ssd_triton: B {tuple(B.shape)} / C {tuple(C.shape)} do not match "
                         f"x {tuple(x.shape)} (heads must be a multiple of groups)")
    n = B.shape[3]
    for name, t, shapes in (("D", D, ((h,), (h, p))), ("z", z, ((b, L, h, p),)),
                            ("dt_bias", dt_bias, ((h,),)),
                            ("initial_states", initial_states, ((b, h, p, n),))):
        if t is not None and tuple(t.shape) not in shapes:
            raise ValueError(f"ssd_triton: {name} of shape {tuple(t.shape)}, expected "
                             f"{' or '.join(str(s) for s in shapes)}")
    if not x.is_cuda and not INTERPRETED:
        raise RuntimeError("ssd_triton: CPU tensors need the Triton interpreter "
                           "(TRITON_INTERPRET=1 before triton is first imported)")
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"ssd_triton: chunk_size must be positive, got {chunk_size}")
    chunk_size = min(chunk_size, chunk_cap(n))
    rst = reset_counts(seq_idx, L, x.device) if seq_idx is not None and b * L else None
    cfg = launch_config(chunk_size, h, p, n, block_p)
    out, final = SSDTriton.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, rst,
                                 chunk_size, bool(dt_softplus), tuple(dt_limit), cfg)
    return (out, final) if return_final_states else out
