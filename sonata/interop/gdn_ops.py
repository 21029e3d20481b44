"""fla's gated delta rule ops on sonata's kernels: Qwen3-Next's linear-attention layers on a CPU.

The names, signatures and semantics of flash-linear-attention's (`fla.ops.gated_delta_rule`,
`fla.modules.FusedRMSNormGated`), so that code written against fla runs without a GPU:

    chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, chunk_size=64) -> (o, final_state)
    fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                           initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_gate_in_kernel=False, A_log=None, dt_bias=None,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None) -> (o, final_state)
    FusedRMSNormGated(hidden_size, elementwise_affine=True, eps=1e-5, activation="swish")
        forward(x, g, residual=None, prenorm=False, residual_in_fp32=False): rmsnorm(x) w act(g)

q, k (B, T, H, K), v (B, T, HV, V) with HV a multiple of H, g, beta (B, T, HV), states (N, HV, K,
V) (V-first (N, HV, V, K) with `state_v_first`); o comes back in v's dtype, the final state in
float32 (float64 for float64 inputs), None unless asked for. `cu_seqlens` (N + 1 offsets, batch
1) runs each packed sequence from its own initial state. Both rules run
`sonata.kernels.gdn.gated_delta_rule` (backend "auto": the fused numba forward and backward on
CPU tensors, the chunked PyTorch form elsewhere); a one-token call with no gradient asked for
runs the fused step (`gated_delta_rule_step`) on a copy of the state. Not served (a ValueError
each): fla's per-channel gates `gk` / `gv`, and chunk sizes other than fla's 16, 32, 64 are
accepted (the result does not depend on it).

Two ways to put them under transformers' Qwen3-Next (facts of transformers 5.25, its
integrations/hub_kernels.py): each op is looked up once, when models/qwen3_next's module is
imported, by importing `fla` (the import path `fla.ops.gated_delta_rule`), and then used only for
tensors on the devices `_PACKAGE_SUPPORTED_DEVICES["fla"]` names (cuda, xpu, mlu, npu);
keyword arguments are filtered by the op's signature, so every argument transformers passes is
a named parameter here.

- `install()`, before that module is imported: registers modules `fla`, `fla.ops`,
  `fla.ops.gated_delta_rule` and `fla.modules` holding these ops when fla is NOT installed (a
  real installation always wins), and adds "cpu" to fla's devices in that table.
- `patch(module)`, any time after: replaces the module's own functions (the two delta rules,
  `causal_conv1d_fn` / `causal_conv1d_update`, the gated norm's forward) by adapters onto
  sonata's kernels, the convolution and the norm fused too; `unpatch` restores them. In Qwen3-
  Next's generation on a CPU the depthwise convolution (torch's conv1d) costs more than the
  delta rule, so a layer is only fast with both (benchmarks/gdn.py measures it).
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.interop import shim
from sonata.kernels import causal_conv_silu, rms_norm_gated
from sonata.kernels.gdn import gated_delta_rule, gated_delta_rule_step, l2norm


def _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, state_v_first, use_gate_in_kernel=False, A_log=None, dt_bias=None):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"gated delta rule: q and k must be (B, T, H, K) alike, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if v.dim() != 4 or v.shape[2] % q.shape[2]:
        raise ValueError(f"gated delta rule: v must be (B, T, HV, V) with HV a multiple of H={q.shape[2]}, "
                         f"got {tuple(v.shape)}")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float() if q.dtype in (torch.float16, torch.bfloat16) else q), \
            l2norm(k.float() if k.dtype in (torch.float16, torch.bfloat16) else k)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device)
    elif use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("gated delta rule: use_gate_in_kernel=True needs A_log")
        raw = g.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        g = -torch.exp(A_log.float()) * F.softplus(raw)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    return q, k, g, beta, initial_state


def _segments(cu_seqlens, T):
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"gated delta rule: cu_seqlens must rise from 0 to T={T}, got {bounds}")
    return list(zip(bounds, bounds[1:]))


def _run(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens, chunk_size):
    """The rule over the batch, or over each packed sequence of `cu_seqlens`."""
    if cu_seqlens is None:
        want_state = output_final_state or initial_state is not None
        grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (q, k, v, g, beta, initial_state))
        if v.shape[1] == 1 and initial_state is not None and not grads:           # decoding: the fused step
            S = initial_state.to(torch.float64 if v.dtype == torch.float64 else torch.float32).clone()
            o = gated_delta_rule_step(S, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], scale)[:, None]
        else:
            out = gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   return_final_state=want_state, chunk_size=chunk_size)
            o, S = out if want_state else (out, None)
    else:
        if v.shape[0] != 1:
            raise ValueError(f"gated delta rule: with cu_seqlens the batch must be 1, got {v.shape[0]}")
        segs = _segments(cu_seqlens, v.shape[1])
        if initial_state is not None and initial_state.shape[0] != len(segs):
            raise ValueError(f"gated delta rule: initial_state must hold {len(segs)} states for cu_seqlens, "
                             f"got {initial_state.shape[0]}")
        outs, states = [], []
        for i, (a, b) in enumerate(segs):
            o_i, S_i = gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=scale,
                                        initial_state=None if initial_state is None else initial_state[i:i + 1],
                                        return_final_state=True, chunk_size=chunk_size)
            outs.append(o_i)
            states.append(S_i)
        o = torch.cat(outs, dim=1)
        S = torch.cat(states, dim=0)
    if not output_final_state:
        return o.to(v.dtype), None
    return o.to(v.dtype), (S.transpose(-1, -2) if state_v_first else S)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, chunk_size=64, **kwargs):
    """fla's chunk_gated_delta_rule (module docstring) on sonata's kernels."""
    q, k, g, beta, S0 = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel,
                                 use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first)
    return _run(q, k, v, g, beta, scale, S0, output_final_state, state_v_first, cu_seqlens, int(chunk_size))


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, **kwargs):
    """fla's fused_recurrent_gated_delta_rule (module docstring) on sonata's kernels."""
    if gk is not None or gv is not None:
        raise ValueError("fused_recurrent_gated_delta_rule: per-channel gates gk / gv are not served by sonata")
    if g is None:
        g = torch.zeros(v.shape[:3], dtype=v.dtype, device=v.device)
    q, k, g, beta, S0 = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel,
                                 use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                                 use_gate_in_kernel, A_log, dt_bias)
    return _run(q, k, v, g, beta, scale, S0, output_final_state, state_v_first, cu_seqlens, 64)


def rms_norm_gated_ref(x, g, weight, eps, activation="swish", residual=None, prenorm=False,
                       residual_in_fp32=False):
    """fla's gated RMSNorm, norm first: rmsnorm(x (+ residual)) * weight * act(g), in torch ops."""
    if residual is not None:
        x = x.float() + residual.float() if residual_in_fp32 else x + residual
    res = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    gf = g.float()
    y = (y * (torch.sigmoid(gf) if activation == "sigmoid" else F.silu(gf))).to(x.dtype)
    return (y, res) if prenorm else y


class FusedRMSNormGated(nn.Module):
    """fla.modules.FusedRMSNormGated: rmsnorm(x) * weight * act(g) over the last dimension, act
    swish / silu / sigmoid; sonata's fused norm (`rms_norm_gated`, norm before the gate) for
    swish and silu without a residual, torch ops otherwise."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device=None, dtype=None):
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"Unsupported activation: {activation}")
        self.hidden_size, self.elementwise_affine, self.eps, self.activation = hidden_size, elementwise_affine, eps, \
            activation
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype)) if elementwise_affine else None
        self.register_parameter("bias", None)

    def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is None and self.activation != "sigmoid" and not prenorm:
            w = self.weight if self.weight is not None else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
            return rms_norm_gated(x, w, g, self.eps, None, norm_before_gate=True)
        return rms_norm_gated_ref(x, g, self.weight, self.eps, self.activation, residual, prenorm, residual_in_fp32)


# --------------------------------------------------------------------------- install

_SHIMS = {
    "fla.ops.gated_delta_rule": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "fla.modules": ("FusedRMSNormGated",),
}


def install() -> list[str]:
    """Make `from fla.ops.gated_delta_rule import chunk_gated_delta_rule` (and the other names
    above) resolve to these ops when fla is NOT installed, and let transformers send CPU tensors
    to them (module docstring). Call before transformers imports models/qwen3_next. -> the
    module names set up ([] where a real fla is installed)."""
    if shim.installed("fla"):
        return []
    for name, attrs in _SHIMS.items():
        shim.register(name, attrs, sys.modules[__name__], "sonata.interop.gdn_ops")
    shim.serve_cpu_in_transformers({"fla"})
    return list(_SHIMS)


# --------------------------------------------------------------------------- patch

def hf_chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' torch_chunk_gated_delta_rule's signature on these ops."""
    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  cu_seqlens=kwargs.get("cu_seqlens"), chunk_size=chunk_size)


def hf_recurrent_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' torch_recurrent_gated_delta_rule's signature on these ops."""
    return fused_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                            output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                            cu_seqlens=kwargs.get("cu_seqlens"))


def causal_conv1d_fn(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    """The depthwise causal convolution x (B, D, T) with weight (D, K) -> (B, D, T), silu when
    asked: sonata's fused kernel for silu without packed sequences, torch's conv1d otherwise."""
    if activation in ("silu", "swish") and seq_idx is None:
        return causal_conv_silu(x.transpose(1, 2), weight.unsqueeze(1), bias).transpose(1, 2)
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=x.shape[1])[..., :x.shape[-1]]
    return (F.silu(out) if activation in ("silu", "swish") else out).to(x.dtype)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **kwargs):
    """One convolution step per token of x (B, D, T): conv_state (B, D, K) shifted in place."""
    outs = []
    for t in range(x.shape[-1]):
        conv_state.copy_(torch.cat([conv_state[..., 1:], x[..., t:t + 1].to(conv_state.dtype)], dim=-1))
        y = (conv_state * weight).sum(-1)
        if bias is not None:
            y = y + bias
        outs.append(F.silu(y) if activation in ("silu", "swish") else y)
    return torch.stack(outs, dim=-1).to(x.dtype)


def _norm_forward(self, hidden_states, gate):
    return rms_norm_gated(hidden_states, self.weight, gate, self.variance_epsilon, None, norm_before_gate=True)


_PATCHED = "__sonata_gdn_originals__"


def patch(module=None):
    """Serve an imported transformers modeling module (default: models.qwen3_next's) by these ops:
    its delta rules, its causal convolutions and its gated norm's forward are replaced (the
    module's own functions, which its layers call by name). Idempotent; `unpatch` restores.
    -> the module."""
    if module is None:
        from transformers.models.qwen3_next import modeling_qwen3_next as module
    if getattr(module, _PATCHED, None) is not None:
        return module
    names = {"torch_chunk_gated_delta_rule": hf_chunk_rule, "torch_recurrent_gated_delta_rule": hf_recurrent_rule,
             "causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update}
    originals = {n: getattr(module, n) for n in names if hasattr(module, n)}
    for n in originals:
        setattr(module, n, names[n])
    norms = [c for n, c in vars(module).items() if n.endswith("RMSNormGated") and isinstance(c, type)]
    originals["__norms__"] = [(c, c.__dict__["forward"]) for c in norms if "forward" in c.__dict__]
    for c, _ in originals["__norms__"]:
        c.forward = _norm_forward
    setattr(module, _PATCHED, originals)
    return module


def unpatch(module=None):
    """Undo `patch` on the module."""
    if module is None:
        from transformers.models.qwen3_next import modeling_qwen3_next as module
    originals = getattr(module, _PATCHED, None)
    if originals is None:
        return module
    for c, fwd in originals.pop("__norms__"):
        c.forward = fwd
    for n, f in originals.items():
        setattr(module, n, f)
    setattr(module, _PATCHED, None)
    return module


__all__ = ["FusedRMSNormGated", "causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule",
           "fused_recurrent_gated_delta_rule", "hf_chunk_rule", "hf_recurrent_rule", "install", "patch",
           "rms_norm_gated_ref", "unpatch"]
