"""The family table (sonata.model.families): one row per block family that the model, the
config checks, decoding and interop read; its checks write nothing; a family added to the table
alone is built, checked and trained in a stack."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from sonata.core.config import ConfigError, ModelConfig, make_config
from sonata.interop.hf import HF_CLASSES, hf_family, train_overrides
from sonata.model import MambaLM, families
from sonata.model.block import PreNormBlock
from sonata.model.families import FAMILIES, Family


def small(**kw) -> ModelConfig:
    base = dict(d_model=32, n_layers=2, d_state=8, headdim=16, n_heads=2, vocab_size=40)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_every_family_builds_checks_clean_and_runs_from_its_row(kind):
    cfg = small(arch=kind)
    assert families.check_model(cfg) == []
    m = MambaLM(cfg)
    assert all(isinstance(layer, FAMILIES[kind].block) for layer in m.layers)
    logits = m(torch.randint(0, 40, (2, 9)))
    assert logits.shape == (2, 9, 40) and torch.isfinite(logits).all()
    assert families.recurrent(cfg) == FAMILIES[kind].steps
    if FAMILIES[kind].steps:                   # the row's claim: a one-token step continues the prefill
        ids = torch.randint(0, 40, (2, 6))
        last, states = m.prefill(ids[:, :5])
        step_logits, _ = m.step(ids[:, 5], states)
        assert torch.allclose(step_logits, m(ids)[:, -1], atol=1e-4)


BAD = [
    ({"model.arch": "mamba9"}, "model.arch must be one of"),
    ({"model.layers": "mamba2,transformer"}, "'transformer' is not a block"),
    ({"model.arch": "mamba2", "model.d_model": 32, "model.headdim": 24}, "model.headdim (24) must divide d_inner"),
    ({"model.arch": "mamba3", "model.rope_fraction": 0.1}, "rotates no pair"),
    ({"model.layers": "mamba,attention", "model.n_heads": 5}, "the attention layers of model.layers"),
    ({"model.arch": "attention", "model.a_constraint": True}, "has no A to constrain"),
    ({"model.arch": "gpt2", "task.name": "parity"}, "a task trains a sonata model"),
]


@pytest.mark.parametrize("over, fragment", BAD, ids=[f for _, f in BAD])
def test_a_check_returns_its_error_and_writes_nothing(over, fragment):
    cfg = make_config(over)                    # each key's own range passes: the families' check refuses
    before = copy.deepcopy(cfg.to_dict())
    errors = families.check(cfg)
    assert errors and fragment in errors[0], errors
    assert cfg.to_dict() == before
    with pytest.raises(ConfigError, match="^" + errors[0].replace("(", r"\(").replace(")", r"\)")[:40]):
        families.validate(cfg)
    assert cfg.to_dict() == before


def test_layers_set_depth_and_arch_when_set_and_validation_refuses_a_contradiction():
    cfg = make_config(["model.layers=mamba2,attention,mamba2"])
    assert (cfg.model.n_layers, cfg.model.arch) == (3, "hybrid")
    assert make_config(["model.layers=mamba2,mamba2"]).model.arch == "mamba2"
    assert make_config(["model.n_layers=7", "model.layers=mamba,attention"]).model.n_layers == 2
    with pytest.raises(ConfigError, match="model.n_layers=7 / model.arch=hybrid contradict model.layers"):
        make_config(["model.layers=mamba,attention", "model.n_layers=7"])
    saved = make_config(["model.layers=mamba2,attention"]).to_dict()
    from sonata.core.config import Config
    assert Config.from_dict(saved).model.kinds == ("mamba2", "attention")      # a checkpoint's config round-trips
    snapshot = copy.deepcopy(saved)
    Config.from_dict(saved).validate()
    assert saved == snapshot


def test_interop_reads_the_table():
    assert HF_CLASSES == {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}
    assert hf_family(small(arch="mamba2")) == "mamba2"
    with pytest.raises(Exception, match="cannot export to transformers"):
        hf_family(small(layers="mamba,mamba2"))
    cfg = make_config(["model.arch=mamba2", "model.headdim=16"])
    keys = {o.split("=")[0] for o in train_overrides(cfg)}
    assert {"model.headdim", "model.ngroups", "model.chunk_size"} <= keys and "model.dt_rank" not in keys


class ToyMixer(nn.Module):
    """A gated linear recurrence, h_t = a h_{t-1} + x_t with one learned decay per channel:
    the smallest family a contributor could add."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.in_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.decay = nn.Parameter(torch.full((cfg.d_model,), -1.0))
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, u, state=None, return_state: bool = False):
        a, x = torch.sigmoid(self.decay), self.in_proj(u)
        h = torch.zeros_like(x[:, 0]) if state is None else state
        ys = []
        for t in range(x.shape[1]):
            h = a * h + x[:, t]
            ys.append(h)
        y = self.out_proj(torch.stack(ys, 1))
        return (y, h) if return_state or state is not None else y


class ToyBlock(PreNormBlock):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, ToyMixer(cfg))


def test_a_family_added_in_one_line_of_the_table_is_built_checked_and_trained(monkeypatch):
    """Issue 55: adding a family touches its own module plus one row of FAMILIES."""
    def check(cfg):
        return [] if cfg.d_model % 8 == 0 else [f"model.d_model ({cfg.d_model}) must be a multiple of 8 for toy"]
    monkeypatch.setitem(FAMILIES, "toy", Family("toy", ToyBlock, check, "a toy recurrence", state_space=False,
                                                 steps=False))
    with pytest.raises(ConfigError, match="multiple of 8 for toy: the toy layers of model.layers=toy,mamba"):
        families.validate(make_config(["model.layers=toy,mamba", "model.d_model=36"]))
    cfg = families.validate(make_config(["model.layers=toy,mamba", "model.d_model=32", "data.vocab_size=300"]))
    cfg.model.vocab_size = 300
    m = MambaLM(cfg.model)
    assert isinstance(m.layers[0], ToyBlock) and not families.recurrent(cfg.model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert m.layers[0].mixer.decay.grad is not None and m.layers[0].mixer.decay.grad.abs().sum() > 0


@pytest.mark.parametrize("over", [["model.arch=mamba"], ["model.arch=lti"], ["model.arch=mamba2", "model.headdim=16"],
                                  ["model.arch=mamba3", "model.headdim=16"], ["model.arch=attention"],
                                  ["model.layers=mamba2,attention,mamba,mamba2", "model.headdim=16",
                                   "model.tie_embeddings=false"], ["model.arch=gpt2", "model.n_layers=3"]],
                         ids=lambda o: o[0])
def test_the_parameter_count_without_building_equals_the_built_models(over):
    from sonata.model.lm import build_model, count_params
    cfg = make_config(["model.d_model=32", "data.vocab_size=300", *over])
    cfg.model.vocab_size = 300
    assert count_params(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_a_depth_a_typo_made_is_counted_at_once():
    """The fuzz found it: check_fits built 10^8 layers on the meta device (hours, 20 GB)."""
    import time
    from sonata.model.lm import count_params
    cfg = make_config(["model.d_model=32", "data.vocab_size=300"])
    cfg.model.vocab_size = 300
    one = count_params(cfg)
    cfg.model.n_layers = 2_000_000_000
    t = time.perf_counter()
    big = count_params(cfg)
    assert time.perf_counter() - t < 5
    per_layer = (one - 300 * 32 - 32) // 2
    assert big == 300 * 32 + 32 + 2_000_000_000 * per_layer
