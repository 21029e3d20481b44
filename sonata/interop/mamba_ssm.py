"""mamba_ssm's op surface on sonata's kernels (Mamba-1 here, Mamba-2 from `mamba2_ops`): other
people's Mamba code on a CPU.

The same names, signatures, shapes and semantics as `mamba_ssm.ops.selective_scan_interface`,
`mamba_ssm.ops.triton.selective_state_update` and the `causal_conv1d` package, so that a
program written against them runs without CUDA by changing its imports (or, where those
packages are absent, after `sonata.interop.mamba_ssm.install()`):

    selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                      delta_softplus=False, return_last_state=False, initial_state=None)
    mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
                   out_proj_weight, out_proj_bias, A, B=None, C=None, D=None, delta_bias=None,
                   B_proj_bias=None, C_proj_bias=None, delta_softplus=True)
    causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None)
    causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                         cache_seqlens=None, conv_state_indices=None)
    selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None)

Each has its reference beside it (`*_ref`, the semantics of mamba_ssm's reference functions,
written here; float64 inputs compute in float64, where mamba_ssm's reference casts to float32,
so that the tests can compare in float64). What runs:

- `selective_scan_fn` goes through `sonata.kernels.selective_scan` (backend "auto": the fused
  numba kernels on CPU tensors, Triton on CUDA) for every real form of B and C that shares them
  across a group of channels: per-batch (batch, N, L) and grouped (batch, G, N, L) (one fused
  scan per group of dim / G channels). A time-invariant B or C (dim, N), a per-channel matrix as
  in S4, has no form in the fused kernels (they broadcast B_t and C_t over the channels): that
  case runs the reference, correct and slow. Complex A is one clear error (ValueError).
  Gradients flow to every input (the last state's included, which mamba_ssm's CUDA op drops),
  and `initial_state` (batch, dim, N), a keyword mamba_ssm does not have, starts the scan from
  a state (zeros by default).
- `mamba_inner_fn` is the whole mixer with sonata's fused pieces: the causal conv + SiLU and
  the gate split in one numba pass, x_proj as a matmul, and the scan forming delta from
  delta_proj's low-rank input itself (sonata's model does the same).
- `causal_conv1d_fn` / `causal_conv1d_update` / `selective_state_update` run PyTorch ops (a
  depthwise conv1d and a few elementwise ops per step; there is nothing to fuse across calls);
  they are their references' code with the package's argument checks. `causal_conv1d_fn`
  takes `seq_idx` (batch, L): no tap crosses a packed sequence's start.
- `Mamba3` (mamba_ssm.modules.mamba3's module, SISO and MIMO, with its inference cache) is
  sonata's released-form Mamba-3 layer under mamba_ssm's arguments (`sonata.interop.mamba3_module`).
- The Mamba-2 ops live in `sonata.interop.mamba2_ops` and are re-exported here:
  `mamba_chunk_scan_combined`, `mamba_split_conv1d_scan_combined`, the gated norms
  (`rmsnorm_fn`, `layernorm_fn`, `RMSNorm`, `LayerNorm`); `selective_state_update` takes both
  forms, as mamba_ssm's does: state (batch, dim, N) (Mamba-1, above) or (batch, nheads,
  headdim, N) (Mamba-2: `mamba2_ops.selective_state_update_heads`, sonata's fused `ssd_step`).

Not supported (one clear error each): variable-length packing in the Mamba-1 scan ops
(`cu_seqlens`, `seq_idx` of `selective_scan_fn` / `mamba_inner_fn`) and complex A.
`install()` serves every op named here under mamba_ssm's module paths, and each runs every
form its signature admits (a form without a fast path runs the reference), so a caller that
resolves them (transformers at import) never meets an op that refuses a form it passes.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from sonata.interop.mamba2_ops import (
    LayerNorm,
    RMSNorm,
    causal_conv,
    layernorm_fn,
    mamba_chunk_scan_combined,
    mamba_chunk_scan_combined_ref,
    mamba_split_conv1d_scan_combined,
    mamba_split_conv1d_scan_ref,
    rms_norm_ref,
    rmsnorm_fn,
    selective_state_update_heads,
    selective_state_update_heads_ref,
)
from sonata.interop import shim
from sonata.interop.mamba3_module import Mamba3, heavy_tail_activation
from sonata.kernels import causal_conv_silu, conv_silu, rms_norm, selective_scan
from sonata.kernels.dispatch import compute_dtype

_ACTIVATIONS = (None, "silu", "swish")


def _check_real(A):
    if A.is_complex():
        raise ValueError("sonata.interop.mamba_ssm: complex A is not supported (real-valued Mamba only)")


def _unsupported(**kw):
    for name, value in kw.items():
        if value is not None:
            raise ValueError(f"sonata.interop.mamba_ssm: {name} (variable-length packing) is not supported")


def _form(M, name, batch, dim, L):
    """Which form a B or C takes: 'time-invariant' (dim, N), 'batch' (batch, N, L) or
    'grouped' (batch, G, N, L) with G dividing dim; anything else is a ValueError."""
    if M.dim() == 2 and M.shape[0] == dim:
        return "time-invariant"
    if M.dim() == 3 and M.shape[0] == batch and M.shape[2] == L:
        return "batch"
    if M.dim() == 4 and M.shape[0] == batch and M.shape[3] == L and dim % M.shape[1] == 0:
        return "grouped"
    raise ValueError(f"sonata.interop.mamba_ssm: {name} of shape {tuple(M.shape)} fits none of (dim, N), "
                     f"(batch, N, L) or (batch, G, N, L) with G dividing dim, for u of shape "
                     f"({batch}, {dim}, {L})")


def _per_channel(M, form, dim):
    """B or C as (batch, dim, N, L) (time-invariant: (dim, N) kept as is)."""
    if form == "batch":
        return M.unsqueeze(1).expand(-1, dim, -1, -1)
    if form == "grouped":
        return M.repeat_interleave(dim // M.shape[1], dim=1)
    return M


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, initial_state=None):
    """mamba_ssm's reference semantics for every real form of B and C: h_t = exp(delta_t A) h_{t-1}
    + delta_t B_t u_t, y_t = C_t h_t + D u_t, out = y silu(z). u, delta, z (batch, dim, L);
    A (dim, N); B, C (dim, N), (batch, N, L) or (batch, G, N, L) (group g serves channels
    g * dim / G up to (g + 1) * dim / G). Float32 arithmetic (float64 for float64 inputs);
    out in u's dtype; the last state (batch, dim, N) in the arithmetic dtype."""
    _check_real(A)
    batch, dim, L = u.shape
    forms = _form(B, "B", batch, dim, L), _form(C, "C", batch, dim, L)
    ct = compute_dtype(u.dtype)
    u_c, delta = u.to(ct), delta.to(ct)
    if delta_bias is not None:
        delta = delta + delta_bias.to(ct)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    A = A.to(ct)
    Bc, Cc = (_per_channel(M.to(ct), f, dim) for M, f in zip((B, C), forms))
    h = initial_state.to(ct) if initial_state is not None else u_c.new_zeros(batch, dim, A.shape[1])
    ys = []
    for t in range(L):
        B_t = Bc if forms[0] == "time-invariant" else Bc[..., t]          # (dim, N) or (b, dim, N)
        C_t = Cc if forms[1] == "time-invariant" else Cc[..., t]
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u_c[:, :, t])[..., None] * B_t
        ys.append((h * C_t).sum(-1))
    y = torch.stack(ys, dim=-1) if L else u_c.new_zeros(batch, dim, 0)
    if D is not None:
        y = y + u_c * D.to(ct)[:, None]
    if z is not None:
        y = y * F.silu(z.to(ct))
    out = y.to(u.dtype)
    return (out, h) if return_last_state else out


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, initial_state=None, cu_seqlens=None):
    """mamba_ssm's `selective_scan_fn` (see the module docstring for what runs where):
    -> out (batch, dim, L) in u's dtype, or (out, last_state (batch, dim, N)) with
    `return_last_state`."""
    _check_real(A)
    _unsupported(cu_seqlens=cu_seqlens)
    batch, dim, L = u.shape
    forms = _form(B, "B", batch, dim, L), _form(C, "C", batch, dim, L)
    if "time-invariant" in forms:
        return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                  return_last_state, initial_state)
    if forms[0] == "grouped" and B.shape[1] == 1:
        B, forms = B[:, 0], ("batch", forms[1])
    if forms[1] == "grouped" and C.shape[1] == 1:
        C, forms = C[:, 0], (forms[0], "batch")
    if forms == ("batch", "batch"):
        return selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
                              initial_state=initial_state)
    # Grouped: one fused scan per group of channels that share their B and C.
    gb = B.shape[1] if forms[0] == "grouped" else 1
    gc = C.shape[1] if forms[1] == "grouped" else 1
    G = gb * gc // math.gcd(gb, gc)
    if dim % G:
        raise ValueError(f"sonata.interop.mamba_ssm: B's {gb} and C's {gc} groups do not split {dim} channels evenly")
    H = dim // G
    outs, lasts = [], []
    for g in range(G):
        ch = slice(g * H, (g + 1) * H)
        B_g = B[:, g * gb // G] if forms[0] == "grouped" else B
        C_g = C[:, g * gc // G] if forms[1] == "grouped" else C
        out, last = selective_scan(
            u[:, ch], delta[:, ch], A[ch], B_g, C_g, None if D is None else D[ch],
            None if z is None else z[:, ch], None if delta_bias is None else delta_bias[ch],
            delta_softplus, True, initial_state=None if initial_state is None else initial_state[:, ch])
        outs.append(out)
        lasts.append(last)
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(lasts, dim=1)) if return_last_state else out


# --------------------------------------------------------------------------- causal conv1d

def _check_conv(x, weight, activation):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"sonata.interop.mamba_ssm: activation must be None, 'silu' or 'swish', not {activation!r}")
    if weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"sonata.interop.mamba_ssm: weight of shape {tuple(weight.shape)} is not (dim, width) "
                         f"for x of shape {tuple(x.shape)}")


def causal_conv1d_ref(x, weight, bias=None, initial_states=None, return_final_states=False,
                      final_states_out=None, activation=None):
    """The `causal_conv1d` package's reference: x (batch, dim, L), weight (dim, width), bias
    (dim,), initial_states (batch, dim, width - 1) (the inputs before x) -> out (batch, dim, L)
    in x's dtype, and the last width - 1 inputs with `return_final_states`."""
    _check_conv(x, weight, activation)
    dtype_in = x.dtype
    x = x.to(weight.dtype)
    L = x.shape[-1]
    dim, width = weight.shape
    if initial_states is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)
    else:
        x = torch.cat([initial_states.to(x.dtype), x], dim=-1)
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=0, groups=dim)
    out = out[..., :L]
    out = (out if activation is None else F.silu(out)).to(dtype_in)
    if not return_final_states:
        return out
    final = F.pad(x, (width - 1 - x.shape[-1], 0)).to(dtype_in)     # (batch, dim, width - 1)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """The `causal_conv1d` package's `causal_conv1d_fn` (depthwise causal conv1d, then SiLU when
    activation is 'silu' / 'swish'): PyTorch's conv1d, autograd through it. With seq_idx
    (batch, L) no tap reads across a packed sequence's start (`mamba2_ops.causal_conv`). The
    common case (SiLU, no seq_idx or states, x in weight's dtype) runs sonata's fused conv + SiLU
    (`kernels.causal_conv_silu`, numba on the CPU); its result is (batch, dim, L) with the
    strides of a (batch, L, dim) tensor."""
    if (seq_idx is None and initial_states is None and not return_final_states and activation in ("silu", "swish")
            and x.dim() == 3 and weight.dim() == 2 and x.shape[1] == weight.shape[0] and x.dtype == weight.dtype
            and (bias is None or bias.dtype == x.dtype)):
        return causal_conv_silu(x.transpose(1, 2), weight.unsqueeze(1), bias).transpose(1, 2)
    if seq_idx is not None:
        if initial_states is not None or return_final_states:
            raise ValueError("sonata.interop.mamba_ssm: causal_conv1d_fn takes seq_idx without initial_states "
                             "or return_final_states (as the causal_conv1d package)")
        _check_conv(x, weight, activation)
        return causal_conv(x, weight, bias, seq_idx, activation)
    return causal_conv1d_ref(x, weight, bias, initial_states, return_final_states, final_states_out,
                             activation)


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None):
    """One or a few decoding steps of the causal conv: x (batch, dim) or (batch, dim, L);
    conv_state (batch, dim, state_len >= width - 1), the latest inputs, updated in place (as a
    circular buffer from position cache_seqlens % state_len when cache_seqlens (batch,) is
    given) -> out like x."""
    _check_conv(x if x.dim() == 3 else x.unsqueeze(-1), weight, activation)
    dtype_in = x.dtype
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    batch, dim, L = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[-1]
    if conv_state.shape[:2] != (batch, dim) or state_len < width - 1:
        raise ValueError(f"sonata.interop.mamba_ssm: conv_state of shape {tuple(conv_state.shape)} is not "
                         f"({batch}, {dim}, >= {width - 1})")
    if cache_seqlens is None:
        x_new = torch.cat([conv_state, x.to(conv_state.dtype)], dim=-1).to(weight.dtype)
        conv_state.copy_(x_new[:, :, -state_len:])
    else:
        pos = cache_seqlens.long().unsqueeze(1)
        read = torch.remainder(torch.arange(-(width - 1), 0, device=x.device).unsqueeze(0) + pos, state_len)
        x_new = torch.cat([conv_state.gather(2, read.unsqueeze(1).expand(-1, dim, -1)),
                           x.to(conv_state.dtype)], dim=-1).to(weight.dtype)
        write = torch.remainder(torch.arange(L, device=x.device).unsqueeze(0) + pos, state_len)
        conv_state.scatter_(2, write.unsqueeze(1).expand(-1, dim, -1), x.to(conv_state.dtype))
    out = F.conv1d(x_new, weight.unsqueeze(1), bias, padding=0, groups=dim)[:, :, -L:]
    out = (out if activation is None else F.silu(out)).to(dtype_in)
    return out.squeeze(-1) if squeeze else out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """The `causal_conv1d` package's `causal_conv1d_update`; `conv_state_indices` (batch,) picks
    each row's state from a larger conv_state (continuous batching)."""
    if conv_state_indices is None:
        return causal_conv1d_update_ref(x, conv_state, weight, bias, activation, cache_seqlens)
    idx = conv_state_indices.long()
    rows = conv_state[idx]
    out = causal_conv1d_update_ref(x, rows, weight, bias, activation, cache_seqlens)
    conv_state[idx] = rows
    return out


# --------------------------------------------------------------------------- one decoding step

def _heads_form(state, x, dt, A, B, C, D, z, dt_bias):
    """mamba_ssm's promotion of lower-rank arguments to the per-head form (one head)."""
    def up(t, rank, at):
        return t.unsqueeze(at) if t is not None and t.dim() == rank else t
    return (state, up(x, 2, 1), up(dt, 2, 1), up(A, 2, 0), up(B, 2, 1), up(C, 2, 1), up(D, 1, 0), up(z, 2, 1),
            up(dt_bias, 1, 0))


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One step of the recurrence, the state updated in place: state (batch, dim, N); x, dt, z
    (batch, dim); A (dim, N); B, C (batch, N) or (batch, G, N) (group g serves dim / G
    channels); D, dt_bias (dim,) -> out (batch, dim) in x's dtype. A state (batch, nheads,
    headdim, N) is the per-head (Mamba-2) form: `mamba2_ops.selective_state_update_heads_ref`."""
    _check_real(A)
    if state.dim() == 4:
        return selective_state_update_heads_ref(*_heads_form(state, x, dt, A, B, C, D, z, dt_bias), dt_softplus)
    if state.dim() != 3 or x.dim() != 2:
        raise ValueError(f"sonata.interop.mamba_ssm: selective_state_update takes state (batch, dim, N) with x "
                         f"(batch, dim), or state (batch, nheads, headdim, N) with x (batch, nheads, headdim); "
                         f"got state {tuple(state.shape)} and x {tuple(x.shape)}")
    dim = x.shape[1]
    ct = compute_dtype(state.dtype)
    dt = dt.to(ct)
    if dt_bias is not None:
        dt = dt + dt_bias.to(ct)
    if dt_softplus:
        dt = F.softplus(dt)
    Bc, Cc = ((M.to(ct).repeat_interleave(dim // M.shape[1], dim=1) if M.dim() == 3 else M.to(ct)[:, None])
              for M in (B, C))
    new = torch.exp(dt[..., None] * A.to(ct)) * state.to(ct) + (dt * x.to(ct))[..., None] * Bc
    state.copy_(new)
    out = (new * Cc).sum(-1)
    if D is not None:
        out = out + x.to(ct) * D.to(ct)
    if z is not None:
        out = out * F.silu(z.to(ct))
    return out.to(x.dtype)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """mamba_ssm's `selective_state_update`, both forms: state (batch, dim, N) (Mamba-1 shapes,
    `selective_state_update_ref`) or (batch, nheads, headdim, N) (Mamba-2: A (nheads, headdim,
    N), usually a stride-0 expansion of one number per head, dt_bias and D (nheads, headdim);
    sonata's fused step, `mamba2_ops.selective_state_update_heads`). `state_batch_indices`
    (batch,) picks each row's state from a larger state tensor."""
    if state.dim() == 4:
        return selective_state_update_heads(*_heads_form(state, x, dt, A, B, C, D, z, dt_bias), dt_softplus,
                                            state_batch_indices)
    if state_batch_indices is None:
        return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    idx = state_batch_indices.long()
    rows = state[idx]
    out = selective_state_update_ref(rows, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    state[idx] = rows
    return out


# --------------------------------------------------------------------------- the whole mixer

def _rms_ref(v, weight, eps):
    """RMSNorm over the last dimension in float32 (float64 for float64), the result in v's dtype."""
    vc = v.to(compute_dtype(v.dtype))
    return (vc * torch.rsqrt(vc.square().mean(-1, keepdim=True) + eps) * weight.to(vc.dtype)).to(v.dtype)


def _mixer_inputs(x, x_proj_weight, delta_rank, d_state, B, C, B_proj_bias, C_proj_bias, b_rms_weight=None,
                  c_rms_weight=None, eps=1e-6, norm=_rms_ref):
    """x (batch, L, dim) after conv + SiLU -> (dt (batch, L, R), B, C) as the scan takes them:
    variable B / C (when None) from x_proj's output as (batch, N, L) views, each normalized over
    N (Falcon Mamba's b_rms / c_rms) when its weight is given."""
    x_dbl = F.linear(x, x_proj_weight)                                  # (batch, L, R + 2N)
    dt = x_dbl[..., :delta_rank]
    if B is None:
        B = x_dbl[..., delta_rank:delta_rank + d_state]
        B = B if B_proj_bias is None else B + B_proj_bias.to(B.dtype)
        B = (B if b_rms_weight is None else norm(B, b_rms_weight, eps)).transpose(1, 2)
    if C is None:
        C = x_dbl[..., -d_state:]
        C = C if C_proj_bias is None else C + C_proj_bias.to(C.dtype)
        C = (C if c_rms_weight is None else norm(C, c_rms_weight, eps)).transpose(1, 2)
    return dt, B, C


def _delta(dt, delta_proj_weight, dt_rms_weight, eps, norm):
    """delta (batch, dim, L) = delta_proj(dt), normalized over dim (Falcon Mamba's dt_rms, as
    mamba_ssm applies it: after the projection) when its weight is given."""
    delta = dt @ delta_proj_weight.t()                                  # (batch, L, dim)
    return (delta if dt_rms_weight is None else norm(delta, dt_rms_weight, eps)).transpose(1, 2)


def mamba_inner_ref(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                    out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None,
                    C_proj_bias=None, delta_softplus=True, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                    b_c_dt_rms_eps=1e-6):
    """mamba_ssm's `mamba_inner_ref`: xz (batch, 2 dim, L), in_proj's output channel-major ->
    (batch, L, d_model): conv + SiLU of the first half, x_proj, delta_proj, the scan gated by the
    second half, out_proj; with b_rms_weight / c_rms_weight (N,) and dt_rms_weight (dim,), an
    RMSNorm of B, C and delta (mamba_ssm's Falcon Mamba form). The references of the pieces,
    autograd through them."""
    _check_real(A)
    x, z = xz.chunk(2, dim=1)
    x = causal_conv1d_ref(x, conv1d_weight.reshape(conv1d_weight.shape[0], -1), conv1d_bias, activation="silu")
    dt, B, C = _mixer_inputs(x.transpose(1, 2), x_proj_weight, delta_proj_weight.shape[1], A.shape[-1], B, C,
                             B_proj_bias, C_proj_bias, b_rms_weight, c_rms_weight, b_c_dt_rms_eps)
    delta = _delta(dt, delta_proj_weight, dt_rms_weight, b_c_dt_rms_eps, _rms_ref)
    y = selective_scan_ref(x, delta, A, B, C, D, z, delta_bias, delta_softplus)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                   out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None,
                   C_proj_bias=None, delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None,
                   dt_rms_weight=None, b_c_dt_rms_eps=1e-6, cu_seqlens=None, seq_idx=None):
    """mamba_ssm's `mamba_inner_fn` on sonata's fused pieces (see the module docstring); the
    same arguments and result as `mamba_inner_ref` (the B / C / dt norms on sonata's fused
    RMSNorm). `checkpoint_lvl` is accepted and has nothing to choose: the fused backward
    recomputes from the inputs anyway."""
    _check_real(A)
    _unsupported(cu_seqlens=cu_seqlens, seq_idx=seq_idx)
    dim = conv1d_weight.shape[0]
    if conv1d_bias is None:                                             # the fused conv takes a bias
        conv1d_bias = conv1d_weight.new_zeros(dim)
    x, z = conv_silu(xz.transpose(1, 2), conv1d_weight.reshape(dim, 1, -1), conv1d_bias)  # (b, L, dim)
    dt, B, C = _mixer_inputs(x, x_proj_weight, delta_proj_weight.shape[1], A.shape[-1], B, C,
                             B_proj_bias, C_proj_bias, b_rms_weight, c_rms_weight, b_c_dt_rms_eps, rms_norm)
    if (dt_rms_weight is None and B.dim() == 3 and C.dim() == 3 and B.shape[-1] == C.shape[-1] == x.shape[1]
            and xz.shape[1] == 2 * dim):
        y = selective_scan(x.transpose(1, 2), dt, A, B, C, D, z.transpose(1, 2), delta_bias, delta_softplus,
                           delta_proj=delta_proj_weight)
    else:
        delta = _delta(dt, delta_proj_weight, dt_rms_weight, b_c_dt_rms_eps, rms_norm)
        y = selective_scan_fn(x.transpose(1, 2), delta, A, B, C, D, z.transpose(1, 2), delta_bias, delta_softplus)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)


# --------------------------------------------------------------------------- install

_SHIMS = {
    "mamba_ssm.ops.selective_scan_interface": ("selective_scan_fn", "selective_scan_ref", "mamba_inner_fn",
                                               "mamba_inner_ref"),
    "mamba_ssm.ops.triton.selective_state_update": ("selective_state_update", "selective_state_update_ref"),
    "mamba_ssm.ops.triton.ssd_combined": ("mamba_chunk_scan_combined", "mamba_chunk_scan_combined_ref",
                                          "mamba_split_conv1d_scan_combined", "mamba_split_conv1d_scan_ref"),
    "mamba_ssm.ops.triton.layernorm_gated": ("rmsnorm_fn", "layernorm_fn", "rms_norm_ref", "RMSNorm", "LayerNorm"),
    "mamba_ssm.modules.mamba3": ("Mamba3", "heavy_tail_activation"),
    "causal_conv1d": ("causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_ref", "causal_conv1d_update_ref"),
    "causal_conv1d.causal_conv1d_interface": ("causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_ref",
                                              "causal_conv1d_update_ref"),
}


def install() -> list[str]:
    """Make `from mamba_ssm.ops.selective_scan_interface import selective_scan_fn` (and the
    other ops' import paths above) resolve to sonata's ops, for each top-level package
    (mamba_ssm, causal_conv1d) that is NOT installed: a real installation always wins, and
    nothing else of it is imitated (`import mamba_ssm.models...` still fails, as without the
    shim). The shim modules say what they are (`__sonata_shim__`). Call it before transformers
    imports a model's module: transformers 5 resolves each op once, when that module is
    imported, and keeps its own PyTorch path for the ops it does not find. -> the module
    names set up."""
    done = []
    for name, attrs in _SHIMS.items():
        if not shim.installed(name.split(".")[0]):     # a real installation always wins
            shim.register(name, attrs, sys.modules[__name__], "sonata.interop.mamba_ssm")
            done.append(name)
    # transformers 5.25 and later send CPU tensors to its own PyTorch path even where an op's
    # package imports: the shim's ops run on CPU (and on CUDA through Triton)
    shim.serve_cpu_in_transformers({name.split(".")[0] for name in done})
    return done


__all__ = ["Mamba3", "heavy_tail_activation", "selective_scan_fn", "selective_scan_ref", "mamba_inner_fn", "mamba_inner_ref", "causal_conv1d_fn",
           "causal_conv1d_ref", "causal_conv1d_update", "causal_conv1d_update_ref", "selective_state_update",
           "selective_state_update_ref", "mamba_chunk_scan_combined", "mamba_chunk_scan_combined_ref",
           "mamba_split_conv1d_scan_combined", "mamba_split_conv1d_scan_ref", "rmsnorm_fn", "layernorm_fn",
           "rms_norm_ref", "RMSNorm", "LayerNorm", "install"]
