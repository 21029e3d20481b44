"""The Gated DeltaNet block (model.arch=gdn, gdn layers of model.layers): the parallel forward
against the token-by-token step chain, chunked state against one pass, the cpu backend against
the reference, the layer against transformers' Qwen3-Next equations, generation against its
oracle, a hybrid that trains on the command line, and the configuration's one-line errors."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import _assert_one_error_line, run_cli, tiny_overrides
from sonata.core.config import ConfigError, ModelConfig, make_config
from sonata.model import MambaLM, families
from sonata.model.attention import AttentionBlock
from sonata.model.gdn import GDNBlock, GDNMixer


def small(**kw) -> ModelConfig:
    base = dict(arch="gdn", d_model=32, n_layers=2, d_state=8, headdim=16, vocab_size=40, chunk_size=8,
                backend="cpu")
    base.update(kw)
    return make_config({f"model.{k}": v for k, v in base.items()}).model


def model(seed=0, dtype=torch.float32, **kw) -> MambaLM:
    torch.manual_seed(seed)
    m = MambaLM(small(**kw)).to(dtype)
    with torch.no_grad():                      # move every parameter off its initial value
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return m


@pytest.mark.parametrize("L", [1, 7, 8, 19])
@pytest.mark.parametrize("ngroups,neg", [(1, False), (2, False), (2, True)])
def test_the_parallel_forward_equals_the_token_by_token_step_chain(L, ngroups, neg):
    m = model(dtype=torch.float64, ngroups=ngroups, allow_neg_eigval=neg)
    ids = torch.randint(0, 40, (2, L), generator=torch.Generator().manual_seed(L))
    want = m(ids)
    states = [layer.mixer.empty_state(2, ids.device, torch.float64) for layer in m.layers]
    steps = []
    with torch.no_grad():
        for t in range(L):
            logits, states = m.step(ids[:, t], states)
            steps.append(logits)
    assert torch.allclose(torch.stack(steps, 1), want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_chunked_state_equals_one_pass(backend):
    m = model(backend=backend)
    ids = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(3))
    want = m(ids)
    a, state = m(ids[:, :10], return_state=True)
    b, state = m(ids[:, 10:], state)
    assert torch.allclose(torch.cat([a, b], 1), want, atol=1e-5)
    conv, S = state[0]
    assert conv.shape == (2, 2 * 8 + 64, 4) and S.shape == (2, 4, 8, 16) and S.dtype == torch.float32


@pytest.mark.parametrize("neg", [False, True])
def test_the_cpu_backend_equals_the_reference_values_and_gradients(neg):
    ids = torch.randint(0, 40, (3, 21), generator=torch.Generator().manual_seed(5))
    out = {}
    for backend in ("reference", "cpu"):
        m = model(backend=backend, ngroups=2, allow_neg_eigval=neg)
        loss = F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        out[backend] = (loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
    assert torch.allclose(out["cpu"][0], out["reference"][0], atol=1e-6)
    for name, g in out["reference"][1].items():
        assert torch.allclose(out["cpu"][1][name], g, atol=1e-5, rtol=1e-4), name
        if "layers" in name:
            assert g.abs().sum() > 0, f"{name} gets no gradient"


@pytest.mark.parametrize("neg", [False, True])
def test_the_layer_is_qwen3_nexts_equations(neg):
    """The mixer written out with transformers' own torch functions for Qwen3-Next's layer
    (its recurrent delta rule, its gated RMSNorm): the same numbers; with allow_neg_eigval,
    the same with beta = 2 sigmoid(b) (fla's rule)."""
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    torch.manual_seed(0)
    cfg = small(ngroups=2, allow_neg_eigval=neg)
    mix = GDNMixer(cfg)
    with torch.no_grad():
        mix.norm.weight.add_(torch.randn(16) * 0.3)
    u = torch.randn(2, 11, 32)
    h, hk, dk, dv = cfg.nheads, cfg.ngroups, cfg.d_state, cfg.headdim
    qkv, z, b, a = mix.in_proj(u).split([2 * hk * dk + h * dv, h * dv, h, h], -1)
    qkv = F.silu(mix.conv1d(qkv.transpose(1, 2))[..., :11]).transpose(1, 2)
    q, k, v = qkv.split([hk * dk, hk * dk, h * dv], -1)
    beta = b.sigmoid() * (2 if neg else 1)
    g = -mix.A_log.float().exp() * F.softplus(a.float() + mix.dt_bias)
    rule = getattr(qn.torch_recurrent_gated_delta_rule, "__wrapped__", qn.torch_recurrent_gated_delta_rule)
    o, _ = rule(q.reshape(2, 11, hk, dk), k.reshape(2, 11, hk, dk), v.reshape(2, 11, h, dv), g=g, beta=beta,
                use_qk_l2norm_in_kernel=True)
    norm = qn.Qwen3NextRMSNormGated(dv, eps=cfg.norm_eps)
    norm.weight.data.copy_(mix.norm.weight)
    want = mix.out_proj(norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(2, 11, h * dv))
    for backend in ("reference", "cpu"):
        mix.cfg.backend = mix.norm.backend = backend
        assert torch.allclose(mix(u), want, atol=1e-5), backend


def test_prefill_then_step_and_generate_equal_their_oracle():
    m = model()
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    last, states = m.prefill(ids[:, :8])
    assert torch.allclose(last, m(ids[:, :8])[:, -1], atol=1e-5)
    with torch.no_grad():
        nxt, _ = m.step(ids[:, 8], states)
    assert torch.allclose(nxt, m(ids)[:, -1], atol=1e-5)
    prompt = ids[:, :5]
    out = m.generate(prompt, 12, temperature=0)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, m.generate_reference(prompt, 12, temperature=0))


def test_a_stack_with_mamba2_and_gdn_layers_generates():
    m = model(layers="gdn,mamba2,gdn")
    assert families.recurrent(m.cfg)
    prompt = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(2))
    assert torch.equal(m.generate(prompt, 8, temperature=0), m.generate_reference(prompt, 8, temperature=0))


def test_a_hybrid_with_attention_keeps_chunked_state_and_generates():
    m = model(layers="gdn,attention,gdn")
    assert [type(layer) for layer in m.layers] == [GDNBlock, AttentionBlock, GDNBlock]
    assert families.recurrent(m.cfg)                    # attention steps against its keys and values
    ids = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(4))
    a, state = m(ids[:, :12], return_state=True)
    b, _ = m(ids[:, 12:], state)
    assert torch.allclose(torch.cat([a, b], 1), m(ids), atol=1e-5)
    assert torch.equal(m.generate(ids[:, :5], 6, temperature=0), m.generate_reference(ids[:, :5], 6, temperature=0))


def test_every_parameter_learns_and_the_decay_is_negative():
    m = model()
    ids = torch.randint(0, 40, (2, 17), generator=torch.Generator().manual_seed(6))
    F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    mix = m.layers[0].mixer
    beta, g = mix._gates(torch.randn(3, 4) * 5, torch.randn(3, 4) * 5)
    assert (g < 0).all() and ((beta > 0) & (beta < 1)).all()


BAD = [
    ({"model.headdim": 24}, "model.headdim (24) must divide d_inner"),
    ({"model.ngroups": 3}, "model.ngroups (3, gdn's key heads) must divide the 2 value heads"),
    ({"model.a_param": "direct"}, "model.a_param=direct is the Mamba-1 ablation; gdn layers"),
    ({"model.a_constraint": True}, "has no A to constrain"),
    ({"model.layers": "gdn,attention", "model.headdim": 24}, "the gdn layers of model.layers=gdn,attention"),
]


@pytest.mark.parametrize("over, fragment", BAD, ids=[f for _, f in BAD])
def test_bad_gdn_settings_are_one_line_errors_and_write_nothing(over, fragment):
    cfg = make_config({"model.arch": "gdn", "model.d_model": 32, "model.headdim": 32, **over})
    before = cfg.to_dict()
    errors = families.check(cfg)
    assert errors and fragment in errors[0] and "\n" not in errors[0], errors
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        families.validate(cfg)
    assert cfg.to_dict() == before


def test_a_hybrid_with_attention_trains_with_falling_loss_on_the_command_line(tmp_path):
    base = tiny_overrides(**{"model.layers": "gdn,attention", "model.headdim": 16, "model.d_state": 8,
                             "model.chunk_size": 16, "train.decay_steps": 8, "train.lr": "1e-2"})
    r = run_cli("train", "--out", str(tmp_path / "a"), "--progress", "none", *base, "train.max_steps=8")
    assert r.returncode == 0, r.stderr
    losses = [json.loads(x)["loss"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x]
    assert len(losses) == 8 and losses[-1] < losses[0] and all(map(torch.isfinite, torch.tensor(losses)))


def test_gdn_alone_trains_and_generates_on_the_command_line(tmp_path):
    base = tiny_overrides(**{"model.arch": "gdn", "model.headdim": 16, "model.d_state": 8, "train.decay_steps": 6})
    r = run_cli("train", "--out", str(tmp_path / "g"), "--progress", "none", *base)
    assert r.returncode == 0, r.stderr
    r = run_cli("generate", str(tmp_path / "g" / "checkpoint.pt"), "--max-new-tokens", "10", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "--- sample 1" in r.stdout


def test_a_bad_gdn_setting_is_one_error_line(tmp_path):
    r = run_cli("train", "--out", str(tmp_path / "run"), "model.arch=gdn", "model.ngroups=5")
    _assert_one_error_line(r, "model.ngroups (5, gdn's key heads) must divide")
    assert not (tmp_path / "run").exists()


def test_the_parameter_count_without_building_equals_the_built_models():
    from sonata.model.lm import build_model, count_params
    cfg = make_config(["model.layers=gdn,attention,gdn", "model.d_model=32", "model.headdim=16", "model.ngroups=2",
                       "data.vocab_size=300"])
    cfg.model.vocab_size = 300
    m = build_model(cfg)
    assert count_params(cfg) == sum(p.numel() for p in m.parameters())
    mix = m.layers[0].mixer                     # in_proj: q, k (2 x 2 x 16), v, z (2 x 64), b, a (2 x 4)
    assert mix.in_proj.weight.shape == (2 * 32 + 2 * 64 + 2 * 4, 32) and mix.norm.weight.shape == (16,)


def test_negative_eigenvalues_are_gdns_alone_and_let_one_layer_flip_a_sign():
    """allow_neg_eigval without a gdn layer is one error line; with it, beta = 2 sigmoid(b), so a
    key written at beta near 2 turns its own state component's sign (I - 2 k k^T is a
    reflection along k), which beta in (0, 1) cannot."""
    with pytest.raises(ConfigError, match="model.allow_neg_eigval=true is for gdn layers"):
        families.validate(make_config({"model.arch": "mamba2", "model.allow_neg_eigval": True}))
    families.validate(make_config({"model.layers": "mamba2,gdn", "model.allow_neg_eigval": True,
                                   "model.headdim": 16}))
    mix = GDNMixer(small(allow_neg_eigval=True))
    b = torch.full((1, 1, mix.cfg.nheads), 30.0)
    beta, _ = mix._gates(b, torch.zeros_like(b))
    assert torch.allclose(beta, torch.full_like(beta, 2.0))
    assert torch.allclose(GDNMixer(small())._gates(b, torch.zeros_like(b))[0], torch.ones_like(beta))
