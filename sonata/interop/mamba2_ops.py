"""mamba_ssm's Mamba-2 op surface on sonata's kernels: Mamba-2 models (and the hybrids built
on them) on a CPU.

The names, signatures, shapes and semantics of `mamba_ssm.ops.triton.ssd_combined`, the
per-head form of `mamba_ssm.ops.triton.selective_state_update` and
`mamba_ssm.ops.triton.layernorm_gated` (served under those module paths by
`sonata.interop.mamba_ssm.install()`):

    mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
        initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
        dt_limit=(0.0, inf), return_final_states=False, return_varlen_states=False,
        state_dtype=None)
        x (b, l, h, p)  dt (b, l, h)  A (h,)  B, C (b, l, g, n)  D (h,) | (h, p)  z like x
        -> out (b, l, h, p) [, final_states (b, h, p, n)] [, varlen_states (nseq, h, p, n)]
    mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
        chunk_size, initial_states=None, seq_idx=None, dt_limit=(0.0, inf),
        return_final_states=False, activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
        outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1,
        norm_before_gate=True, state_dtype=None)
        the Mamba-2 mixer after in_proj: zxbcdt (b, l, 2 d_nonssm + 2 dim + 2 g n + h) split
        into [swiglu part | z | x B C | dt], the causal conv (+ SiLU) over x B C, the scan
        (dt_softplus), the gated grouped RMSNorm (group dim / ngroups) or, without its
        weight, the gate silu(z) in the scan, and out_proj -> (b, l, out_dim)
    selective_state_update_heads(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
        dt_softplus=False, state_batch_indices=None)
        one decoding step: state (b, h, p, n) updated in place; x, dt, z (b, h, p);
        A (h, p, n); B, C (b, g, n); D, dt_bias (h, p) -> (b, h, p)
    rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True)
    layernorm_fn(..., is_rms_norm=False), RMSNorm / LayerNorm (modules)

What runs. The scans go through `sonata.kernels.ssd.ssd` (backend "auto": on CPU tensors
the fused numba recurrence up to N = 128 and the chunked form beyond, each with its
hand-written backward; Triton on CUDA), `seq_idx` included
(the state resets where it changes). The decoding step goes through `ssd_step` (one fused
numba pass over the state) when A, dt and dt_bias are one number per head, as Mamba-2 passes
them (stride-0 expansions over p and n; equal values count too); a genuinely per-element A
or dt runs the reference, correct and slower. The gated norm is sonata's gated, grouped
RMSNorm (`sonata.kernels.rms_norm_gated`, one fused pass on CPU). The causal conv is PyTorch's
depthwise conv1d; with `seq_idx` a masked form that lets no tap cross a sequence boundary.

`cu_seqlens` (with `return_varlen_states`, batch 1) gives each packed sequence's own final
state: each sequence is scanned alone (from `initial_states` for the first), so the states
are those of sequences kept apart, which is what `seq_idx` marking the same boundaries
gives the outputs.

Each op has its `*_ref` beside it (the float64 sequential recurrence `ssd_recurrent_ref`,
the per-element step and norm in plain torch ops): float64 inputs compute in float64, where
mamba_ssm's references cast to float32, so the tests can compare in float64.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.kernels import causal_conv_silu, rms_norm_gated
from sonata.kernels.dispatch import compute_dtype
from sonata.kernels.ssd import ssd, ssd_packed, ssd_recurrent_ref, ssd_step

_INF = float("inf")


def _err(msg):
    raise ValueError(f"sonata.interop.mamba_ssm: {msg}")


# --------------------------------------------------------------------------- causal conv

def causal_conv(x, weight, bias=None, seq_idx=None, activation=None):
    """The depthwise causal conv of the `causal_conv1d` package: x (b, d, L), weight (d, K),
    bias (d,) -> (b, d, L) in x's dtype (arithmetic in weight's dtype), then SiLU for
    activation 'silu' / 'swish'. With seq_idx (b, L) a tap reads x[t - k] only where
    seq_idx[t - k] == seq_idx[t]: nothing of one packed sequence reaches the next."""
    if activation not in (None, "silu", "swish"):
        _err(f"activation must be None, 'silu' or 'swish', not {activation!r}")
    if weight.dim() != 2 or x.dim() != 3 or x.shape[1] != weight.shape[0]:
        _err(f"weight of shape {tuple(weight.shape)} is not (dim, width) for x of shape {tuple(x.shape)}")
    dtype_in = x.dtype
    xw = x.to(weight.dtype)
    d, K = weight.shape
    L = x.shape[-1]
    if seq_idx is None:
        out = F.conv1d(xw, weight.unsqueeze(1), bias, padding=K - 1, groups=d)[..., :L]
    else:
        if tuple(seq_idx.shape) != (x.shape[0], L):
            _err(f"seq_idx must be (batch, seqlen) = ({x.shape[0]}, {L}), got {tuple(seq_idx.shape)}")
        s = seq_idx.to(x.device).long()
        win = F.pad(xw, (K - 1, 0)).unfold(-1, K, 1)                     # (b, d, L, K): x[t - K + 1 + k]
        same = F.pad(s, (K - 1, 0), value=-1).unfold(-1, K, 1) == s[..., None]   # (b, L, K)
        out = torch.einsum("bdlk,dk->bdl", win * same[:, None].to(xw.dtype), weight)
        if bias is not None:
            out = out + bias.to(out.dtype)[:, None]
    out = out if activation is None else F.silu(out)
    return out.to(dtype_in)


# --------------------------------------------------------------------------- the chunked scan

def _chunk_scan(scan, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                dt_softplus, dt_limit, return_final_states, return_varlen_states, state_dtype):
    kw = dict(chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
              dt_limit=(float(dt_limit[0]), float(dt_limit[1])), return_final_states=True)
    out, final = scan(x, dt, A, B, C, z=z, initial_states=initial_states, seq_idx=seq_idx, **kw)
    sdt = state_dtype if state_dtype is not None else C.dtype
    res = (out, final.to(sdt)) if return_final_states else (out,)
    if return_varlen_states:
        if cu_seqlens is None:
            _err("return_varlen_states needs cu_seqlens")
        if x.shape[0] != 1:
            _err(f"cu_seqlens packs sequences along one row: batch must be 1, got {x.shape[0]}")
        bounds = [int(v) for v in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != x.shape[1] or any(a > b for a, b in zip(bounds, bounds[1:])):
            _err(f"cu_seqlens must rise from 0 to seqlen {x.shape[1]}, got {bounds}")
        states = [scan(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e],
                       initial_states=initial_states if s == 0 else None, **kw)[1]
                  for s, e in zip(bounds, bounds[1:])]
        res = res + (torch.cat(states).to(sdt),)
    return res if len(res) > 1 else res[0]


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, _INF),
                              return_final_states=False, return_varlen_states=False, state_dtype=None):
    """mamba_ssm's `mamba_chunk_scan_combined` on `sonata.kernels.ssd.ssd` (module docstring).
    Gradients flow to every tensor input (the final state's included)."""
    return _chunk_scan(ssd, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                       dt_softplus, dt_limit, return_final_states, return_varlen_states, state_dtype)


def mamba_chunk_scan_combined_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                                  dt_limit=(0.0, _INF), return_final_states=False,
                                  return_varlen_states=False, state_dtype=None):
    """The same on the sequential recurrence (`ssd_recurrent_ref`, float64 for float64 inputs)."""
    return _chunk_scan(ssd_recurrent_ref, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                       cu_seqlens, dt_softplus, dt_limit, return_final_states, return_varlen_states,
                       state_dtype)


# --------------------------------------------------------------------------- the whole mixer

def _swiglu(xy):
    a, b = xy.chunk(2, dim=-1)
    return F.silu(a) * b


def _split_conv1d(scan, norm, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states,
                  seq_idx, dt_limit, return_final_states, activation, rmsnorm_weight, rmsnorm_eps,
                  outproj_weight, outproj_bias, headdim, ngroups, norm_before_gate, state_dtype):
    if D.dim() == 1:
        if headdim is None:
            _err("mamba_split_conv1d_scan_combined: headdim must be given when D is (nheads,)")
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    batch, L, width = zxbcdt.shape
    dim = nheads * headdim
    conv_dim = conv1d_weight.shape[0]
    if ngroups < 1 or nheads % ngroups or (conv_dim - dim) % (2 * ngroups):
        _err(f"mamba_split_conv1d_scan_combined: {nheads} heads, {ngroups} groups and a conv over "
             f"{conv_dim} channels do not fit (conv channels = nheads * headdim + 2 * ngroups * dstate)")
    dstate = (conv_dim - dim) // ngroups // 2
    d_nonssm = (width - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm < 0 or width != 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads:
        _err(f"mamba_split_conv1d_scan_combined: zxbcdt's {width} channels are not 2 * d_nonssm + "
             f"2 * {dim} + 2 * {ngroups} * {dstate} + {nheads}")
    if rmsnorm_weight is None and outproj_bias is not None and outproj_weight is None:
        _err("mamba_split_conv1d_scan_combined: outproj_bias without outproj_weight")
    zx0, z, xBC, dt = zxbcdt.split([2 * d_nonssm, dim, conv_dim, nheads], dim=-1)
    if (scan is ssd and seq_idx is None and activation in ("silu", "swish") and xBC.dtype == conv1d_weight.dtype
            and (conv1d_bias is None or conv1d_bias.dtype == xBC.dtype)):
        # sonata's fused conv + SiLU (numba on the CPU): reads the slice in place, (b, l, conv_dim) out
        xBC = causal_conv_silu(xBC, conv1d_weight.unsqueeze(1), conv1d_bias)
    else:
        xBC = causal_conv(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx, activation)
        xBC = xBC.transpose(1, 2).contiguous()                              # (b, l, conv_dim)
    gate = z.reshape(batch, L, nheads, headdim) if rmsnorm_weight is None else None
    limit = (float(dt_limit[0]), float(dt_limit[1]))
    normed = False
    if scan is ssd and gate is None and initial_states is None and seq_idx is None and not return_final_states:
        # the training path: the packed [x | B | C] into the SSD whole, one gradient back for it,
        # and the gated norm (gate first, as transformers' Mamba2 calls it) inside its kernels
        normed = not norm_before_gate
        y, final = ssd_packed(xBC, dt, A, headdim, ngroups, dstate, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                              dt_softplus=True, dt_limit=limit,
                              norm=(z, rmsnorm_weight, rmsnorm_eps) if normed else None), None
    else:
        x, B, C = xBC.split([dim, ngroups * dstate, ngroups * dstate], dim=-1)
        y, final = scan(x.reshape(batch, L, nheads, headdim), dt, A, B.reshape(batch, L, ngroups, dstate),
                        C.reshape(batch, L, ngroups, dstate), chunk_size=chunk_size, D=D, z=gate, dt_bias=dt_bias,
                        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=limit,
                        return_final_states=True)
    y = y.reshape(batch, L, dim)
    if rmsnorm_weight is not None and not normed:
        y = norm(y, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=dim // ngroups,
                 norm_before_gate=norm_before_gate)
    if d_nonssm:
        y = torch.cat([_swiglu(zx0).to(y.dtype), y], dim=-1)
    out = y if outproj_weight is None else F.linear(y, outproj_weight, outproj_bias)
    if not return_final_states:
        return out
    return out, final.to(state_dtype if state_dtype is not None else xBC.dtype)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, _INF),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None):
    """mamba_ssm's `mamba_split_conv1d_scan_combined` (module docstring): the conv, sonata's
    SSD kernel, the fused RMSNorm, out_proj; autograd through all of them."""
    return _split_conv1d(ssd, rmsnorm_fn, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                         initial_states, seq_idx, dt_limit, return_final_states, activation, rmsnorm_weight,
                         rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups, norm_before_gate,
                         state_dtype)


def mamba_split_conv1d_scan_ref(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                initial_states=None, seq_idx=None, dt_limit=(0.0, _INF), return_final_states=False,
                                activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                                outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True,
                                state_dtype=None):
    """The same composition of references: the conv, the sequential recurrence, `rms_norm_ref`."""
    return _split_conv1d(ssd_recurrent_ref, rms_norm_ref, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                         chunk_size, initial_states, seq_idx, dt_limit, return_final_states, activation,
                         rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups,
                         norm_before_gate, state_dtype)


# --------------------------------------------------------------------------- one decoding step

def check_heads(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, state_batch_indices=None):
    """ValueError naming the first argument that does not fit the per-head step's shapes."""
    if state.dim() != 4:
        _err(f"selective_state_update (per head): state must be (batch, nheads, headdim, dstate), "
             f"got {tuple(state.shape)}")
    _, h, p, n = state.shape
    b = x.shape[0]
    for name, t, want in (("x", x, (b, h, p)), ("dt", dt, (b, h, p)), ("A", A, (h, p, n)), ("z", z, (b, h, p)),
                          ("D", D, (h, p)), ("dt_bias", dt_bias, (h, p)),
                          ("state_batch_indices", state_batch_indices, (b,))):
        if t is not None and tuple(t.shape) != want:
            _err(f"selective_state_update: {name} must be {want} for state {tuple(state.shape)}, "
                 f"got {tuple(t.shape)}")
    for name, t in (("B", B), ("C", C)):
        if t.dim() != 3 or t.shape[0] != b or t.shape[2] != n or t.shape[1] < 1 or h % t.shape[1]:
            _err(f"selective_state_update: {name} must be (batch, ngroups, dstate) = ({b}, g, {n}) with "
                 f"{h} heads a multiple of g, got {tuple(t.shape)}")
    if state_batch_indices is None and state.shape[0] != b:
        _err(f"selective_state_update: state holds {state.shape[0]} rows for a batch of {b} "
             "(pass state_batch_indices to pick rows)")
    if A.is_complex():
        _err("complex A is not supported (real-valued Mamba only)")


def _one_per_head(t, dims):
    """t's values along `dims` as one number (the first), or None when they differ."""
    first = t
    for d in dims:
        first = first.narrow(d, 0, 1)
    if all(t.stride(d) == 0 or t.shape[d] == 1 for d in dims) or torch.equal(t, first.expand_as(t)):
        return first.reshape([s for i, s in enumerate(t.shape) if i not in dims])
    return None


def _with_rows(step, state, state_batch_indices, *args):
    if state_batch_indices is None:
        return step(state, *args)
    idx = state_batch_indices.long()
    rows = state[idx]
    out = step(rows, *args)
    state[idx] = rows
    return out


def selective_state_update_heads_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                     state_batch_indices=None):
    """mamba_ssm's `selective_state_update_ref` for the per-head form, every element its own
    dt and A: state <- exp(dt A) state + dt x B^T; y = state C + D x; y *= silu(z). Float32
    arithmetic (float64 for a float64 state); the state updated in place, y in x's dtype."""
    check_heads(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)

    def step(S, x, dt, A, B, C, D, z, dt_bias):
        ct = compute_dtype(S.dtype)
        h, g = S.shape[1], B.shape[1]
        d = dt.to(ct) if dt_bias is None else dt.to(ct) + dt_bias.to(ct)
        d = F.softplus(d) if dt_softplus else d
        Bh = B.to(ct).repeat_interleave(h // g, dim=1)[:, :, None]          # (b, h, 1, n)
        Ch = C.to(ct).repeat_interleave(h // g, dim=1)
        new = torch.exp(d[..., None] * A.to(ct)) * S.to(ct) + (d * x.to(ct))[..., None] * Bh
        S.copy_(new)
        y = torch.einsum("bhpn,bhn->bhp", new, Ch)
        if D is not None:
            y = y + x.to(ct) * D.to(ct)
        if z is not None:
            y = y * F.silu(z.to(ct))
        return y.to(x.dtype)
    return _with_rows(step, state, state_batch_indices, x, dt, A, B, C, D, z, dt_bias)


def selective_state_update_heads(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                 state_batch_indices=None):
    """mamba_ssm's per-head `selective_state_update` (module docstring): sonata's fused
    `ssd_step` when A, dt and dt_bias hold one number per head, the reference otherwise."""
    check_heads(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    a = _one_per_head(A, (1, 2))
    d = _one_per_head(dt, (2,))
    bias = None if dt_bias is None else _one_per_head(dt_bias, (1,))
    if a is None or d is None or (dt_bias is not None and bias is None):
        return selective_state_update_heads_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                                state_batch_indices)
    args = [x, d, a, B, C, None if D is None else (D[:, 0] if D.stride(1) == 0 else D), z, bias]
    if not torch.is_grad_enabled():
        # views of parameters keep requires_grad under no_grad, which would send ssd_step to its
        # autograd-friendly torch form: with grad mode off nothing is recorded, so detach them
        args = [None if t is None else t.detach() for t in args]

    def step(S, *args):
        return ssd_step(S, *args, dt_softplus=dt_softplus)
    return _with_rows(step, state, state_batch_indices, *args)


# --------------------------------------------------------------------------- gated norms

def _check_norm(x, weight, group_size):
    d = x.shape[-1]
    g = d if group_size is None else int(group_size)
    if weight.shape != (d,) or g < 1 or d % g:
        _err(f"norm: weight {tuple(weight.shape)} and group_size {group_size} do not fit {d} channels")
    return d, g


def rms_norm_ref(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True, upcast=True):
    """mamba_ssm's `layernorm_gated.rms_norm_ref`: with z, norm(x) * silu(z) (norm_before_gate)
    or norm(x * silu(z)); norm(v) = v / rms over each group of group_size channels (None: all)
    * weight (+ bias). Float32 arithmetic (float64 inputs stay float64), out in x's dtype."""
    return layer_norm_ref(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm=True)


def layer_norm_ref(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True,
                   is_rms_norm=False):
    """The gated (grouped) LayerNorm, or RMSNorm with is_rms_norm, in plain torch ops."""
    d, g = _check_norm(x, weight, group_size)
    ct = compute_dtype(x.dtype)
    v = x.to(ct)
    gate = None if z is None else F.silu(z.to(ct))
    if gate is not None and not norm_before_gate:
        v = v * gate
    vg = v.reshape(*v.shape[:-1], d // g, g)
    if not is_rms_norm:
        vg = vg - vg.mean(-1, keepdim=True)
    out = (vg / torch.sqrt(vg.square().mean(-1, keepdim=True) + eps)).reshape(v.shape) * weight.to(ct)
    if bias is not None:
        out = out + bias.to(ct)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)


def layernorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False):
    """mamba_ssm's `layernorm_fn`. The RMSNorm form without bias runs sonata's gated, grouped
    RMSNorm (`sonata.kernels.rms_norm_gated`, fused on CPU); the LayerNorm form and a bias run
    `layer_norm_ref`."""
    if not is_rms_norm or bias is not None:
        return layer_norm_ref(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm)
    _, g = _check_norm(x, weight, group_size)
    return rms_norm_gated(x, weight, z, eps, g, norm_before_gate)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """mamba_ssm's `rmsnorm_fn` (see `layernorm_fn`)."""
    return layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm=True)


class RMSNorm(nn.Module):
    """mamba_ssm's `layernorm_gated.RMSNorm(hidden_size, eps=1e-5, group_size=None,
    norm_before_gate=True)`: forward(x, z=None) is `rmsnorm_fn` with its weight (ones at start)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return rmsnorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                          norm_before_gate=self.norm_before_gate)


class LayerNorm(RMSNorm):
    """mamba_ssm's `layernorm_gated.LayerNorm`: the same with a bias (zeros at start) and the
    mean taken out."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__(hidden_size, eps, group_size, norm_before_gate, device, dtype)
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def reset_parameters(self):
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x, z=None):
        return layernorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                            norm_before_gate=self.norm_before_gate)


__all__ = ["causal_conv", "mamba_chunk_scan_combined", "mamba_chunk_scan_combined_ref",
           "mamba_split_conv1d_scan_combined", "mamba_split_conv1d_scan_ref", "selective_state_update_heads",
           "selective_state_update_heads_ref", "check_heads", "rms_norm_ref", "layer_norm_ref", "layernorm_fn",
           "rmsnorm_fn", "RMSNorm", "LayerNorm"]
