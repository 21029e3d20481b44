"""Decoding for transformers' Mamba-2 hybrids on sonata's fused SSD step: `HybridDecoder`.

Bamba (`BambaForCausalLM`) and Granite 4.0-H (`GraniteMoeHybridForCausalLM`) mix Mamba-2
layers with attention layers and put an MLP (Bamba) or a mixture of experts beside a shared
MLP (Granite) after each. transformers' `generate` decodes them one token at a time through
every module's Python forward, the hybrid cache's bookkeeping and the generation loop: at a
small width that overhead, not the arithmetic, is what a token costs, and sonata's Mamba-2
ops alone (the shim) change little of it. `HybridDecoder` reads the model's own weights (no
copy) and runs one step per token as a handful of torch calls per layer:

- a Mamba-2 layer: RMSNorm, in_proj, the conv as a ring buffer (taps rotated to the write
  position), the fused `ssd_step` (decay, state update, C read-out, D skip, the silu(gate)),
  the grouped RMSNorm and out_proj (`Mamba2Step`, shared with sonata's own `Mamba2Decoder`);
- an attention layer: q, k, v projections, the rotary embedding at the token's position
  (Bamba; Granite's `position_embedding_type="rope"`, none otherwise), keys and values
  appended to buffers that double when full, `scaled_dot_product_attention` over the
  grouped heads with the model's scale, o_proj;
- the feed-forward: Bamba's gated MLP; Granite's router (top-k of the logits, softmax over
  those), the chosen experts' gated MLPs weighted, and the shared MLP; Granite's embedding,
  residual and logits multipliers.

The prompt runs through the model's own forward (with the shim installed, on sonata's
chunked SSD), and its cache (conv windows, SSM states, keys and values) seeds the buffers.
`hybrid_supported(model)` says which models it mirrors: float32 on the CPU, silu, the
default rotary embedding, `time_step_limit` (0, inf); anything else stays on transformers'
loop. The tests compare every step's logits and the generated ids with transformers' own.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from sonata.kernels.ssd import ssd_step
from sonata.model.decode import ONE_THREAD_MACS

HYBRIDS = ("BambaForCausalLM", "GraniteMoeHybridForCausalLM")
KV_CAPACITY = 256    # positions of an attention layer's first key/value buffers (they double when full)


@contextlib.contextmanager
def small_step_threads(macs: int):
    """One torch thread while a step's largest projection is small (sonata's decoders' rule:
    an OpenMP pool waiting between tiny ops costs more than it saves), else torch's count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1 if macs < ONE_THREAD_MACS else n)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _w(t):
    return None if t is None else t.detach()


class Mamba2Step:
    """One Mamba-2 mixer's decoding step and its states. Weights in nn.Linear layout
    (out, in); `conv_w` (conv_dim, k); A the (negative) decays per head."""

    def __init__(self, batch, *, in_w, in_b, conv_w, conv_b, A, D, dt_bias, norm_w, norm_eps, ngroups, headdim,
                 d_state, out_w, out_b, dt_limit=(0.0, math.inf)):
        cd, k = conv_w.shape
        self.k, self.b = k, batch
        self.nh, self.p, self.g, self.n = A.shape[0], headdim, ngroups, d_state
        self.di = self.nh * headdim
        self.in_w, self.in_b, self.out_w, self.out_b = in_w, in_b, out_w, out_b
        self.conv_w = torch.stack([torch.stack([conv_w[:, k - 1 - ((s - j) % k)] for j in range(k)])
                                   for s in range(k)])                     # (k slots, k, cd)
        self.conv_b, self.A, self.D, self.dt_b, self.dt_limit = conv_b, A, D, dt_bias, dt_limit
        self.gnorm = (norm_w.view(ngroups, self.di // ngroups), norm_eps)
        new = in_w.new_zeros
        self.conv, self.ssm = new(batch, k, cd), new(batch, self.nh, headdim, d_state)
        self.zx = new(batch, in_w.shape[0])
        self.tmp, self.xc, self.sg = new(batch, k, cd), new(batch, cd), new(batch, cd)

    def load(self, conv, ssm):
        """States after a prompt: conv (b, conv_dim, k), oldest input first; ssm (b, h, p, n)."""
        self.conv.copy_(conv.transpose(1, 2))                               # newest in slot k-1
        self.ssm.copy_(ssm)

    def __call__(self, u, slot):
        """u (b, d), the normalised input, -> the mixer's output (b, d). `slot`: the conv
        buffer's write position (the caller's step count mod k, 0 right after `load`)."""
        b, di, nh, p, g, n = self.b, self.di, self.nh, self.p, self.g, self.n
        zx = torch.mm(u, self.in_w.t(), out=self.zx) if self.in_b is None else \
            torch.addmm(self.in_b, u, self.in_w.t(), out=self.zx)
        z, xBC, dt = zx[:, :di], zx[:, di:-nh], zx[:, -nh:]
        self.conv[:, slot].copy_(xBC)
        torch.mul(self.conv, self.conv_w[slot], out=self.tmp)
        xc = torch.sum(self.tmp, 1, out=self.xc)
        if self.conv_b is not None:
            xc.add_(self.conv_b)
        xc.mul_(torch.sigmoid(xc, out=self.sg))                             # silu
        x, B, C = xc[:, :di], xc[:, di:di + g * n], xc[:, di + g * n:]
        y = ssd_step(self.ssm, x.reshape(b, nh, p), dt.contiguous(), self.A, B.reshape(b, g, n),
                     C.reshape(b, g, n), D=self.D, z=z.reshape(b, nh, p), dt_bias=self.dt_b, dt_softplus=True,
                     dt_limit=self.dt_limit)
        w, eps = self.gnorm
        y = F.rms_norm(y.view(b, g, -1), w.shape[1:], eps=eps).mul_(w)     # grouped, after the gate
        return F.linear(y.view(b, di), self.out_w, self.out_b)


def _hf_mamba2_step(m, batch) -> Mamba2Step:
    """Mamba2Step over a transformers Mamba-2 mixer (Bamba's, Granite's, Mamba2's)."""
    return Mamba2Step(batch, in_w=_w(m.in_proj.weight), in_b=_w(m.in_proj.bias), conv_w=_w(m.conv1d.weight)[:, 0, :],
                      conv_b=_w(m.conv1d.bias), A=-torch.exp(_w(m.A_log).float()), D=_w(m.D), dt_bias=_w(m.dt_bias),
                      norm_w=_w(m.norm.weight), norm_eps=m.norm.variance_epsilon, ngroups=m.n_groups,
                      headdim=m.head_dim, d_state=m.ssm_state_size, out_w=_w(m.out_proj.weight),
                      out_b=_w(m.out_proj.bias), dt_limit=tuple(float(v) for v in m.time_step_limit))


class _AttentionStep:
    """One attention layer's decoding step, its keys and values in buffers that double when full."""

    def __init__(self, attn, rope, batch, capacity):
        self.q_w, self.q_b = _w(attn.q_proj.weight), _w(attn.q_proj.bias)
        self.k_w, self.k_b = _w(attn.k_proj.weight), _w(attn.k_proj.bias)
        self.v_w, self.v_b = _w(attn.v_proj.weight), _w(attn.v_proj.bias)
        self.o_w, self.o_b = _w(attn.o_proj.weight), _w(attn.o_proj.bias)
        self.hd, self.scale, self.b = attn.head_dim, float(attn.scaling), batch
        self.nh = self.q_w.shape[0] // self.hd
        self.kvh = self.k_w.shape[0] // self.hd
        self.rope = rope                                  # (inv_freq, attention_scaling) or None
        self.cos = self.sin = self.q_w.new_zeros(0, 0)    # rotary factors by position (_factors)
        self.keys = self.q_w.new_zeros(batch, self.kvh, capacity, self.hd)
        self.values = torch.zeros_like(self.keys)
        self.t = 0

    def load(self, keys, values):
        T = keys.shape[2]
        if T > self.keys.shape[2]:
            self._grow(T)
        self.keys[:, :, :T].copy_(keys)
        self.values[:, :, :T].copy_(values)
        self.t = T

    def _grow(self, need):
        cap = max(need, 2 * self.keys.shape[2])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, :self.t].copy_(old[:, :, :self.t])
            setattr(self, name, new)

    def _factors(self, pos):
        """(cos, sin) at `pos` over the whole head: the rotation is x * cos + x[perm] * sin, with
        x[perm] swapping the rotated part's halves, cos 1 and sin 0 past it and sin's first half
        negated (what rotate_half's sign does: the same products, bit for bit). Rows come from
        tables over the positions that double when passed. The angles are the float32 products
        pos * inv_freq, as the model's rotary module forms them (its matmul has an inner
        dimension of one: the same single products)."""
        if pos >= self.cos.shape[0]:
            inv_freq, scaling = self.rope
            r = 2 * inv_freq.shape[0]
            freqs = torch.arange(max(2 * pos, KV_CAPACITY), dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * scaling, emb.sin() * scaling
            sin[:, :r // 2].neg_()
            rows = cos.shape[0]
            self.cos = torch.cat((cos, cos.new_ones(rows, self.hd - r)), dim=-1)
            self.sin = torch.cat((sin, sin.new_zeros(rows, self.hd - r)), dim=-1)
            self.perm = torch.cat((torch.arange(r // 2, r), torch.arange(r // 2), torch.arange(r, self.hd)))
        return self.cos[pos], self.sin[pos]

    def _rotate(self, x, cos, sin):
        return x * cos + x.index_select(-1, self.perm) * sin

    def __call__(self, u, pos):
        b, hd = self.b, self.hd
        q = F.linear(u, self.q_w, self.q_b).view(b, self.nh, 1, hd)
        k = F.linear(u, self.k_w, self.k_b).view(b, self.kvh, 1, hd)
        v = F.linear(u, self.v_w, self.v_b).view(b, self.kvh, 1, hd)
        if self.rope is not None:
            cos, sin = self._factors(pos)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if self.t == self.keys.shape[2]:
            self._grow(self.t + 1)
        self.keys[:, :, self.t].copy_(k[:, :, 0])
        self.values[:, :, self.t].copy_(v[:, :, 0])
        self.t += 1
        o = F.scaled_dot_product_attention(q, self.keys[:, :, :self.t], self.values[:, :, :self.t],
                                           scale=self.scale, enable_gqa=self.kvh != self.nh)
        return F.linear(o.reshape(b, self.nh * hd), self.o_w, self.o_b)


class _GatedMLP:
    """down(silu(gate(x)) * up(x)): Bamba's MLP (gate_proj, up_proj) or Granite's shared MLP
    (input_linear holding gate then up)."""

    def __init__(self, mlp):
        if hasattr(mlp, "gate_proj"):
            self.parts = [(_w(mlp.gate_proj.weight), _w(mlp.gate_proj.bias)), (_w(mlp.up_proj.weight), _w(mlp.up_proj.bias))]
            self.down = (_w(mlp.down_proj.weight), _w(mlp.down_proj.bias))
        else:
            w = _w(mlp.input_linear.weight)
            half = w.shape[0] // 2
            self.parts = [(w[:half], None), (w[half:], None)]
            self.down = (_w(mlp.output_linear.weight), None)

    def __call__(self, u):
        (gw, gb), (uw, ub) = self.parts
        return F.linear(F.silu(F.linear(u, gw, gb)) * F.linear(u, uw, ub), *self.down)


class _MoE:
    """Granite's mixture of experts for a few rows: the router's top-k logits, softmax over
    them, each chosen expert's gated MLP weighted (experts in the router's order per row)."""

    def __init__(self, moe):
        self.router = _w(moe.router.weight)
        self.top_k = moe.router.top_k
        self.gate_up, self.down = _w(moe.experts.gate_up_proj), _w(moe.experts.down_proj)

    def __call__(self, u):
        logits = F.linear(u, self.router).float()
        top, idx = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).type_as(u)
        out = torch.zeros_like(u)
        half = self.gate_up.shape[1] // 2
        for row, (experts, ws) in enumerate(zip(idx.tolist(), weights)):
            x = u[row:row + 1]
            for j, e in enumerate(experts):
                gu = F.linear(x, self.gate_up[e])
                h = F.silu(gu[:, :half]) * gu[:, half:]
                out[row:row + 1].add_(F.linear(h, self.down[e]) * ws[j])
        return out


def _rope(model):
    """(inv_freq, attention_scaling) of the model's default rotary embedding, None without one,
    or False where it is another kind (then the decoder does not apply)."""
    rot = getattr(model.model, "rotary_emb", None)
    if rot is None:
        return None
    if getattr(rot, "rope_type", "default") != "default":
        return False
    return rot.inv_freq.detach().float(), float(rot.attention_scaling)


def hybrid_supported(model) -> bool:
    """Whether `HybridDecoder` mirrors `model` (see the module docstring)."""
    if type(model).__name__ not in HYBRIDS or getattr(model, "lm_head", None) is None:
        return False
    if not all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters()):
        return False
    conf = model.config
    if conf.hidden_act not in ("silu", "swish") or _rope(model) is False:
        return False
    for layer in model.model.layers:
        m = getattr(layer, "mamba", None)
        if m is not None and (tuple(float(v) for v in m.time_step_limit) != (0.0, math.inf)
                              or m.activation not in ("silu", "swish")):
            return False
        if m is None and getattr(layer, "self_attn", None) is None:
            return False
    return True


class HybridDecoder:
    """sonata's decoder for a Bamba or GraniteMoeHybrid model (`hybrid_supported`): `prefill`
    (the prompt through the model's own forward, its cache into the buffers) -> the last
    logits (b, vocab); `step(ids)` -> the next logits."""

    def __init__(self, model, batch: int):
        conf, inner = model.config, model.model
        self.model, self.b = model, batch
        self.emb = _w(inner.embed_tokens.weight)
        self.emb_mult = float(getattr(conf, "embedding_multiplier", 1.0) or 1.0)
        self.res_mult = float(getattr(conf, "residual_multiplier", 1.0) or 1.0)
        self.logit_scale = float(getattr(conf, "logits_scaling", 1.0) or 1.0)
        norm_f = getattr(inner, "final_layernorm", None) or inner.norm
        self.norm_f = (_w(norm_f.weight), norm_f.variance_epsilon)
        self.head = _w(model.lm_head.weight)
        rope = _rope(model)
        self.layers = []
        for layer in inner.layers:
            m = getattr(layer, "mamba", None)
            mixer = _hf_mamba2_step(m, batch) if m is not None else _AttentionStep(layer.self_attn, rope, batch, KV_CAPACITY)
            post = getattr(layer, "pre_ff_layernorm", None) or layer.post_attention_layernorm
            if hasattr(layer, "feed_forward"):
                ffn, moe = _GatedMLP(layer.feed_forward), None
            else:
                ffn = _GatedMLP(layer.shared_mlp)
                moe = _MoE(layer.block_sparse_moe) if getattr(layer, "has_experts", True) else None
            self.layers.append(((_w(layer.input_layernorm.weight), layer.input_layernorm.variance_epsilon),
                                mixer, (_w(post.weight), post.variance_epsilon), ffn, moe))
        self.k = next((mx.k for _, mx, *_ in self.layers if isinstance(mx, Mamba2Step)), 1)
        self.pos = self.slot = 0
        d = self.emb.shape[1]
        self.h = self.emb.new_zeros(batch, d)
        widest = max([self.head.shape[0]] + [mx.in_w.shape[0] for _, mx, *_ in self.layers if isinstance(mx, Mamba2Step)])
        self.macs = batch * d * widest

    def threads(self):
        return small_step_threads(self.macs)

    @torch.inference_mode()
    def prefill(self, prompt) -> torch.Tensor:
        out = self.model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache = out.get("cache", None) or out.get("past_key_values", None)
        for i, (_, mixer, *_) in enumerate(self.layers):
            if isinstance(mixer, Mamba2Step):
                mixer.load(cache.get_conv_state(i), cache.get_recurrent_state(i))
            else:
                mixer.load(cache.layers[i].keys, cache.layers[i].values)
        self.pos, self.slot = prompt.shape[1], 0
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def step(self, idx) -> torch.Tensor:
        h = torch.index_select(self.emb, 0, idx, out=self.h)
        if self.emb_mult != 1.0:
            h.mul_(self.emb_mult)
        for (nw, neps), mixer, (pw, peps), ffn, moe in self.layers:
            u = F.rms_norm(h, h.shape[1:], nw, neps)
            out = mixer(u, self.slot) if isinstance(mixer, Mamba2Step) else mixer(u, self.pos)
            h.add_(out, alpha=self.res_mult)
            u = F.rms_norm(h, h.shape[1:], pw, peps)
            out = ffn(u)
            if moe is not None:
                out = moe(u).add_(out)
            h.add_(out, alpha=self.res_mult)
        self.pos += 1
        self.slot = (self.slot + 1) % self.k
        logits = F.linear(F.rms_norm(h, h.shape[1:], *self.norm_f), self.head)
        return logits.div_(self.logit_scale) if self.logit_scale != 1.0 else logits


__all__ = ["HYBRIDS", "HybridDecoder", "Mamba2Step", "hybrid_supported", "small_step_threads"]
