import pytest
import torch
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.model.lm import MambaLM, param_groups


def _model(**kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, backend="reference", **kw)
    return MambaLM(cfg)


def test_seed_configuration_has_about_186k_parameters():
    m = MambaLM(ModelConfig(vocab_size=512))
    assert 180_000 <= m.num_params() <= 190_000
    assert m.lm_head.weight is m.embedding.weight


def test_the_embedding_init_and_tying_are_settings():
    """model.embed_std sets the embedding's initial spread; model.tie_embeddings=false gives the
    head its own weight (nn.Linear's init), a parameter the optimizer sees and moves apart; the
    defaults are mamba_ssm's (0.02, tied)."""
    torch.manual_seed(0)
    tied = MambaLM(ModelConfig(vocab_size=4000))
    assert tied.lm_head.weight is tied.embedding.weight
    assert abs(float(tied.embedding.weight.detach().std()) - 0.02) < 0.001
    torch.manual_seed(0)
    m = MambaLM(ModelConfig(vocab_size=4000, tie_embeddings=False, embed_std=1.0, backend="reference"))
    assert m.lm_head.weight is not m.embedding.weight
    assert abs(float(m.embedding.weight.detach().std()) - 1.0) < 0.02
    bound = 1 / m.cfg.d_model ** 0.5                                         # nn.Linear's kaiming uniform
    assert float(m.lm_head.weight.detach().abs().max()) <= bound and float(m.lm_head.weight.detach().std()) > bound / 3
    assert m.num_params() == tied.num_params() + 4000 * m.cfg.d_model
    params = [p for g in param_groups(m, 0.1) for p in g["params"]]
    assert any(p is m.lm_head.weight for p in params) and any(p is m.embedding.weight for p in params)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    idx = torch.randint(0, 4000, (2, 9))
    F.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
    head0, emb0 = m.lm_head.weight.detach().clone(), m.embedding.weight.detach().clone()
    opt.step()
    assert not torch.equal(m.lm_head.weight, head0) and not torch.equal(m.embedding.weight, emb0)
    assert not torch.equal(m.lm_head.weight - head0, m.embedding.weight - emb0)


def test_initialisation_follows_the_reference():
    m = _model()
    mix = m.layers[0].mixer
    n = m.cfg.d_state
    assert torch.allclose(mix.A, -torch.arange(1, n + 1).float().expand(m.cfg.d_inner, n))
    assert torch.equal(mix.D.data, torch.ones(m.cfg.d_inner))
    dt = torch.nn.functional.softplus(mix.dt_proj.bias.detach())
    assert float(dt.min()) >= 1e-4 * 0.999 and float(dt.max()) <= 0.1 * 1.001


def test_forward_shape_and_causality():
    m = _model(d_model=32, d_state=4).eval()
    idx = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        a = m(idx)
        idx2 = idx.clone()
        idx2[:, 9:] = (idx2[:, 9:] + 1) % 300
        b = m(idx2)
    assert a.shape == (2, 17, 300)
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_recurrent_generation_agrees_with_parallel_forward():
    m = _model(d_model=48, n_layers=2, d_state=8).double().eval()
    idx = torch.randint(0, 300, (3, 25))
    with torch.no_grad():
        full = m(idx)
        states = [layer.mixer.empty_state(3, "cpu", torch.float64) for layer in m.layers]
        states = [(c, s.double()) for c, s in states]
        steps = []
        for t in range(idx.shape[1]):
            logits, states = m.step(idx[:, t], states)
            steps.append(logits)
    assert torch.allclose(full, torch.stack(steps, 1), atol=1e-10, rtol=1e-9)


def test_generate_is_seeded_and_stops():
    m = _model(d_model=32, d_state=4).eval()
    p = torch.zeros(2, 3, dtype=torch.long)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a = m.generate(p, 10, generator=g1)
    b = m.generate(p, 10, generator=g2)
    assert a.shape == (2, 13) and torch.equal(a, b)
    greedy = m.generate(p, 5, temperature=0)
    stop = int(greedy[0, 3])
    assert m.generate(p[:1], 5, temperature=0, stop_token=stop).shape[1] == 4


def test_no_weight_decay_on_A_log_D_norms_and_biases():
    m = _model()
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)].rsplit(".", 1)[-1] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert {"A_log", "D", "bias", "weight"} <= nd   # weight: the RMSNorm weights
    assert all("norm" not in n and not n.endswith(("A_log", ".D", "bias")) for n in d)
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == m.num_params()


def test_fused_cpu_training_path_matches_the_float64_reference():
    """The whole training forward on the cpu backend (fused RMSNorm, conv + SiLU and scan, in the
    (batch, L, channels) layout) against the same weights on the reference backend in float64:
    loss and every parameter's gradient."""
    torch.manual_seed(0)
    fused = MambaLM(ModelConfig(vocab_size=300, d_model=40, n_layers=2, backend="cpu"))
    ref = MambaLM(ModelConfig(vocab_size=300, d_model=40, n_layers=2, backend="reference")).double()
    ref.load_state_dict(fused.state_dict())
    idx = torch.randint(0, 300, (3, 37), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, m in (("fused", fused), ("ref", ref)):
        logits = m(idx)
        losses[name] = F.cross_entropy(logits.reshape(-1, 300).double(), idx.roll(-1, 1).reshape(-1))
        losses[name].backward()
    assert abs(losses["fused"].item() - losses["ref"].item()) < 1e-5
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        rel = (p.grad.double() - q.grad).norm() / q.grad.norm().clamp(min=1e-12)
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.3g}"


ARCHS = ("mamba", "lti", "attention")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_chunked_forward_with_carried_state_equals_one_pass(arch, backend):
    """A sequence run in chunks (1, 6, 64 and 29 positions; the cpu scan's chunk is 128), each
    continuing from the state the previous one returned, gives the logits of one pass over the
    whole sequence within 1e-5, in float32: what evaluation at a million tokens relies on."""
    torch.manual_seed(0)
    m = MambaLM(ModelConfig(arch=arch, vocab_size=16, d_model=32, n_layers=2, d_state=8,
                            backend=backend)).eval()
    idx = torch.randint(0, 16, (3, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = m(idx)
        state, parts, t = None, [], 0
        for n in (1, 6, 64, 29):
            logits, state = m(idx[:, t:t + n], state, return_state=True)
            parts.append(logits)
            t += n
    err = (torch.cat(parts, 1) - whole).abs().max().item()
    assert err <= 1e-5, f"{arch} on {backend}: chunked logits differ by {err:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_architectures_train_on_the_fused_backend(arch):
    """Each architecture's training forward on the cpu backend against the same weights on
    the reference backend in float64: loss and every parameter's gradient (the time-invariant
    mixer runs the fused scan with delta, B and C broadcast from parameters)."""
    torch.manual_seed(0)
    cfg = dict(arch=arch, vocab_size=16, d_model=32, n_layers=2, d_state=8)
    fused = MambaLM(ModelConfig(backend="cpu", **cfg))
    ref = MambaLM(ModelConfig(backend="reference", **cfg)).double()
    ref.load_state_dict(fused.state_dict())
    idx = torch.randint(0, 16, (2, 45), generator=torch.Generator().manual_seed(2))
    losses = {}
    for name, m in (("fused", fused), ("ref", ref)):
        losses[name] = F.cross_entropy(m(idx).reshape(-1, 16).double(), idx.roll(-1, 1).reshape(-1))
        losses[name].backward()
    assert abs(losses["fused"].item() - losses["ref"].item()) < 1e-5
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and float(q.grad.abs().sum()) > 0, f"{name}: no gradient"
        rel = (p.grad.double() - q.grad).norm() / q.grad.norm().clamp(min=1e-12)
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.3g}"


def test_time_invariant_mixer_has_no_input_dependent_selection():
    """The lti ablation: delta, B and C are the same at every position whatever the input;
    the Mamba mixer's vary with it."""
    torch.manual_seed(0)
    for arch, varies in (("lti", False), ("mamba", True)):
        mix = MambaLM(ModelConfig(arch=arch, vocab_size=16, d_model=16, d_state=4)).layers[0].mixer
        x = torch.randn(2, 7, mix.cfg.d_inner)
        delta, B, C = mix.ssm_inputs(x)
        delta = delta + mix.delta_bias[:, None]
        same = all(torch.allclose(v, v[:1, ..., :1].expand_as(v)) for v in (delta, B, C))
        assert same != varies, arch
    assert not hasattr(mix, "x_proj") or arch == "mamba"


def test_attention_is_causal_and_rotary_keeps_relative_positions():
    torch.manual_seed(0)
    m = MambaLM(ModelConfig(arch="attention", vocab_size=16, d_model=32, n_layers=2)).eval()
    idx = torch.randint(0, 16, (2, 20))
    with torch.no_grad():
        a = m(idx)
        idx2 = idx.clone()
        idx2[:, 12:] = (idx2[:, 12:] + 1) % 16
        b = m(idx2)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6) and not torch.allclose(a[:, 12:], b[:, 12:])
    from sonata.model.attention import rotary
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    dots = [float((rotary(q, t + 5) * rotary(k, t)).sum()) for t in (0, 1000, 10**6)]
    assert max(dots) - min(dots) < 1e-4      # the score depends only on the distance (5)


def test_only_models_whose_layers_step_generate():
    m = MambaLM(ModelConfig(arch="lti", vocab_size=16, d_model=16))
    with pytest.raises(ValueError, match="needs a recurrent model .* mamba, mamba2, mamba3, gdn, attention"):
        m.generate(torch.zeros(1, 2, dtype=torch.long), 3)


def test_attention_generates_with_its_keys_and_values_as_the_state():
    """Attention alone: the parallel prefill then one token at a time against the KV cache,
    equal to the token-by-token oracle and to the parallel forward over the whole sequence."""
    torch.manual_seed(0)
    m = MambaLM(ModelConfig(arch="attention", vocab_size=40, d_model=32, n_layers=2)).eval()
    prompt = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    out = m.generate(prompt, 9, temperature=0)
    assert torch.equal(out, m.generate_reference(prompt, 9, temperature=0))
    with torch.no_grad():
        whole = m(out[:, :-1])
    assert torch.equal(whole[:, 6:].argmax(-1), out[:, 7:])
