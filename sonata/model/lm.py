"""The language model: pre-norm residual blocks and tied embeddings, every layer one block
family (`ModelConfig.arch`), or a hybrid stack named layer by layer (`model.layers`, e.g.
mamba2,mamba2,attention,mamba2):

- `mamba`: Mamba-1 blocks (the default). Names mirror state-spaces/mamba (in_proj, conv1d,
  x_proj, dt_proj, A_log, D, out_proj) so readers can move between codebases.
- `lti`: the time-invariant ablation of the Mamba paper (its S4-in-a-Mamba-block row): the
  same block, but delta, B and C are learned parameters instead of functions of the input
  (delta per channel, B and C shared by the channels, as Mamba's B_t and C_t are).
- `mamba2`: Mamba-2 (SSD) blocks, `sonata.model.mamba2`: one in_proj to z, x, B, C, dt, a
  convolution over x, B and C, the SSD scan with one decay per head, a gated grouped RMSNorm.
- `mamba3`: Mamba-3 SISO blocks, `sonata.model.mamba3`: the exponential-trapezoidal update, a
  data-dependent rotation of B and C (a complex state), data-dependent A, normalised B and C
  with biases, no convolution; on the SSD kernel.
- `attention`: a causal multi-head attention baseline with rotary position embeddings
  (`torch.nn.functional.scaled_dot_product_attention`) and a GELU MLP, the same width.

Blocks live one family per file: `sonata.model.mamba` (mamba, lti), `sonata.model.mamba2`,
`sonata.model.mamba3`, `sonata.model.attention` (what they share: `sonata.model.block`), and
`sonata.model.families` is the table that names them: each family's block, config check,
decoding and transformers counterpart (MambaLM builds its layers from it);
`sonata.model.gpt2` is the race's GPT-2 (`build_model`). Every block's forward can take and return its recurrent state (the
convolution window and the scan's state; attention: its keys and values so far), so a long
sequence runs chunk by chunk and gives what one pass gives: `logits, state = model(ids,
state, return_state=True)`. Generation (Mamba) runs the same recurrence one token at a time
(O(1) per token): `step` is the plain version, `sonata.model.decode.Decoder` the fast one
(preallocated buffers), after `prefill` has consumed the prompt in one parallel pass. int8
lives in `sonata.model.quant`.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.core.config import Config, ModelConfig
from sonata.model import decode, families
from sonata.model.mamba import MambaMixer
from sonata.model.norm import RMSNorm
from sonata.model.quant import QLinear


class MambaLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the vocabulary) before building")
        families.validate_model(cfg)
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(families.build_block(cfg, kind) for kind in cfg.kinds)
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, backend=cfg.backend)
        self.lm_head = QLinear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embedding.weight                 # tied
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.normal_(self.embedding.weight, std=self.cfg.embed_std)
        for layer in self.layers:
            # GPT-2 style rescale of the residual output projections by 1/sqrt(n_layers)
            for out in layer.residual_outputs():
                nn.init.kaiming_uniform_(out.weight, a=math.sqrt(5))
                with torch.no_grad():
                    out.weight /= math.sqrt(self.cfg.n_layers)

    def forward(self, idx, state=None, return_state: bool = False):   # idx (b, L)
        """-> logits (b, L, vocab); with `return_state` (or a `state`, the list a previous
        call returned) -> (logits, state): the next call continues the sequence, so a long one
        runs chunk by chunk in bounded memory (attention's state grows with the sequence)."""
        if state is None and not return_state:
            return self.lm_head(self.hidden(idx))                       # (b, L, vocab)
        h, new = self.hidden(idx, state, return_state=True)
        return self.lm_head(h), new

    def hidden(self, idx, state=None, return_state: bool = False):
        """What the head reads: the last layer's output after the final norm (b, L, d_model), with
        the state as `forward` has it; `lm_head(hidden(idx))` is `forward(idx)`. For scoring a few
        positions without the logits of every one (sonata.data.tasks.evaluate_task)."""
        h = self.embedding(idx)
        if state is None and not return_state:
            for layer in self.layers:
                h = layer(h)
            return self.norm_f(h)
        new = []
        for layer, s in zip(self.layers, state if state is not None else [None] * len(self.layers)):
            h, s = layer(h, s, return_state=True)
            new.append(s)
        return self.norm_f(h), new

    def _need_mamba(self, what: str) -> None:
        if not families.recurrent(self.cfg):
            steppers = ", ".join(k for k, f in families.FAMILIES.items() if f.steps)
            raise ValueError(f"{what} needs a recurrent model (every layer one of {steppers}; this model "
                             f"is {self.cfg.arch!r}: {','.join(self.cfg.kinds)})")

    @torch.no_grad()
    def constrain_A(self, a_min: float) -> None:
        """Project every state-space layer's A to A <= -a_min (attention layers have none)."""
        for layer in self.layers:
            if hasattr(layer.mixer if hasattr(layer, "mixer") else None, "constrain_A"):
                layer.mixer.constrain_A(a_min)

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
                 generator: torch.Generator | None = None, stop_token: int | None = None, weights: str = "fp32"):
        """Sampling (greedy at temperature <= 0): prompt (b, T) -> (b, T + new) ids
        (`sonata.model.decode.generate`: a parallel prefill, then the decoder; `weights`: the
        fused Mamba-1 step's weight storage, fp32, int8 or bf16)."""
        self._need_mamba("generation")
        return decode.generate(self, prompt, max_new_tokens, temperature, top_k, generator, stop_token,
                               weights=weights)

    def generate_reference(self, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                           generator: torch.Generator | None = None, stop_token: int | None = None):
        """`generate`'s oracle, token by token (`sonata.model.decode.generate_reference`)."""
        return decode.generate_reference(self, prompt, max_new_tokens, temperature, top_k, generator, stop_token)


def build_model(cfg: Config) -> nn.Module:
    """The model of a configuration (model.vocab_size set): a MambaLM (mamba, lti, attention
    blocks), or for model.arch=gpt2 transformers' GPT-2 (`sonata.model.gpt2.GPT2LM`, context
    data.seq_len), the race's baseline."""
    families.validate(cfg)
    if cfg.model.arch == "gpt2":
        from sonata.model.gpt2 import GPT2LM
        return GPT2LM(cfg.model, cfg.data.seq_len)
    return MambaLM(cfg.model)


def count_params(cfg: Config) -> int:
    """The parameter count of `cfg`'s model without building it whole (a depth a typo made, 10^9
    layers, would take hours and all memory even on the meta device): one block of each family on
    the meta device times its layer count, plus the embedding, the final norm and an untied head;
    a whole-model arch (gpt2) is built at depth 1 and 2 on the meta device and extrapolated.
    Equals build_model(cfg).num_params() (tests/model/test_family_table.py)."""
    m = cfg.model
    families.validate(cfg)
    with torch.device("meta"):
        if m.arch in families.WHOLE_MODELS:
            one, two = (_at_depth(cfg, n) for n in (1, 2))
            return one + (m.n_layers - 1) * (two - one)
        total = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.d_model    # embedding, head, norm_f
        for kind, count in m.layer_counts.items():
            total += count * sum(p.numel() for p in families.build_block(m, kind).parameters())
    return total


def _at_depth(cfg: Config, n_layers: int) -> int:
    c = copy.deepcopy(cfg)
    c.model.n_layers = n_layers
    return sum(p.numel() for p in build_model(c).parameters())


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
        if isinstance(getattr(layer, "mixer", None), MambaMixer):      # mamba and lti layers
            mix, L = layer.mixer, idx.shape[1]
            x, _ = mix.in_proj(layer.norm(h)).transpose(1, 2).chunk(2, dim=1)
            x = F.silu(mix.conv1d(x)[..., :L])
            delta, _, _ = mix.ssm_inputs(x.transpose(1, 2))
            out.append(F.softplus(delta + mix.delta_bias[:, None]))  # (b, di, L)
        h = layer(h)
    return out


@torch.no_grad()
def max_decay(model: MambaLM, idx) -> float:
    """Largest exp(delta*A) over all layers, channels and positions of `model` for input idx:
    below 1 the recurrence is contracting; above 1 the state can blow up (notebook 05)."""
    worst = 0.0
    mixers = [layer.mixer for layer in model.layers if isinstance(getattr(layer, "mixer", None), MambaMixer)]
    for mix, dt in zip(mixers, deltas(model, idx)):
        A = mix.A                                                  # (di, n)
        # exp(dt*A) is largest at the largest dt where A > 0 and the smallest where A < 0
        hi = torch.where(A > 0, dt.amax(dim=(0, 2))[:, None] * A, dt.amin(dim=(0, 2))[:, None] * A)
        worst = max(worst, float(torch.exp(hi.max().double())))   # fp64: 1 - 1e-9 is not 1
    return worst
