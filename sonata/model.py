"""The language model: pre-norm residual blocks and tied embeddings, one of three
architectures (`ModelConfig.arch`):

- `mamba`: Mamba-1 blocks (the default). Names mirror state-spaces/mamba (in_proj, conv1d,
  x_proj, dt_proj, A_log, D, out_proj) so readers can move between codebases.
- `lti`: the time-invariant ablation of the Mamba paper (its S4-in-a-Mamba-block row): the
  same block, but delta, B and C are learned parameters instead of functions of the input
  (delta per channel, B and C shared by the channels, as Mamba's B_t and C_t are).
- `attention`: a causal multi-head attention baseline with rotary position embeddings
  (`torch.nn.functional.scaled_dot_product_attention`) and a GELU MLP, the same width.

The scan runs through `sonata.kernels.selective_scan` with the backend of
`ModelConfig.backend`. Every block's forward can take and return its recurrent state (the
convolution window and the scan's state; attention: its keys and values so far), so a long
sequence runs chunk by chunk and gives what one pass gives: `logits, state = model(ids,
state, return_state=True)`. Generation (Mamba) runs the same recurrence one token at a time
(O(1) per token): `step` is the plain version, `sonata.decode.Decoder` the fast one
(preallocated buffers), after `prefill` has consumed the prompt in one parallel pass. int8
lives in `sonata.quant`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.config import Config, ModelConfig
from sonata import decode
from sonata.kernels import conv_silu, rms_norm, selective_scan
from sonata.kernels.reference import project_delta, step as scan_step
from sonata.quant import QLinear


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension; fused on the `cpu` backend."""

    def __init__(self, d: int, eps: float = 1e-5, backend: str = "reference"):
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, backend=self.backend)


class MambaMixer(nn.Module):
    """The selective SSM layer: in_proj -> conv -> SiLU -> scan (gated by z) -> out_proj, with
    delta, B and C computed from the input (`_selection`; `LTIMixer` makes them parameters)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, di, n = cfg.d_model, cfg.d_inner, cfg.d_state
        self.cfg = cfg
        self.in_proj = QLinear(d, 2 * di, bias=False)
        self.conv1d = nn.Conv1d(di, di, cfg.d_conv, groups=di, padding=cfg.d_conv - 1, bias=True)
        self._init_selection(cfg)
        a_init = torch.arange(1, n + 1, dtype=torch.float32).repeat(di, 1)   # (di, n): S4D-real
        if cfg.a_param == "log":
            self.A_log = nn.Parameter(torch.log(a_init))
        else:
            self.A_param = nn.Parameter(-a_init)
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = QLinear(di, d, bias=False)
        self._init_dt(cfg)      # last: the random draws keep the order of earlier versions

    def _init_selection(self, cfg: ModelConfig) -> None:
        r, n = cfg.dt_rank_, cfg.d_state
        self.x_proj = QLinear(cfg.d_inner, r + 2 * n, bias=False)
        self.dt_proj = QLinear(r, cfg.d_inner, bias=True)

    def _init_dt(self, cfg: ModelConfig) -> None:
        r = cfg.dt_rank_
        nn.init.uniform_(self.dt_proj.weight, -r ** -0.5, r ** -0.5)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt_bias_init(cfg))

    @property
    def delta_bias(self) -> torch.Tensor:
        return self.dt_proj.bias

    @property
    def A(self) -> torch.Tensor:
        if self.cfg.a_param == "log":
            return -torch.exp(self.A_log.float())                       # (di, n), always < 0
        return self.A_param.float()                                     # may cross 0 unless constrained

    @torch.no_grad()
    def constrain_A(self, a_min: float) -> None:
        """Project A so that every decay exp(delta*A) < 1: A <= -a_min."""
        if self.cfg.a_param == "direct":
            self.A_param.clamp_(max=-a_min)
        else:
            self.A_log.clamp_(min=math.log(a_min))

    def _x_proj(self, x):
        """x (b, L, di) after conv+SiLU -> dt (b, L, r), B, C (b, L, n): views of x_proj's output."""
        r, n = self.cfg.dt_rank_, self.cfg.d_state
        return self.x_proj(x).split([r, n, n], dim=-1)

    def _selection(self, x):
        """x (b, L, di) after conv+SiLU -> (delta, B, C, delta_proj) as `selective_scan` takes
        them: delta is dt_proj's (b, L, r) input and delta_proj its weight (the scan projects);
        B, C (b, n, L) transposed views."""
        dt, B, C = self._x_proj(x)
        return dt, B.transpose(1, 2), C.transpose(1, 2), self.dt_proj.weight

    def _ssm_inputs(self, x):
        """x (b, L, di) after conv+SiLU -> delta (b, di, L) before bias and softplus, B, C (b, n, L)."""
        delta, B, C, proj = self._selection(x)
        return (delta if proj is None else project_delta(delta, proj)), B, C

    def _scan(self, x, z, **state):
        """The scan of x (b, di, L) after conv+SiLU, gated by z (b, di, L)."""
        delta, B, C, proj = self._selection(x.transpose(1, 2))
        return selective_scan(x, delta, self.A, B, C, self.D.float(), z=z,
                              delta_bias=self.delta_bias.float(), delta_softplus=True,
                              backend=self.cfg.backend, delta_proj=proj, **state)

    def forward(self, h, state=None, return_state: bool = False):       # h (b, L, d)
        """-> out (b, L, d); with `return_state` (or a `state` to continue from) -> (out, state),
        state = (the last d_conv inputs of the convolution (b, di, d_conv), newest last; the
        scan's state (b, di, n))."""
        if state is not None or return_state:
            return self._forward_with_state(h, state)
        # The projections work in (b, L, channels); the convolution and the scan in (b, di, L).
        # Each gets a transposed view of the other's output. On the cpu backend x, the scan's
        # output and their gradients stay in the projections' layout (the kernels read and
        # write it in place: no transposed copies), the fused conv hands the gate z on in the
        # scan's layout, and the scan computes delta from dt_proj's low-rank input itself
        # (`delta_proj`: no (b, di, L) delta is stored or transposed); other backends run
        # dt_proj as a matmul first (kernels/__init__.py).
        x, z = conv_silu(self.in_proj(h), self.conv1d.weight, self.conv1d.bias,
                         self.cfg.backend)                              # (b, L, di) views
        y = self._scan(x.transpose(1, 2), z.transpose(1, 2))           # (b, di, L) view
        return self.out_proj(y.transpose(1, 2))

    def _forward_with_state(self, h, state):
        """The layer over h (b, L, d) continuing from `state` (None: zeros), and its new state.
        The convolution reads the previous chunk's last d_conv - 1 inputs before this one's."""
        cfg, di = self.cfg, self.cfg.d_inner
        conv_state, ssm_state = state if state is not None else self.empty_state(h.shape[0], h.device, h.dtype)
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)         # (b, di, L) each
        xs = torch.cat([conv_state.to(x.dtype), x], dim=-1)            # (b, di, d_conv + L)
        x = F.silu(F.conv1d(xs[..., 1:], self.conv1d.weight, self.conv1d.bias, groups=di))
        y, last = self._scan(x, z.contiguous(), return_last_state=True, initial_state=ssm_state)
        return self.out_proj(y.transpose(1, 2)), (xs[..., -cfg.d_conv:].contiguous(), last)

    def empty_state(self, batch: int, device, dtype=torch.float32):
        di = self.cfg.d_inner
        return (torch.zeros(batch, di, self.cfg.d_conv, device=device, dtype=dtype),      # conv window
                torch.zeros(batch, di, self.cfg.d_state, device=device, dtype=torch.float32))  # ssm

    def step(self, h, state):                                           # h (b, d)
        conv_state, ssm_state = state
        x, z = self.in_proj(h).chunk(2, dim=-1)                         # (b, di)
        conv_state = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], dim=-1)
        x = F.silu((conv_state * self.conv1d.weight.squeeze(1)).sum(-1) + self.conv1d.bias)
        delta, B, C = self._ssm_inputs(x.unsqueeze(1))                  # (b, di, 1), (b, n, 1)
        y, ssm_state = scan_step(ssm_state, x, delta[..., 0], self.A, B[..., 0], C[..., 0],
                                 self.D, z=z, delta_bias=self.delta_bias, delta_softplus=True)
        return self.out_proj(y), (conv_state, ssm_state)

    def prefill(self, h):                                               # h (b, L, d)
        """The layer over a whole prompt in one parallel pass, and the state `step` continues
        from: the last d_conv inputs of the convolution (zero-padded on the left) and the scan's
        last state."""
        return self._forward_with_state(h, None)


class LTIMixer(MambaMixer):
    """The time-invariant ablation: MambaMixer with delta, B and C learned parameters that do
    not depend on the input. delta = softplus(dt_bias) per channel (initialized as Mamba's
    bias), B and C (n,) shared by the channels, like Mamba's B_t and C_t but the same at every
    step. The scan, the convolution and the gate are Mamba's."""

    def _init_selection(self, cfg: ModelConfig) -> None:
        n = cfg.d_state
        self.dt_bias = nn.Parameter(torch.empty(cfg.d_inner))
        self.B = nn.Parameter(torch.empty(n))
        self.C = nn.Parameter(torch.empty(n))

    def _init_dt(self, cfg: ModelConfig) -> None:
        with torch.no_grad():
            self.dt_bias.copy_(dt_bias_init(cfg))
            self.B.normal_()
            self.C.normal_(std=cfg.d_state ** -0.5)

    @property
    def delta_bias(self) -> torch.Tensor:
        return self.dt_bias

    def _selection(self, x):
        b, L, _ = x.shape
        n = self.cfg.d_state
        delta = x.new_zeros(()).expand(b, self.cfg.d_inner, L)          # the bias is all of it
        return (delta, self.B[None, :, None].expand(b, n, L).to(x.dtype),
                self.C[None, :, None].expand(b, n, L).to(x.dtype), None)


def dt_bias_init(cfg: ModelConfig) -> torch.Tensor:
    """softplus^-1(dt) with dt log-uniform in [dt_min, dt_max] (at least dt_init_floor), per channel."""
    dt = torch.exp(torch.rand(cfg.d_inner) * (math.log(cfg.dt_max) - math.log(cfg.dt_min))
                   + math.log(cfg.dt_min)).clamp(min=cfg.dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))


def rotary(x, t0: int):
    """Rotary position embedding of x (b, heads, L, hd) at positions t0 .. t0 + L - 1 (pairs
    (i, i + hd/2) rotated by position * 10000^(-2i/hd); angles in float64, so positions in the
    millions keep their precision)."""
    L, hd = x.shape[2], x.shape[3]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd)
    ang = torch.arange(t0, t0 + L, dtype=torch.float64, device=x.device)[:, None] * inv   # (L, hd/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary positions. Its state is the keys and
    values so far ((b, heads, T, hd) each): a chunk attends to them and to itself."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.heads = cfg.d_model, cfg.n_heads
        self.qkv = QLinear(d, 3 * d, bias=False)
        self.out_proj = QLinear(d, d, bias=False)

    def forward(self, h, state=None, return_state: bool = False):      # h (b, L, d)
        b, L, d = h.shape
        q, k, v = self.qkv(h).view(b, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        t0 = 0 if state is None else state[0].shape[2]
        q, k = rotary(q, t0), rotary(k, t0)                              # (b, heads, L, hd)
        if state is not None:
            k, v = torch.cat([state[0], k], dim=2), torch.cat([state[1], v], dim=2)
        if t0:   # the chunk's queries see every earlier key and their own causal part
            mask = torch.arange(t0, t0 + L, device=h.device)[:, None] >= torch.arange(t0 + L, device=h.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.out_proj(y.transpose(1, 2).reshape(b, L, d))
        return (y, (k, v)) if return_state or state is not None else y


class MambaBlock(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h)); the mixer is Mamba's or the time-invariant one."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, backend=cfg.backend)
        self.mixer = (LTIMixer if cfg.arch == "lti" else MambaMixer)(cfg)

    def forward(self, h, state=None, return_state: bool = False):
        if state is None and not return_state:
            return h + self.mixer(self.norm(h))
        y, state = self.mixer(self.norm(h), state, return_state=True)
        return h + y, state

    def step(self, h, state):
        y, state = self.mixer.step(self.norm(h), state)
        return h + y, state

    def prefill(self, h):
        y, state = self.mixer.prefill(self.norm(h))
        return h + y, state


class AttentionBlock(nn.Module):
    """Pre-norm transformer block: h + attn(norm(h)), then h + mlp(norm(h)) (GELU, 4x wide)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.norm = RMSNorm(d, cfg.norm_eps, backend=cfg.backend)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = RMSNorm(d, cfg.norm_eps, backend=cfg.backend)
        self.mlp = nn.Sequential(QLinear(d, 4 * d, bias=False), nn.GELU(), QLinear(4 * d, d, bias=False))

    def forward(self, h, state=None, return_state: bool = False):
        if state is None and not return_state:
            h = h + self.attn(self.norm(h))
            return h + self.mlp(self.norm2(h))
        y, state = self.attn(self.norm(h), state, return_state=True)
        h = h + y
        return h + self.mlp(self.norm2(h)), state


class MambaLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the vocabulary) before building")
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        block = AttentionBlock if cfg.arch == "attention" else MambaBlock
        self.layers = nn.ModuleList(block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, backend=cfg.backend)
        self.lm_head = QLinear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight                     # tied
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.normal_(self.embedding.weight, std=0.02)
        for layer in self.layers:
            # GPT-2 style rescale of the residual output projections by 1/sqrt(n_layers)
            outs = ([layer.attn.out_proj, layer.mlp[2]] if isinstance(layer, AttentionBlock)
                    else [layer.mixer.out_proj])
            for out in outs:
                nn.init.kaiming_uniform_(out.weight, a=math.sqrt(5))
                with torch.no_grad():
                    out.weight /= math.sqrt(self.cfg.n_layers)

    def forward(self, idx, state=None, return_state: bool = False):   # idx (b, L)
        """-> logits (b, L, vocab); with `return_state` (or a `state`, the list a previous
        call returned) -> (logits, state): the next call continues the sequence, so a long one
        runs chunk by chunk in bounded memory (attention's state grows with the sequence)."""
        h = self.embedding(idx)
        if state is None and not return_state:
            for layer in self.layers:
                h = layer(h)
            return self.lm_head(self.norm_f(h))                         # (b, L, vocab)
        new = []
        for layer, s in zip(self.layers, state if state is not None else [None] * len(self.layers)):
            h, s = layer(h, s, return_state=True)
            new.append(s)
        return self.lm_head(self.norm_f(h)), new

    def _need_mamba(self, what: str) -> None:
        if self.cfg.arch != "mamba":
            raise ValueError(f"{what} needs model.arch=mamba (this model is {self.cfg.arch!r})")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def step(self, idx, states):
        """One token per sequence: idx (b,) -> logits (b, vocab), new states."""
        self._need_mamba("stepping one token at a time")
        h = self.embedding(idx)
        new = []
        for layer, s in zip(self.layers, states):
            h, s = layer.step(h, s)
            new.append(s)
        return self.lm_head(self.norm_f(h)), new

    def prefill(self, idx):
        """The prompt idx (b, T) in one parallel pass: logits at its last position (b, vocab)
        and the states `step` continues from."""
        self._need_mamba("prefill")
        h, states = self.embedding(idx), []
        for layer in self.layers:
            h, s = layer.prefill(h)
            states.append(s)
        return self.lm_head(self.norm_f(h[:, -1])), states

    def generate(self, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 generator: torch.Generator | None = None, stop_token: int | None = None):
        """Sampling (greedy at temperature <= 0): prompt (b, T) -> (b, T + new) ids
        (`sonata.decode.generate`: a parallel prefill, then the decoder)."""
        self._need_mamba("generation")
        return decode.generate(self, prompt, max_new_tokens, temperature, top_k, generator, stop_token)

    def generate_reference(self, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                           generator: torch.Generator | None = None, stop_token: int | None = None):
        """`generate`'s oracle, token by token (`sonata.decode.generate_reference`)."""
        return decode.generate_reference(self, prompt, max_new_tokens, temperature, top_k, generator, stop_token)


def build_model(cfg: Config) -> nn.Module:
    """The model of a configuration (model.vocab_size set): a MambaLM (mamba, lti, attention
    blocks), or for model.arch=gpt2 transformers' GPT-2 (`sonata.peers.GPT2LM`, context
    data.seq_len), the race's baseline."""
    if cfg.model.arch == "gpt2":
        from sonata.peers import GPT2LM
        return GPT2LM(cfg.model, cfg.data.seq_len)
    return MambaLM(cfg.model)


def param_groups(model: nn.Module, weight_decay: float):
    """AdamW groups: no weight decay on A (A_log or A_param), D, norms, biases; the tied
    embedding/head weight appears once."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim < 2 or leaf in ("A_log", "A_param", "D") or "norm" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def deltas(model: MambaLM, idx) -> list[torch.Tensor]:
    """The step sizes delta = softplus(dt + bias) of every SSM layer of `model` for input idx:
    one (b, d_inner, L) tensor per Mamba (or lti) layer, attention layers skipped. What
    selection is: large delta writes the input into the state, tiny delta keeps it."""
    h, out = model.embedding(idx), []
    for layer in model.layers:
        if isinstance(layer, MambaBlock):
            mix, L = layer.mixer, idx.shape[1]
            x, _ = mix.in_proj(layer.norm(h)).transpose(1, 2).chunk(2, dim=1)
            x = F.silu(mix.conv1d(x)[..., :L])
            delta, _, _ = mix._ssm_inputs(x.transpose(1, 2))
            out.append(F.softplus(delta + mix.delta_bias[:, None]))  # (b, di, L)
        h = layer(h)
    return out


@torch.no_grad()
def max_decay(model: MambaLM, idx) -> float:
    """Largest exp(delta*A) over all layers, channels and positions of `model` for input idx:
    below 1 the recurrence is contracting; above 1 the state can blow up (notebook 05)."""
    worst = 0.0
    mixers = [layer.mixer for layer in model.layers if isinstance(layer, MambaBlock)]
    for mix, dt in zip(mixers, deltas(model, idx)):
        A = mix.A                                                  # (di, n)
        # exp(dt*A) is largest at the largest dt where A > 0 and the smallest where A < 0
        hi = torch.where(A > 0, dt.amax(dim=(0, 2))[:, None] * A, dt.amin(dim=(0, 2))[:, None] * A)
        worst = max(worst, float(torch.exp(hi.max().double())))   # fp64: 1 - 1e-9 is not 1
    return worst
