"""The block families, in one table (like mamba_ssm's layer map): a family is a row of
`FAMILIES`, and everything else in sonata that depends on the family reads the row.

A row (`Family`) holds:
  block        the layer class, built as block(cfg) for each layer of that kind
  check        check(model_cfg) -> list of error lines; reads the config, writes nothing
  state_space  it has an A to constrain (model.a_constraint, a_param's rule)
  steps        it has a one-token recurrent step and a parallel prefill (generation)
  fused_decode sonata.model.decode's fused numba step serves a stack of it alone
  bounded_state  its recurrent state has a fixed size (long sequences run chunk by chunk)
  hf           its transformers counterpart (model_type, class, the shape keys beyond the
               common ones) or None: sonata.interop.hf reads it to export, import and re-train
  summary      one line for error messages and docs

Adding a family: its block and its `check` in its own module (sonata/model/<family>.py, and its
kernels in sonata/kernels/<family>/), then one line in FAMILIES below. A model's layers are
`model.layers` (a hybrid: e.g. mamba2,attention,mamba2) or n_layers of `model.arch`; `model.arch`
may also be `gpt2` (transformers' GPT-2, the race's baseline, a whole model rather than a block)
or `hybrid` (derived from model.layers).

`check(cfg)` validates what depends on the families (the arch, the layers, each family's own
keys and what crosses sections); `validate(cfg)` runs Config.validate() (every key's own range)
and then `check`, raising the first error as a ConfigError. The Trainer, `build_model`, MambaLM
and the importers call it, so a config that no family can build is refused before anything is
written or allocated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from sonata.core.config import Config, ModelConfig
from sonata.core.errors import ConfigError
from sonata.model import attention, gdn, gpt2, mamba, mamba2, mamba3


@dataclass(frozen=True)
class HfMapping:
    """A family's transformers counterpart: config.json's model_type, the class that loads it and
    the sonata shape keys (beyond d_model, n_layers, d_state, expand, d_conv, norm_eps) that
    `train --init` needs to rebuild an imported model."""
    model_type: str
    cls: str
    shape_keys: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    name: str
    block: Callable[[ModelConfig], nn.Module]
    check: Callable[[ModelConfig], list[str]]
    summary: str
    state_space: bool = True
    steps: bool = True
    fused_decode: bool = False
    bounded_state: bool = True
    hf: HfMapping | None = None


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("mamba", mamba.MambaBlock, mamba.check, "Mamba-1: the selective scan", fused_decode=True,
           hf=HfMapping("mamba", "MambaForCausalLM", ("dt_rank", "a_param"))),
    Family("lti", mamba.LTIBlock, mamba.check, "the time-invariant ablation of Mamba-1 (delta, B, C parameters)",
           steps=False),
    Family("mamba2", mamba2.Mamba2Block, mamba2.check, "Mamba-2: the SSD scan, one decay per head",
           hf=HfMapping("mamba2", "Mamba2ForCausalLM", ("headdim", "ngroups", "chunk_size"))),
    Family("mamba3", mamba3.Mamba3Block, mamba3.check, "Mamba-3: mamba_ssm's released block (SISO, MIMO of rank model.mimo_rank) or the paper form"),
    Family("gdn", gdn.GDNBlock, gdn.check, "Gated DeltaNet: the gated delta rule (Qwen3-Next's linear layer)",
           state_space=False),
    Family("attention", attention.AttentionBlock, attention.check, "causal attention with rotary positions and an MLP",
           state_space=False, bounded_state=False),
)}
WHOLE_MODELS = ("gpt2",)                # an arch that is a whole model, not a stack of blocks
ARCHS = (*FAMILIES, *WHOLE_MODELS, "hybrid")


def family(kind: str) -> Family:
    try:
        return FAMILIES[kind]
    except KeyError:
        raise ConfigError(f"{kind!r} is not a block family; one of {', '.join(FAMILIES)}") from None


def recurrent(m: ModelConfig) -> bool:
    """Every layer has a one-token step (generation, prefill): mamba, mamba2 and mamba3 stacks."""
    return all(k in FAMILIES and FAMILIES[k].steps for k in m.layer_counts)


def fused_decode(m: ModelConfig) -> bool:
    """sonata.model.decode's fused step serves this stack (every layer Mamba-1)."""
    return all(k in FAMILIES and FAMILIES[k].fused_decode for k in m.layer_counts)


def bounded_state(m: ModelConfig) -> bool:
    """Some layer carries a fixed-size state, so evaluating long sequences chunk by chunk pays
    (a stack of attention alone re-reads every key either way)."""
    return any(k in FAMILIES and FAMILIES[k].bounded_state for k in m.layer_counts)


def hf_mapping(m: ModelConfig) -> HfMapping | None:
    """The transformers counterpart of a stack of one family that has one, else None."""
    ks = set(m.layer_counts)
    return FAMILIES[next(iter(ks))].hf if len(ks) == 1 and next(iter(ks)) in FAMILIES else None


def check_model(m: ModelConfig) -> list[str]:
    """The model section's errors that depend on its families, in order; writes nothing."""
    archs = (*FAMILIES, *WHOLE_MODELS, "hybrid")          # ARCHS, with any family added since import
    if m.arch not in archs:
        return [f"model.arch must be one of {', '.join(archs)}, not {m.arch!r}"]
    if m.arch in WHOLE_MODELS:
        if m.layers:
            return [f"model.layers builds a sonata stack; model.arch={m.arch} is transformers' GPT-2"]
        return gpt2.check(m) + _a_constraint(m, ())
    if m.layers:
        bad = [k for k in m.kinds if k not in FAMILIES]
        if bad:
            return [f"model.layers: {bad[0]!r} is not a block; each layer is one of {', '.join(FAMILIES)} "
                    f"(comma-separated)"]
    elif m.arch == "hybrid":
        return ["model.arch=hybrid needs model.layers (e.g. mamba2,attention)"]
    errors = []
    for kind in m.layer_counts:                             # each family once, in layer order
        errors += [e + (f": the {kind} layers of model.layers={m.layers}" if m.layers else "")
                   for e in FAMILIES[kind].check(m)]
    if m.allow_neg_eigval and "gdn" not in m.layer_counts:
        errors.append(f"model.allow_neg_eigval=true is for gdn layers (their delta rule's beta in (0, 2)); "
                      f"model.arch={m.arch} has none")
    return errors + _a_constraint(m, m.layer_counts)


def _a_constraint(m: ModelConfig, kinds) -> list[str]:
    if not m.a_constraint or any(FAMILIES[k].state_space for k in kinds):
        return []
    return [f"model.a_constraint=true needs a state-space model (model.arch="
            f"{', '.join(k for k, f in FAMILIES.items() if f.state_space)}): model.arch={m.arch} has no A "
            f"to constrain"]


def check(cfg: Config) -> list[str]:
    """Every error of `cfg` that depends on the families (check_model's, and what crosses
    sections: what a task or int8 training needs of the model); writes nothing."""
    errors = check_model(cfg.model)
    if cfg.model.arch in WHOLE_MODELS:
        if cfg.task.name:
            errors.append(f"model.arch={cfg.model.arch} is the language-model race's baseline; a task trains "
                          f"a sonata model ({', '.join(FAMILIES)})")
        if cfg.train.precision == "int8":
            errors.append(f"train.precision=int8 needs a sonata model, not {cfg.model.arch}")
    return errors


def validate(cfg: Config) -> Config:
    """cfg.validate() (each key's own range, in core), then `check`: the first error as a
    ConfigError. Returns cfg, unchanged."""
    cfg.validate()
    errors = check(cfg)
    if errors:
        raise ConfigError(errors[0])
    return cfg


def validate_model(m: ModelConfig) -> ModelConfig:
    """`check_model` for a model section alone (MambaLM's constructor): the first error raised."""
    errors = check_model(m)
    if errors:
        raise ConfigError(errors[0])
    return m


def build_block(m: ModelConfig, kind: str) -> nn.Module:
    """One layer of family `kind`."""
    return family(kind).block(m)


__all__ = ["ARCHS", "FAMILIES", "Family", "HfMapping", "WHOLE_MODELS", "bounded_state", "build_block", "check",
           "check_model", "family", "fused_decode", "hf_mapping", "recurrent", "validate", "validate_model"]
