"""The Mamba language model: pre-norm residual Mamba-1 blocks and tied embeddings.

Names mirror state-spaces/mamba (in_proj, conv1d, x_proj, dt_proj, A_log, D,
out_proj) so readers can move between codebases. The scan runs through
`sonata.kernels.selective_scan` with the backend of `ModelConfig.backend`;
generation runs the same recurrence one token at a time (O(1) per token): `step` is
the plain version, `sonata.decode.Decoder` the fast one (preallocated buffers), after
`prefill` has consumed the prompt in one parallel pass. int8 lives in `sonata.quant`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.config import ModelConfig
from sonata.decode import Decoder, sample_next
from sonata.kernels import conv_silu, rms_norm, selective_scan
from sonata.kernels.reference import project_delta, step as scan_step
from sonata.quant import QLinear, quantize_int8


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
    """The selective SSM layer: in_proj -> conv -> SiLU -> scan (gated by z) -> out_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, di, n, r = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.dt_rank_
        self.cfg = cfg
        self.in_proj = QLinear(d, 2 * di, bias=False)
        self.conv1d = nn.Conv1d(di, di, cfg.d_conv, groups=di, padding=cfg.d_conv - 1, bias=True)
        self.x_proj = QLinear(di, r + 2 * n, bias=False)
        self.dt_proj = QLinear(r, di, bias=True)
        a_init = torch.arange(1, n + 1, dtype=torch.float32).repeat(di, 1)   # (di, n): S4D-real
        if cfg.a_param == "log":
            self.A_log = nn.Parameter(torch.log(a_init))
        else:
            self.A_param = nn.Parameter(-a_init)
        self.D = nn.Parameter(torch.ones(di))
        self.out_proj = QLinear(di, d, bias=False)
        self._init_dt(cfg)

    def _init_dt(self, cfg: ModelConfig) -> None:
        r = cfg.dt_rank_
        nn.init.uniform_(self.dt_proj.weight, -r ** -0.5, r ** -0.5)
        # bias = softplus^-1(dt) with dt log-uniform in [dt_min, dt_max]
        dt = torch.exp(torch.rand(cfg.d_inner) * (math.log(cfg.dt_max) - math.log(cfg.dt_min))
                       + math.log(cfg.dt_min)).clamp(min=cfg.dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

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

    def _ssm_inputs(self, x):
        """x (b, L, di) after conv+SiLU -> delta (b, di, L), B, C (b, n, L)."""
        dt, B, C = self._x_proj(x)
        return project_delta(dt, self.dt_proj.weight), B.transpose(1, 2), C.transpose(1, 2)

    def forward(self, h):                                               # h (b, L, d)
        # The projections work in (b, L, channels); the convolution and the scan in (b, di, L).
        # Each gets a transposed view of the other's output. On the cpu backend x, the scan's
        # output and their gradients stay in the projections' layout (the kernels read and
        # write it in place: no transposed copies), the fused conv hands the gate z on in the
        # scan's layout, and the scan computes delta from dt_proj's low-rank input itself
        # (`delta_proj`: no (b, di, L) delta is stored or transposed); other backends run
        # dt_proj as a matmul first (kernels/__init__.py).
        x, z = conv_silu(self.in_proj(h), self.conv1d.weight, self.conv1d.bias,
                         self.cfg.backend)                              # (b, L, di) views
        dt, B, C = self._x_proj(x)                                      # (b, L, r|n|n)
        y = selective_scan(x.transpose(1, 2), dt, self.A, B.transpose(1, 2), C.transpose(1, 2),
                           self.D.float(), z=z.transpose(1, 2), delta_bias=self.dt_proj.bias.float(),
                           delta_softplus=True, backend=self.cfg.backend,
                           delta_proj=self.dt_proj.weight)              # (b, di, L) view
        return self.out_proj(y.transpose(1, 2))

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
                                 self.D, z=z, delta_bias=self.dt_proj.bias, delta_softplus=True)
        return self.out_proj(y), (conv_state, ssm_state)

    def prefill(self, h):                                               # h (b, L, d)
        """The layer over a whole prompt in one parallel pass, and the state `step` continues
        from: the last d_conv inputs of the convolution (zero-padded on the left) and the scan's
        last state. Written from the parameters alone, apart from `forward`'s layout."""
        cfg, L = self.cfg, h.shape[1]
        r, n, k = cfg.dt_rank_, cfg.d_state, cfg.d_conv
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)         # (b, di, L) each
        conv_state = F.pad(x, (max(k - L, 0), 0))[..., -k:].contiguous()  # (b, di, k), newest last
        x = F.silu(self.conv1d(x)[..., :L])
        dt, B, C = self.x_proj(x.transpose(1, 2)).split([r, n, n], dim=-1)  # (b, L, r|n|n)
        delta = (dt @ self.dt_proj.weight.t()).transpose(1, 2)          # (b, di, L)
        y, last = selective_scan(x.contiguous(), delta.contiguous(), self.A, B.transpose(1, 2).contiguous(),
                                 C.transpose(1, 2).contiguous(), self.D.float(), z=z.contiguous(),
                                 delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                                 return_last_state=True, backend=cfg.backend)
        return self.out_proj(y.transpose(1, 2)), (conv_state, last)


class MambaBlock(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, backend=cfg.backend)
        self.mixer = MambaMixer(cfg)

    def forward(self, h):
        return h + self.mixer(self.norm(h))

    def step(self, h, state):
        y, state = self.mixer.step(self.norm(h), state)
        return h + y, state

    def prefill(self, h):
        y, state = self.mixer.prefill(self.norm(h))
        return h + y, state


class MambaLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the vocabulary) before building")
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(MambaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, backend=cfg.backend)
        self.lm_head = QLinear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight                     # tied
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.normal_(self.embedding.weight, std=0.02)
        for layer in self.layers:
            # GPT-2 style rescale of the residual output projection by 1/sqrt(n_layers)
            nn.init.kaiming_uniform_(layer.mixer.out_proj.weight, a=math.sqrt(5))
            with torch.no_grad():
                layer.mixer.out_proj.weight /= math.sqrt(self.cfg.n_layers)

    def forward(self, idx):                                             # idx (b, L)
        h = self.embedding(idx)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm_f(h))                             # (b, L, vocab)

    def set_int8(self, on: bool) -> None:
        """Fake-quantize every projection and the head to int8 (training and evaluation)."""
        for m in self.modules():
            if isinstance(m, QLinear):
                m.int8 = on

    @torch.no_grad()
    def max_decay(self, idx) -> float:
        """Largest exp(delta*A) over all layers, channels and positions for input idx:
        below 1 the recurrence is contracting; above 1 the state can blow up."""
        h, worst = self.embedding(idx), 0.0
        for layer in self.layers:
            mix, L = layer.mixer, idx.shape[1]
            x, _ = mix.in_proj(layer.norm(h)).transpose(1, 2).chunk(2, dim=1)
            x = F.silu(mix.conv1d(x)[..., :L])
            delta, _, _ = mix._ssm_inputs(x.transpose(1, 2))
            dt = F.softplus(delta + mix.dt_proj.bias[:, None])           # (b, di, L)
            A = mix.A                                                  # (di, n)
            # exp(dt*A) is largest at the largest dt where A > 0 and the smallest where A < 0
            hi = torch.where(A > 0, dt.amax(dim=(0, 2))[:, None] * A, dt.amin(dim=(0, 2))[:, None] * A)
            worst = max(worst, float(torch.exp(hi.max().double())))   # fp64: 1 - 1e-9 is not 1
            h = layer(h)
        return worst

    def int8_state(self) -> dict:
        """Export: real int8 weights with per-row scales for every quantized projection and the
        head, plus the float tensors of everything else."""
        out, quant = {}, {}
        for name, m in self.named_modules():
            if isinstance(m, QLinear):
                quant[name + ".weight"] = m
        for name, t in self.state_dict().items():
            if name in quant:
                q, scale = quantize_int8(t)
                out[name] = {"int8": q, "scale": scale}
            else:
                out[name] = t.detach().clone()
        return out

    def load_int8_state(self, state: dict) -> None:
        """Load an `int8_state()` export, dequantizing the int8 weights."""
        sd = {k: (v["int8"].float() * v["scale"][:, None] if isinstance(v, dict) else v)
              for k, v in state.items()}
        self.load_state_dict(sd)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def step(self, idx, states):
        """One token per sequence: idx (b,) -> logits (b, vocab), new states."""
        h = self.embedding(idx)
        new = []
        for layer, s in zip(self.layers, states):
            h, s = layer.step(h, s)
            new.append(s)
        return self.lm_head(self.norm_f(h)), new

    def prefill(self, idx):
        """The prompt idx (b, T) in one parallel pass: logits at its last position (b, vocab)
        and the states `step` continues from."""
        h, states = self.embedding(idx), []
        for layer in self.layers:
            h, s = layer.prefill(h)
            states.append(s)
        return self.lm_head(self.norm_f(h[:, -1])), states

    @torch.inference_mode()
    def generate(self, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 generator: torch.Generator | None = None, stop_token: int | None = None):
        """Sampling (greedy at temperature <= 0): prompt (b, T) int64 -> (b, T + new) ids; stops
        early once every row has produced `stop_token`. The prompt is consumed in one parallel
        pass, then a `Decoder` steps with preallocated buffers (`generate_reference` is the
        token-by-token original it is tested against)."""
        dec = Decoder(self, prompt.shape[0])
        b, T = prompt.shape
        out = torch.empty(b, T + max_new_tokens, dtype=torch.long, device=prompt.device)
        out[:, :T] = prompt
        logits = dec.prefill(prompt)
        done = torch.zeros(b, dtype=torch.bool, device=prompt.device) if stop_token is not None else None
        n = 0
        with dec.threads():
            for i in range(max_new_tokens):
                nxt = out[:, T + i]
                sample_next(logits, temperature, top_k, generator, out=nxt)
                n = i + 1
                if done is not None:
                    done |= nxt == stop_token
                    if bool(done.all()):
                        break
                if i + 1 < max_new_tokens:
                    logits = dec._step(nxt)
        return out[:, :T + n].clone() if n < max_new_tokens else out

    @torch.no_grad()
    def generate_reference(self, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                           generator: torch.Generator | None = None, stop_token: int | None = None):
        """`generate` written plainly: the prompt fed token by token through `step`, new state
        tensors every step. The oracle for `generate` and `Decoder`."""
        b = prompt.shape[0]
        dev = prompt.device
        states = [layer.mixer.empty_state(b, dev) for layer in self.layers]
        logits = None
        for t in range(prompt.shape[1]):
            logits, states = self.step(prompt[:, t], states)
        out = [prompt]
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, generator)
            out.append(nxt[:, None])
            if stop_token is not None:
                done |= nxt == stop_token
                if bool(done.all()):
                    break
            logits, states = self.step(nxt, states)
        return torch.cat(out, dim=1)


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
