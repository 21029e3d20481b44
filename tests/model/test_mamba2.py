"""The Mamba-2 block (model.arch=mamba2) and hybrid stacks (model.layers): the parallel forward
against the one-token recurrence, chunked state against one pass, the cpu backend against the
reference, generation against its oracle, initialisation, and the configuration's checks."""
from __future__ import annotations


import pytest
import torch

from conftest import _assert_one_error_line, run_cli, tiny_overrides
from sonata.core.config import ConfigError, ModelConfig, make_config
from sonata.model import MambaLM, families
from sonata.model.attention import AttentionBlock
from sonata.model.mamba import MambaBlock
from sonata.model.mamba2 import Mamba2Block, Mamba2Mixer


def small(**kw) -> ModelConfig:
    base = dict(arch="mamba2", d_model=32, n_layers=2, d_state=8, headdim=16, vocab_size=40,
                chunk_size=16, backend="cpu")
    base.update(kw)
    return make_config({f"model.{k}": v for k, v in base.items()}).model


def model(seed=0, **kw) -> MambaLM:
    torch.manual_seed(seed)
    return MambaLM(small(**kw))


@pytest.mark.parametrize("L", [1, 15, 16, 17, 63, 65])
@pytest.mark.parametrize("ngroups", [1, 2])
def test_parallel_forward_equals_the_token_by_token_recurrence(L, ngroups):
    """The chunked SSD (cpu backend) over a whole sequence gives the logits the one-token step
    (conv window + ssd_step) gives position by position: the duality, through the whole model."""
    m = model(ngroups=ngroups).double()
    idx = torch.randint(0, 40, (2, L), generator=torch.Generator().manual_seed(L))
    with torch.no_grad():
        whole = m(idx)
        states = [layer.mixer.empty_state(2, idx.device, torch.float64) for layer in m.layers]
        states = [(c, s.double()) for c, s in states]
        steps = []
        for t in range(L):
            lo, states = m.step(idx[:, t], states)
            steps.append(lo)
    assert torch.allclose(whole, torch.stack(steps, 1), atol=1e-10, rtol=0)


def test_chunked_state_equals_one_pass_and_cpu_equals_reference():
    m = model()
    idx = torch.randint(0, 40, (3, 70), generator=torch.Generator().manual_seed(1))
    whole = m(idx)
    state, parts = None, []
    for a, b in ((0, 1), (1, 30), (30, 47), (47, 70)):       # pieces shorter and longer than a chunk
        lo, state = m(idx[:, a:b], state, return_state=True)
        parts.append(lo)
    assert (torch.cat(parts, 1) - whole).abs().max() < 2e-5
    ref = model()
    for layer in ref.layers:
        layer.mixer.cfg = small(backend="reference")
    out = ref(idx)
    assert (out - whole).abs().max() < 2e-5
    whole.square().mean().backward()
    out.square().mean().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-3), name


def test_the_result_does_not_depend_on_the_chunk_size():
    idx = torch.randint(0, 40, (2, 50), generator=torch.Generator().manual_seed(2))
    outs = [model(chunk_size=c)(idx) for c in (1, 7, 16, 64, 256)]
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() < 2e-5


def test_generate_equals_its_oracle_and_the_stepped_logits():
    m = model()
    prompt = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(3))
    fast = m.generate(prompt, 12, temperature=0)
    slow = m.generate_reference(prompt, 12, temperature=0)
    assert torch.equal(fast, slow) and fast.shape == (2, 21)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(m.generate(prompt, 12, temperature=0.9, top_k=5, generator=g1),
                       m.generate_reference(prompt, 12, temperature=0.9, top_k=5, generator=g2))
    with torch.no_grad():                                    # greedy ids are the argmax of a full pass
        logits = m(fast[:, :-1])
    assert torch.equal(logits[:, 8:].argmax(-1), fast[:, 9:])


def test_initialisation_is_mamba_ssms():
    torch.manual_seed(0)
    cfg = small(d_model=64, headdim=8, ngroups=2, d_state=16)      # 16 heads
    mix = Mamba2Mixer(cfg)
    A = -mix.A
    assert A.shape == (16,) and bool((A >= 1).all() and (A <= 16).all())
    dt = torch.nn.functional.softplus(mix.dt_bias)
    assert bool((dt >= cfg.dt_min * (1 - 1e-5)).all() and (dt <= cfg.dt_max * (1 + 1e-5)).all())
    assert torch.equal(mix.D, torch.ones(16))
    assert mix.in_proj.weight.shape == (2 * 128 + 2 * 2 * 16 + 16, 64)   # z, x, B, C, dt
    assert mix.conv1d.weight.shape == (128 + 2 * 2 * 16, 1, 4)
    assert mix.norm.group_size == 64                                     # d_inner / ngroups


def test_gated_norm_is_grouped_and_gates_before_normalising():
    torch.manual_seed(0)
    mix = Mamba2Mixer(small(d_model=32, headdim=16, ngroups=2))
    y, z = torch.randn(3, 64), torch.randn(3, 64)
    out = mix.norm(y, z)
    g = y * torch.nn.functional.silu(z)
    for half in (slice(0, 32), slice(32, 64)):
        v = g[:, half]
        want = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + mix.norm.eps)
        assert torch.allclose(out[:, half], want, atol=1e-6)


@pytest.mark.parametrize("ngroups", [1, 2])
def test_the_cpu_block_computes_its_gated_norm_inside_the_ssd_kernels(ngroups, monkeypatch):
    """On the cpu backend the block's gated norm runs inside the SSD recurrence's kernels
    (ssd_packed's norm): rms_norm_gated is never called, and logits and every parameter's
    gradient equal the block with the norm run after the SSD (ssd.FUSED_NORM off)."""
    import sonata.kernels as kernels
    import sonata.kernels.ssd as ssd_pkg
    calls, real = [], kernels.rms_norm_gated
    monkeypatch.setattr(kernels, "rms_norm_gated", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    m = model(ngroups=ngroups, d_state=16)
    idx = torch.randint(0, 40, (3, 70), generator=torch.Generator().manual_seed(2))
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(ssd_pkg, "FUSED_NORM", fused)
        m.zero_grad()
        out = m(idx)
        out.square().mean().backward()
        runs.append((out.detach(), [p.grad.clone() for p in m.parameters()]))
        assert len(calls) == (0 if fused else 2), (fused, calls)       # one per layer, unfused
    (a, ga), (b, gb) = runs
    assert (a - b).abs().max() < 1e-5
    for (name, _), x, y in zip(m.named_parameters(), ga, gb):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("int8", [False, True])
def test_in_proj_as_three_products_equals_the_whole_projection_split(int8):
    """The block computes in_proj as three products over its row blocks (z, xBC, dt): the
    same values as the whole product split, with int8 fake quantisation too (per-row scales)."""
    from sonata.model.quant import set_int8
    torch.manual_seed(0)
    mix = Mamba2Mixer(small(ngroups=2))
    set_int8(mix, int8)
    u = torch.randn(2, 9, 32)
    for got, want in zip(mix._project(u), mix._split(mix.in_proj(u))):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_a_hybrid_stack_mixes_the_block_families_and_keeps_chunked_state():
    cfg = small(layers="mamba2,attention,mamba,mamba2", n_heads=2)
    assert cfg.arch == "hybrid" and cfg.n_layers == 4
    torch.manual_seed(0)
    m = MambaLM(cfg)
    kinds = [type(layer) for layer in m.layers]
    assert kinds == [Mamba2Block, AttentionBlock, MambaBlock, Mamba2Block]
    idx = torch.randint(0, 40, (2, 40), generator=torch.Generator().manual_seed(4))
    whole = m(idx)
    lo1, st = m(idx[:, :13], return_state=True)
    lo2, _ = m(idx[:, 13:], st)
    assert (torch.cat([lo1, lo2], 1) - whole).abs().max() < 2e-5
    # attention layers step too (their keys and values are the state): the hybrid generates
    m.eval()
    assert torch.equal(m.generate(idx[:, :3], 4, temperature=0), m.generate_reference(idx[:, :3], 4, temperature=0))
    recurrent = MambaLM(small(layers="mamba,mamba2"))                   # Mamba-1 and -2: it steps
    p = idx[:, :5]
    assert torch.equal(recurrent.generate(p, 6, temperature=0), recurrent.generate_reference(p, 6, temperature=0))


def test_a_constraint_projects_mamba2s_A():
    m = model(layers="mamba2,attention", n_heads=2)
    with torch.no_grad():
        m.layers[0].mixer.A_log.copy_(torch.log(torch.tensor([1e-6, 1e-4, 0.5, 3.0])))
    m.constrain_A(1e-3)
    assert torch.allclose(m.layers[0].mixer.A, torch.tensor([-1e-3, -1e-3, -0.5, -3.0]))


@pytest.mark.parametrize("over, fragment", [
    ({"model.headdim": 24}, "model.headdim (24) must divide d_inner"),
    ({"model.ngroups": 3}, "model.ngroups (3) must divide the 2 heads"),
    ({"model.chunk_size": 0}, "model.chunk_size must be positive"),
    ({"model.a_param": "direct"}, "model.a_param=direct is the Mamba-1 ablation"),
    ({"model.layers": "mamba2,transformer"}, "'transformer' is not a block"),
    ({"model.arch": "hybrid", "model.layers": ""}, "model.arch=hybrid needs model.layers"),
])
def test_bad_mamba2_settings_are_refused(over, fragment):
    """Each key's range is Config.validate's; what a family needs, the family table's check."""
    o = {"model.arch": "mamba2", "model.d_model": 32, "model.headdim": 32, **over}
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        families.validate(make_config(o))


def test_mamba2_trains_resumes_exactly_and_generates_on_the_command_line(tmp_path):
    base = tiny_overrides(**{"model.arch": "mamba2", "model.headdim": 16, "model.d_state": 16,
                             "model.n_layers": 2, "train.decay_steps": 8})
    a, b = tmp_path / "a", tmp_path / "b"
    r = run_cli("train", "--out", str(a), "--progress", "none", *base, "train.max_steps=8")
    assert r.returncode == 0, r.stderr
    r = run_cli("train", "--out", str(b), "--progress", "none", *base, "train.max_steps=4")
    assert r.returncode == 0, r.stderr
    r = run_cli("train", "--resume", str(b / "checkpoint.pt"), "--progress", "none", "train.max_steps=8")
    assert r.returncode == 0, r.stderr
    import json
    la = [json.loads(x)["loss"] for x in (a / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    lb = [json.loads(x)["loss"] for x in (b / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(la) == 8 and la == lb and la[-1] < la[0]
    r = run_cli("generate", str(a / "checkpoint.pt"), "--max-new-tokens", "12", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "--- sample 1" in r.stdout and len(r.stdout) > len("--- sample 1\nOnce upon a time")


def test_bad_mamba2_setting_is_one_error_line(tmp_path):
    r = run_cli("train", "--out", str(tmp_path / "run"), "model.arch=mamba2", "model.headdim=7")
    _assert_one_error_line(r, "model.headdim (7) must divide d_inner")
    assert not (tmp_path / "run").exists()


def test_generation_steps_the_prefilled_state_on_the_fused_kernel(monkeypatch):
    """The prompt pass hands the decoder a contiguous SSD state, so every decoding step runs the
    fused ssd_step (before, the CPU path's final state was a strided view and each step fell to
    the torch reference)."""
    from sonata.kernels.ssd import step as step_mod
    if step_mod._step_kernel is None:
        pytest.skip("numba not installed")
    calls, kernel = [], step_mod._step_kernel
    monkeypatch.setattr(step_mod, "_step_kernel", lambda *a: (calls.append(1), kernel(*a))[1])
    m = model()
    _, states = m.prefill(torch.randint(0, 40, (1, 9)))
    assert all(s[1].is_contiguous() for s in states)
    m.generate(torch.randint(0, 40, (1, 9)), 5, temperature=0)
    assert len(calls) == 4 * len(m.layers)                 # 5 new tokens: 4 steps after the prefill
