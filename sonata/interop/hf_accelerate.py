"""transformers' Mamba on sonata's CPU kernels: `accelerate(model)`.

    from transformers import MambaForCausalLM
    from sonata.interop.hf_accelerate import accelerate
    model = accelerate(MambaForCausalLM.from_pretrained("path/to/folder"))

The model keeps its weights, its modules and its API; two things change, in place:

- **Each mixer's forward** (training, evaluation, the prompt pass of generation) runs
  sonata's fused pieces instead of transformers' CPU path (a Python loop over the sequence):
  without a cache, `sonata.interop.mamba_ssm.mamba_inner_fn` (the conv + SiLU and gate split in one numba
  pass, the scan forming delta from dt_proj's low-rank input); with a cache (the prompt
  pass), transformers' conv-state bookkeeping, then sonata's fused scan with its last state
  written to the cache. Gradients flow to every parameter as before.
- **`model.generate`** (MambaForCausalLM) runs sonata's decoder (`sonata.model.decode.Decoder`: the
  prompt in one parallel pass, then one fused numba call per token for all layers and the
  head) when the call is plain decoding: greedy, or sampling with temperature and top-k;
  `max_new_tokens` / `max_length`, `eos_token_id` and `pad_token_id` with transformers'
  meaning (a finished row is padded; all finished: stop). Per generated token transformers'
  loop itself (its cache, logits processors, stopping criteria) costs more than the model
  at these sizes, so accelerating the mixers alone cannot make decoding fast.

What is kept on transformers' own path, as it was (the result is the same, at its speed):
any generation feature beyond the above (beams, penalties, top-p < 1, min length, logits
processors, streamers, scores, left padding, ...: `plain_generation` decides), an attention
mask with zeros (transformers zeroes padded positions inside the mixer), a single decoding
step called directly with a cache, a cached pass over several tokens after a previous state
(transformers starts that scan from zeros; kept so that outputs do not change), models not
in float32 on the CPU, and, for `generate`, models sonata's MambaLM cannot mirror (biases on
the projections, an untied head).

Greedy decoding returns transformers' ids; sampling draws from the same distribution
(temperature, then top-k) with the same global torch generator, not the same draws.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from sonata.core.errors import SonataError
from sonata.interop.hf import config_from_hf, sonata_state_dict
from sonata.interop.mamba_ssm import causal_conv1d_fn, mamba_inner_fn
from sonata.kernels import selective_scan
from sonata.model.decode import generate
from sonata.model.lm import MambaLM

# Generation settings the fast path honours; any other one that differs from transformers'
# defaults sends the call to transformers' own generate.
_PLAIN_KEYS = {"max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "use_cache",
               "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
               "transformers_version", "_from_model_config"}
# generate()'s own arguments besides the config: each must be unset for the fast path
_GENERATE_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                  "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                  "custom_generate")


def _mixers(model):
    return [m for m in model.modules()
            if all(hasattr(m, a) for a in ("A_log", "in_proj", "x_proj", "dt_proj", "conv1d", "out_proj", "D"))
            and hasattr(m, "layer_idx")]


def accelerate(model):
    """Run a transformers MambaForCausalLM (or MambaModel) on sonata's kernels, in place (see
    the module docstring); returns the model. Calling it again does nothing."""
    mixers = _mixers(model)
    if not mixers:
        raise SonataError(f"accelerate: {type(model).__name__} has no Mamba mixers "
                          f"(expected transformers' MambaForCausalLM or MambaModel)")
    for m in mixers:
        if "forward" not in vars(m):                     # not yet replaced on this instance
            m._sonata_original_forward = m.forward
            m.forward = types.MethodType(_mixer_forward, m)
    if hasattr(model, "generate") and "generate" not in vars(model) and hasattr(model, "lm_head"):
        model._sonata_original_generate = model.generate
        model.generate = types.MethodType(_generate, model)
    return model


def is_accelerated(model) -> bool:
    mixers = _mixers(model)
    return bool(mixers) and all("forward" in vars(m) for m in mixers)


# --------------------------------------------------------------------------- the mixer

def _fast_ok(mixer, hidden_states, attention_mask) -> bool:
    w = mixer.in_proj.weight
    return (hidden_states.device.type == "cpu" and hidden_states.dtype == torch.float32
            and w.dtype == torch.float32 and mixer.activation in ("silu", "swish")
            and (attention_mask is None or bool(attention_mask.all())))


def _mixer_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """MambaMixer.forward on sonata's kernels, where it applies (else the original forward)."""
    seq_len = hidden_states.shape[1]
    previous = cache is not None and cache.get_recurrent_state(self.layer_idx) is not None
    if not _fast_ok(self, hidden_states, attention_mask) or previous or kwargs:
        return self._sonata_original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    xz = self.in_proj(hidden_states).transpose(1, 2)                    # (b, 2 di, L)
    A = -torch.exp(self.A_log.float())
    conv_bias = self.conv1d.bias if self.use_conv_bias else None
    if cache is None:
        return mamba_inner_fn(xz, self.conv1d.weight, conv_bias, self.x_proj.weight, self.dt_proj.weight,
                              self.out_proj.weight, self.out_proj.bias if self.use_bias else None, A, None, None,
                              self.D.float(), delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
    # The prompt pass: transformers keeps the conv window; the scan's last state goes to the cache.
    x, z = xz.chunk(2, dim=1)
    x = cache.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
    x = causal_conv1d_fn(x, self.conv1d.weight.squeeze(1), conv_bias, activation="silu")[:, :, -seq_len:]
    dt, B, C = torch.split(self.x_proj(x.transpose(1, 2)),
                           [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
    y, last = selective_scan(x, dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(), z,
                             self.dt_proj.bias.float(), True, True, delta_proj=self.dt_proj.weight)
    cache.update_recurrent_state(last, self.layer_idx)
    return self.out_proj(y.transpose(1, 2).to(hidden_states.dtype))


# --------------------------------------------------------------------------- generation

@dataclass
class Plan:
    """A plain generate call: what the fast path runs."""
    input_ids: torch.Tensor
    new_tokens: int
    sample: bool
    temperature: float
    top_k: int
    eos: list[int]
    pad: int | None


def _defaults(gc_cls) -> dict:
    ref = gc_cls()
    ref.update(**gc_cls._get_default_generation_params(), defaults_only=True)
    return ref.to_dict()


def plain_generation(model, inputs=None, generation_config=None, **kwargs) -> Plan | None:
    """The `Plan` of a generate call the fast path runs exactly, or None (transformers' own
    generate then runs it, with whatever warnings or errors it has for it)."""
    if any(kwargs.pop(a, None) is not None for a in _GENERATE_ARGS):
        return None
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] >= 1
            and ids.dtype == torch.long and ids.device.type == "cpu"):
        return None
    try:
        gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    except Exception:                    # transformers' generate will say what is wrong
        return None
    mask = model_kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        return None
    if model_kwargs:                     # inputs_embeds, a cache passed in, ...
        return None
    have, default = gc.to_dict(), _defaults(type(gc))
    for key in set(have) | set(default):
        a, b = have.get(key), default.get(key)
        if key not in _PLAIN_KEYS and a != b and not (a in (None, False) and b in (None, False)):
            return None
    if gc.top_p is not None and gc.top_p < 1.0:
        return None
    new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 0) - ids.shape[1]
    if new < 1 or (gc.do_sample and not (gc.temperature or 0) > 0):
        return None
    eos = gc.eos_token_id.tolist() if isinstance(gc.eos_token_id, torch.Tensor) else gc.eos_token_id
    eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else None)
    if mask is None and gc.pad_token_id is not None and gc.pad_token_id not in eos \
            and bool((ids == gc.pad_token_id).any()):
        return None                      # transformers masks the prompt's pad tokens out
    return Plan(ids, int(new), bool(gc.do_sample), float(gc.temperature or 1.0), int(gc.top_k or 0), eos,
                None if pad is None else int(pad))


def sonata_lm(model) -> MambaLM | None:
    """A sonata MambaLM sharing `model`'s weights (no copy), or None where MambaLM cannot
    mirror it (biases on the projections, an untied head, not float32 on the CPU). Built once
    and rebuilt when a parameter's storage changes."""
    params = list(model.parameters())
    cached = getattr(model, "_sonata_lm", None)
    if cached is not None and [p.data_ptr() for p in params] == cached[1]:
        return cached[0]
    lm = None
    if all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params):
        try:
            conf = model.config.to_dict()
            if conf.get("tie_word_embeddings", True) is False:
                raise SonataError("untied head")
            cfg = config_from_hf(conf)
            sd = sonata_state_dict({k: v.detach() for k, v in model.state_dict().items()}, cfg, conf)
            with torch.device("meta"):
                lm = MambaLM(cfg.model)
            lm.load_state_dict(sd, assign=True)
            lm.eval()
        except (SonataError, RuntimeError, KeyError, ValueError):
            lm = None
    model._sonata_lm = (lm, [p.data_ptr() for p in params])
    return lm


def _generate(self, inputs=None, generation_config=None, **kwargs):
    """MambaForCausalLM.generate: sonata's decoder for a plain call (`plain_generation`),
    transformers' generate for everything else."""
    plan = plain_generation(self, inputs, generation_config, **dict(kwargs))
    lm = sonata_lm(self) if plan is not None else None
    if lm is None:
        return self._sonata_original_generate(inputs, generation_config=generation_config, **kwargs)
    return decode(lm, plan)


@torch.inference_mode()
def decode(lm: MambaLM, plan: Plan) -> torch.Tensor:
    """transformers' greedy / multinomial decoding (eos ids, finished rows padded) on sonata's
    generation loop (`sonata.model.decode.generate`) -> (b, T + n) ids."""
    temperature, top_k = (plan.temperature, plan.top_k) if plan.sample else (0.0, 0)
    out = generate(lm, plan.input_ids, plan.new_tokens, temperature, top_k, None, stop_token=plan.eos, pad=plan.pad)
    return out.clone()          # a plain tensor, as transformers returns (generate's is an inference tensor)


__all__ = ["accelerate", "is_accelerated", "plain_generation", "sonata_lm", "decode", "Plan"]
