"""transformers' Qwen3-Next on sonata's gated delta rule (sonata.interop.gdn_ops): fla's op
names against transformers' own torch functions, and a tiny random Qwen3NextForCausalLM (linear
and full attention layers mixed; nothing downloaded) whose logits, prefill and cached decoding
equal transformers' torch path, whether served by `patch` after import or by `install` before it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
pytest.importorskip("numba")

from sonata.interop import gdn_ops  # noqa: E402
from sonata.kernels.gdn import l2norm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def torch_fn(f):
    """transformers' own torch function behind its kernel-hub wrapper."""
    return getattr(f, "__wrapped__", f)


def tiny_config():
    return transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    m = transformers.Qwen3NextForCausalLM(tiny_config()).eval()
    with torch.no_grad():                       # move the layer's parameters off their initial values
        for name, p in m.named_parameters():
            if name.endswith(("dt_bias", "A_log")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return m


def rule_inputs(L=21, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, L, 2, 16, generator=gen), torch.randn(2, L, 2, 16, generator=gen)
    v = torch.randn(2, L, 4, 8, generator=gen)
    g = -torch.rand(2, L, 4, generator=gen)
    beta = torch.rand(2, L, 4, generator=gen)
    S0 = torch.randn(2, 4, 16, 8, generator=gen)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("L", [1, 21, 64])
def test_flas_op_names_equal_transformers_torch_functions(L):
    q, k, v, g, beta, S0 = rule_inputs(L)
    want_o, want_S = torch_fn(qn.torch_recurrent_gated_delta_rule)(
        q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for op in (gdn_ops.chunk_gated_delta_rule, gdn_ops.fused_recurrent_gated_delta_rule):
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                o, S = op(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
            assert torch.allclose(o, want_o, atol=2e-5) and torch.allclose(S, want_S, atol=2e-5), op.__name__
    o, S = gdn_ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=False)
    assert S is None and o.dtype == v.dtype


def test_the_op_options_are_flas():
    q, k, v, g, beta, S0 = rule_inputs(9)
    qn_, kn = l2norm(q), l2norm(k)
    base, S = gdn_ops.chunk_gated_delta_rule(qn_, kn, v, g, beta, initial_state=S0, output_final_state=True)
    # beta as logits, the state V-first, the gate computed from A_log and dt_bias in the kernel
    o, _ = gdn_ops.chunk_gated_delta_rule(qn_, kn, v, g, torch.logit(beta), initial_state=S0,
                                          use_beta_sigmoid_in_kernel=True)
    assert torch.allclose(o, base, atol=1e-5)
    o, St = gdn_ops.chunk_gated_delta_rule(qn_, kn, v, g, beta, initial_state=S0.transpose(-1, -2),
                                           output_final_state=True, state_v_first=True)
    assert torch.allclose(o, base, atol=1e-6) and torch.allclose(St, S.transpose(-1, -2), atol=1e-6)
    A_log, dt_bias, raw = torch.randn(4), torch.randn(4), torch.randn(2, 9, 4)
    gate = -A_log.exp() * torch.nn.functional.softplus(raw + dt_bias)
    a, _ = gdn_ops.fused_recurrent_gated_delta_rule(qn_, kn, v, g=raw, beta=beta, use_gate_in_kernel=True,
                                                    A_log=A_log, dt_bias=dt_bias)
    b, _ = gdn_ops.fused_recurrent_gated_delta_rule(qn_, kn, v, g=gate, beta=beta)
    assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="gk / gv"):
        gdn_ops.fused_recurrent_gated_delta_rule(qn_, kn, v, gk=g, beta=beta)


def test_packed_sequences_run_from_their_own_states():
    q, k, v, g, beta, S0 = rule_inputs(12)
    cat = [torch.cat([t[0:1], t[1:2]], dim=1) for t in (q, k, v, g, beta)]
    cu = torch.tensor([0, 12, 24])
    o, S = gdn_ops.chunk_gated_delta_rule(*cat, initial_state=S0, output_final_state=True, cu_seqlens=cu,
                                          use_qk_l2norm_in_kernel=True)
    want, want_S = gdn_ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    assert torch.allclose(o, torch.cat([want[0:1], want[1:2]], dim=1), atol=1e-6)
    assert torch.allclose(S, want_S, atol=1e-6)


def test_the_gated_norm_is_flas_and_qwen3_nexts():
    x, z = torch.randn(5, 8), torch.randn(5, 8)
    norm = gdn_ops.FusedRMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(torch.randn(8))
    hf = qn.Qwen3NextRMSNormGated(8, eps=1e-6)
    hf.weight.data.copy_(norm.weight)
    assert torch.allclose(norm(x, z), hf(x, z), atol=1e-6)
    assert torch.allclose(gdn_ops.rms_norm_gated_ref(x, z, norm.weight, 1e-6), hf(x, z), atol=1e-6)


def test_a_patched_qwen3_next_gives_transformers_logits_prefill_and_cached_decoding(monkeypatch):
    m = tiny_model()
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(ids).logits
        want_gen = m.generate(ids[:, :11], max_new_tokens=6, do_sample=False)
    calls = {"rule": 0, "step": 0}
    rule, step = gdn_ops.gated_delta_rule, gdn_ops.gated_delta_rule_step
    monkeypatch.setattr(gdn_ops, "gated_delta_rule", lambda *a, **kw: (calls.__setitem__("rule", calls["rule"] + 1),
                                                                       rule(*a, **kw))[1])
    monkeypatch.setattr(gdn_ops, "gated_delta_rule_step", lambda *a, **kw: (calls.__setitem__("step", calls["step"] + 1),
                                                                            step(*a, **kw))[1])
    gdn_ops.patch()
    try:
        with torch.no_grad():
            got = m(ids).logits
            assert calls["rule"] == 3                              # the three linear-attention layers
            out = m(ids[:, :11], use_cache=True)               # prefill, then decode with the cache
            cache, logits = out.past_key_values, [out.logits[:, -1]]
            for t in range(11, 16):
                out = m(ids[:, t:t + 1], cache=cache, use_cache=True)
                cache = out.past_key_values
                logits.append(out.logits[:, -1])
            assert calls["step"] == 3 * 5
            got_gen = m.generate(ids[:, :11], max_new_tokens=6, do_sample=False)
    finally:
        gdn_ops.unpatch()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(torch.stack(logits, 1), want[:, 10:16], atol=1e-5)
    assert torch.equal(got_gen, want_gen)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)                # unpatched: transformers' own path again


def test_a_qwen3_next_imported_after_install_runs_on_sonatas_ops(tmp_path):
    """In a fresh process: install() before transformers imports the model's module; the layers
    then call sonata's ops for CPU tensors, and the logits equal this process's torch path."""
    import importlib.util
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla is installed: install() leaves a real installation alone")
    m = tiny_model()
    m.save_pretrained(tmp_path / "model")
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m(ids).logits
    torch.save(ids, tmp_path / "ids.pt")
    script = f"""
import json, sys, torch
from sonata.interop import gdn_ops
assert gdn_ops.install() == ["fla.ops.gated_delta_rule", "fla.modules"]
calls = []
real = gdn_ops.chunk_gated_delta_rule
import functools
@functools.wraps(real)
def counted(*a, **kw):
    calls.append(1)
    return real(*a, **kw)
sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = counted
import transformers
m = transformers.Qwen3NextForCausalLM.from_pretrained({str(tmp_path / 'model')!r}).eval()
with torch.no_grad():
    logits = m(torch.load({str(tmp_path / 'ids.pt')!r})).logits
torch.save(logits, {str(tmp_path / 'got.pt')!r})
print(json.dumps({{"calls": len(calls)}}))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"calls": 3}
    assert torch.allclose(torch.load(tmp_path / "got.pt"), want, atol=1e-5)
