"""transformers' Mamba and Mamba-2 on sonata's CPU kernels: `accelerate(model)`.

    from transformers import MambaForCausalLM          # or Mamba2ForCausalLM
    from sonata.interop.hf_accelerate import accelerate
    model = accelerate(MambaForCausalLM.from_pretrained("path/to/folder"))

The model keeps its weights, its modules and its API; two things change, in place:

- **Each mixer's forward** (training, evaluation, the prompt pass of generation) runs
  sonata's fused pieces instead of transformers' CPU path. `MambaMixer` without a cache:
  `sonata.interop.mamba_ssm.mamba_inner_fn` (conv + SiLU and the gate split in one numba pass,
  the scan forming delta from dt_proj's low-rank input); with a cache (the prompt pass),
  transformers' conv-state bookkeeping, then sonata's fused scan with its last state written
  to the cache. `Mamba2Mixer` without a cache: `mamba_split_conv1d_scan_combined` (conv, SSD,
  gated RMSNorm, out_proj; `seq_idx` honoured); with one, the conv bookkeeping, then
  `mamba_chunk_scan_combined` with its final state written to the cache, and the fused gated
  RMSNorm (`rmsnorm_fn`). Gradients flow to
  every parameter as before.
- **`model.generate`** keeps transformers' preparation (generation config, special tokens,
  lengths, its own `LogitsProcessorList` and `StoppingCriteriaList`, built from the call as
  always) and replaces only the decoding loop (`custom_generate`, transformers' hook): the
  prompt in one parallel pass through sonata's `MambaLM` sharing the weights, then one
  decoder step per token (Mamba-1: one fused numba call for every layer and the head;
  Mamba-2: the layers' steps, SSD through the fused `ssd_step`), and on the logits of each
  step transformers' processors and warpers (temperature, top-k, top-p, min-p, typical,
  repetition penalty, min length, bad words, no-repeat n-grams, sequence bias, custom ones),
  the same token choice as its `_sample` (argmax, or `torch.multinomial` on the softmax, so
  the same draws from the same global generator), its eos and pad rule, its stopping
  criteria (max length, max time, eos, stop strings, custom ones), a streamer, and
  `return_dict_in_generate` with `output_scores` / `output_logits` (`cache` is then None).
- **The Mamba-2 hybrids** (`BambaForCausalLM`, `GraniteMoeHybridForCausalLM`, Granite 4.0-H's
  layout): only `generate` changes, to the same loop with `hf_hybrid.HybridDecoder` as the
  decoder (the prompt through the model's own forward, then a lean step per token over the
  model's weights: Mamba-2 layers on the fused `ssd_step`, attention with its rotary
  embedding and a key/value buffer, the MLP or the experts). Their mixers' forwards stay
  transformers'; `sonata.ops.install()` before transformers is imported puts them on
  sonata's ops (training, the prompt pass).

What stays on transformers' own path (the result is the same, at its speed; never slower than
transformers alone, since the check is a copy of the generation config): beam search (and
beam sampling, group beams, constraints), assisted and prompt-lookup decoding, contrastive
search and DoLa, classifier-free guidance (`guidance_scale`, negative prompts), token
healing, `output_attentions` / `output_hidden_states`, paged (continuous batching) caches,
an attention mask with zeros (a padded batch, or a prompt holding the pad token:
transformers masks those positions inside the mixer), `inputs_embeds`, models not in
float32 on the CPU, and models sonata's MambaLM cannot mirror (biases on the projections;
Mamba-2 with `time_step_limit` other than (0, inf), a norm before the gate). For the
mixers: a single decoding step called with a cache, a cached pass after a previous state,
a mask with zeros, other dtypes and devices.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.core.errors import SonataError
from sonata.interop.hf import config_from_hf, sonata_state_dict
from sonata.interop.mamba_ssm import (causal_conv1d_fn, mamba_chunk_scan_combined, mamba_inner_fn,
                                      mamba_split_conv1d_scan_combined, rmsnorm_fn)
from sonata.kernels import selective_scan
from sonata.interop.hf_hybrid import HYBRIDS, HybridDecoder, Mamba2Step, hybrid_supported, small_step_threads
from sonata.model.decode import Decoder
from sonata.model.lm import MambaLM

MIXERS = ("MambaMixer", "Mamba2Mixer")   # transformers' classes whose forward is replaced


def _mixers(model):
    return [m for m in model.modules() if type(m).__name__ in MIXERS and hasattr(m, "layer_idx")]


def accelerate(model):
    """Run a transformers MambaForCausalLM / Mamba2ForCausalLM (or their backbones) on sonata's
    kernels, in place (see the module docstring); returns the model. Calling it again does nothing."""
    mixers = _mixers(model)
    hybrid = type(model).__name__ in HYBRIDS
    if not mixers and not hybrid:
        raise SonataError(f"accelerate: {type(model).__name__} has no Mamba mixers (expected transformers' "
                          f"MambaForCausalLM, Mamba2ForCausalLM, their backbones, or {' / '.join(HYBRIDS)})")
    for m in mixers:
        if "forward" not in vars(m):                     # not yet replaced on this instance
            m._sonata_original_forward = m.forward
            fwd = _mamba2_forward if type(m).__name__ == "Mamba2Mixer" else _mixer_forward
            m.forward = types.MethodType(fwd, m)
    if hasattr(model, "generate") and "generate" not in vars(model) and hasattr(model, "lm_head"):
        model._sonata_original_generate = model.generate
        model.generate = types.MethodType(_generate, model)
    return model


def is_accelerated(model) -> bool:
    if type(model).__name__ in HYBRIDS:
        return "generate" in vars(model)
    mixers = _mixers(model)
    return bool(mixers) and all("forward" in vars(m) for m in mixers)


# --------------------------------------------------------------------------- the mixers

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


def _mamba2_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Mamba2Mixer.forward on sonata's kernels, where it applies (else the original forward)."""
    b, L, _ = hidden_states.shape
    seq_idx = kwargs.get("seq_idx")
    previous = cache is not None and cache.get_recurrent_state(self.layer_idx) is not None
    other = any(v is not None for k, v in kwargs.items() if k != "seq_idx")
    if (not _fast_ok(self, hidden_states, attention_mask) or previous or other
            or (seq_idx is not None and cache is not None)):
        return self._sonata_original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    zxbcdt = self.in_proj(hidden_states)                                 # (b, L, 2 di + 2 G N + h)
    A = -torch.exp(self.A_log.float())
    if cache is None:
        return mamba_split_conv1d_scan_combined(
            zxbcdt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, A, self.D, self.chunk_size,
            seq_idx=seq_idx, dt_limit=tuple(self.time_step_limit), activation=self.activation,
            rmsnorm_weight=self.norm.weight, rmsnorm_eps=self.norm.variance_epsilon,
            outproj_weight=self.out_proj.weight, outproj_bias=self.out_proj.bias, headdim=self.head_dim,
            ngroups=self.n_groups, norm_before_gate=False)
    # The prompt pass: transformers keeps the conv window; the SSD's final state goes to the cache.
    gn = self.n_groups * self.ssm_state_size
    gate, xBC, dt = zxbcdt.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    xBC = cache.update_conv_state(xBC.transpose(1, 2), self.layer_idx, conv_kernel_size=self.conv_kernel_size)
    xBC = causal_conv1d_fn(xBC, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                           activation=self.activation)[:, :, -L:].transpose(1, 2)
    x, B, C = xBC.split([self.intermediate_size, gn, gn], dim=-1)
    y, last = mamba_chunk_scan_combined(
        x.reshape(b, L, self.num_heads, self.head_dim), dt, A, B.reshape(b, L, self.n_groups, -1),
        C.reshape(b, L, self.n_groups, -1), self.chunk_size, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
        dt_limit=tuple(self.time_step_limit), return_final_states=True)
    cache.update_recurrent_state(last, layer_idx=self.layer_idx)
    y = rmsnorm_fn(y.reshape(b, L, -1), self.norm.weight, None, z=gate, eps=self.norm.variance_epsilon,
                   group_size=self.intermediate_size // self.n_groups, norm_before_gate=False)   # fused
    return self.out_proj(y.to(hidden_states.dtype))


# --------------------------------------------------------------------------- generation

FAST_MODES = ("GREEDY_SEARCH", "SAMPLE")          # transformers' `_sample`: the loop replaced here
# generate()'s arguments that send a call to transformers' own loop whenever they are set
_OWN_LOOP_ARGS = ("assistant_model", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate",
                  "synced_gpus", "inputs_embeds", "assistant_tokenizer")


def fast_generation(model, inputs=None, generation_config=None, **kwargs) -> bool:
    """Whether a generate call runs sonata's loop: a decoding mode of transformers' `_sample`
    (greedy or multinomial, no beams, no assistant), ids on the CPU, no attention mask with
    zeros, and a model sonata's MambaLM mirrors. (A prompt holding the pad token is decided
    inside the loop, from the mask transformers builds: its own `_sample` then runs it.)"""
    if any(kwargs.pop(a, None) is not None for a in _OWN_LOOP_ARGS):
        return False
    if kwargs.get("cache_implementation") == "paged" or kwargs.get("cache") is not None \
            or kwargs.get("past_key_values") is not None or kwargs.get("cache_params") is not None:
        return False
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] >= 1
            and ids.dtype == torch.long and ids.device.type == "cpu"):
        return False
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return False
    kwargs.pop("tokenizer", None)
    try:
        gc, _ = model._prepare_generation_config(generation_config, **kwargs)
    except Exception:                    # transformers' generate will say what is wrong
        return False
    if gc.get_generation_mode(None).name not in FAST_MODES or gc.token_healing:
        return False
    if (gc.guidance_scale or 1) != 1 or (gc.return_dict_in_generate
                                         and (gc.output_attentions or gc.output_hidden_states)):
        return False
    return decoder_for(model) is not None


def decoder_for(model):
    """batch -> sonata's decoder for `model`, or None where there is none: a model sonata's
    MambaLM mirrors (`sonata_lm`, then `decoder`), or a Bamba / GraniteMoeHybrid hybrid that
    `hf_hybrid.HybridDecoder` mirrors (weights read in place, nothing copied)."""
    lm = sonata_lm(model)
    if lm is not None:
        return functools.partial(decoder, lm)
    if hybrid_supported(model):
        return functools.partial(HybridDecoder, model)
    return None


def sonata_lm(model) -> MambaLM | None:
    """A sonata MambaLM sharing `model`'s weights (no copy; an untied head kept as it is), or
    None where MambaLM cannot mirror it (biases on the projections, Mamba-2 settings it lacks,
    not float32 on the CPU). Its parameters do not require grad (so the SSD step takes its
    fused path); built once and rebuilt when a parameter's storage changes."""
    params = list(model.parameters())
    cached = getattr(model, "_sonata_lm", None)
    if cached is not None and [p.data_ptr() for p in params] == cached[1]:
        return cached[0]
    lm = None
    if all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params):
        try:
            conf = model.config.to_dict()
            cfg = config_from_hf(conf)
            weights = {k: v.detach() for k, v in model.state_dict().items()}
            sd = sonata_state_dict(weights, cfg, conf)        # an untied head stays its own tensor
            with torch.device("meta"):
                lm = MambaLM(cfg.model)
            lm.load_state_dict(sd, assign=True)
            lm.requires_grad_(False)
            lm.eval()
        except (SonataError, RuntimeError, KeyError, ValueError):
            lm = None
    model._sonata_lm = (lm, [p.data_ptr() for p in params])
    return lm


def _generate(self, inputs=None, generation_config=None, **kwargs):
    """generate(): transformers' preparation and sonata's loop (`sonata_sample`) where
    `fast_generation` says so; transformers' generate, unchanged, for everything else."""
    if not fast_generation(self, inputs, generation_config, **dict(kwargs)):
        return self._sonata_original_generate(inputs, generation_config=generation_config, **kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    stops = kwargs.get("stop_strings", getattr(generation_config or self.generation_config, "stop_strings", None))
    if tokenizer is not None and stops is not None:
        # transformers hands the tokenizer to its own loops only; build its stop-string criterion here
        from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList
        crit = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        crit.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stops))
        kwargs.update(stopping_criteria=crit, stop_strings=None)
    elif tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    loop = functools.partial(sonata_sample, streamer=kwargs.get("streamer"))
    return self._sonata_original_generate(inputs, generation_config=generation_config, custom_generate=loop, **kwargs)


class Mamba2Decoder:
    """Decoding for a MambaLM of Mamba-2 layers (what `Mamba2ForCausalLM` maps to), every state
    and scratch tensor allocated once: per token and layer, an RMSNorm, then `hf_hybrid.Mamba2Step`
    (in_proj, the conv as a ring buffer, the fused `ssd_step` on detached tensors, so its numba
    path, the grouped RMSNorm and out_proj) into the residual. `Mamba2Mixer.step` (sonata's
    model) is its reference; the tests compare them."""

    def __init__(self, model: MambaLM, batch: int):
        c = model.cfg
        self.model, self.k, self.pos, self.b = model, c.d_conv, 0, batch
        self.layers = []
        for layer in model.layers:
            m = layer.mixer
            d = lambda t: None if t is None else t.detach()  # noqa: E731
            self.layers.append(((d(layer.norm.weight), layer.norm.eps), Mamba2Step(
                batch, in_w=d(m.in_proj.weight), in_b=d(m.in_proj.bias), conv_w=d(m.conv1d.weight)[:, 0, :],
                conv_b=d(m.conv1d.bias), A=d(m.A), D=d(m.D), dt_bias=d(m.dt_bias), norm_w=d(m.norm.weight),
                norm_eps=m.norm.eps, ngroups=c.ngroups, headdim=c.headdim, d_state=c.d_state,
                out_w=d(m.out_proj.weight), out_b=d(m.out_proj.bias))))
        self.emb, self.head = model.embedding.weight.detach(), model.lm_head.weight.detach()
        self.norm_f = (model.norm_f.weight.detach(), model.norm_f.eps)
        self.h = self.emb.new_zeros(batch, c.d_model)
        self.macs = batch * c.d_model * self.layers[0][1].in_w.shape[0]

    def threads(self):
        return small_step_threads(self.macs)

    @torch.inference_mode()
    def prefill(self, prompt) -> torch.Tensor:
        logits, states = self.model.prefill(prompt)
        for (_, step), (conv, ssm) in zip(self.layers, states):
            step.load(conv, ssm)
        self.pos = 0
        return logits

    @torch.inference_mode()
    def step(self, idx) -> torch.Tensor:
        h, slot = self.h, self.pos
        self.pos = (slot + 1) % self.k
        torch.index_select(self.emb, 0, idx, out=h)
        for norm, mixer in self.layers:
            h.add_(mixer(F.rms_norm(h, h.shape[1:], *norm), slot))
        return F.linear(F.rms_norm(h, h.shape[1:], *self.norm_f), self.head)


def _processors(processors):
    """`processors(ids, scores)` as transformers' LogitsProcessorList calls it without keyword
    arguments, each processor's signature read once instead of at every step (inspect.signature
    per processor per token measured 17% of a small hybrid's sampling loop). A list that is not
    a plain LogitsProcessorList, or a processor asking for more arguments (the list itself
    then raises its error), is called as it is."""
    import inspect

    from transformers.generation.logits_process import LogitsProcessorList
    if type(processors) is not LogitsProcessorList or any(
            len(inspect.signature(p.__call__).parameters) > 2 for p in processors):
        return processors
    chain = list(processors)

    def run(ids, scores):
        for p in chain:
            scores = p(ids, scores)
        return scores
    return run


@torch.no_grad()
def sonata_sample(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                  streamer=None, **model_kwargs):
    """transformers' `_sample` (greedy and multinomial decoding), with sonata's decoder in place
    of the model's forward: the same processors, token choice, eos / pad rule, stopping
    criteria and streamer calls, so the same ids from the same generator state."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin
    make = decoder_for(model)
    if make is None or model_kwargs.get("attention_mask") is not None or input_ids.device.type != "cpu":
        return GenerationMixin._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                       synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    gc = generation_config
    pad = gc._pad_token_tensor
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    keep = gc.return_dict_in_generate
    scores = () if keep and gc.output_scores else None
    raw = () if keep and gc.output_logits else None
    b, T = input_ids.shape
    buf = torch.empty(b, max(T + 1, min(gc.max_length or 0, T + 4096)), dtype=torch.long)
    buf[:, :T] = input_ids
    t, unfinished = T, torch.ones(b, dtype=torch.long)
    dec = make(b)
    process = _processors(logits_processor)
    logits = dec.prefill(input_ids)                                      # (b, vocab)
    with dec.threads():
        while True:
            nxt_logits = logits.to(copy=True, dtype=torch.float32)
            ids = buf[:, :t]
            nxt_scores = process(ids, nxt_logits)
            if scores is not None:
                scores += (nxt_scores,)
            if raw is not None:
                raw += (nxt_logits,)
            if gc.do_sample:
                nxt = torch.multinomial(nn.functional.softmax(nxt_scores, dim=-1), num_samples=1).squeeze(1)
            else:
                nxt = torch.argmax(nxt_scores, dim=-1)
            if has_eos:
                nxt = nxt * unfinished + pad * (1 - unfinished)
            if t == buf.shape[1]:                                        # a long run: grow the buffer
                buf = torch.cat([buf, torch.empty_like(buf)], dim=1)
            buf[:, t] = nxt
            t += 1
            if streamer is not None:
                streamer.put(nxt.cpu())
            unfinished = unfinished & ~stopping_criteria(buf[:, :t], scores)
            if unfinished.max() == 0:
                break
            with torch.inference_mode():
                logits = dec.step(nxt)
    if streamer is not None:
        streamer.end()
    out = buf[:, :t].clone()
    if keep:
        return GenerateDecoderOnlyOutput(sequences=out, scores=scores, logits=raw, cache=None)
    return out


def decoder(lm: MambaLM, batch: int):
    """sonata's decoder for `lm`: Mamba-1, `sonata.model.decode.Decoder` (the fused numba step);
    every layer Mamba-2, `Mamba2Decoder`."""
    if all(k == "mamba2" for k in lm.cfg.kinds):
        return Mamba2Decoder(lm, batch)
    return Decoder(lm, batch)


__all__ = ["accelerate", "is_accelerated", "fast_generation", "sonata_lm", "sonata_sample", "decoder", "decoder_for", "Mamba2Decoder", "FAST_MODES"]
