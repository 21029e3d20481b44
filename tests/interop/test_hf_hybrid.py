"""sonata.interop.hf_hybrid.HybridDecoder (the Mamba-2 hybrids' decoding step) against
transformers' own model: Bamba and GraniteMoeHybrid (Granite 4.0-H's layout), tiny random
weights built here (nothing downloaded), every step's logits against the model's full forward
on the sequence so far, and `accelerate(model).generate` against the same model left alone:
the same ids for greedy decoding, sampling (same generator state) and the processors."""
import os

import pytest
import torch

from sonata.interop import hf_hybrid
from sonata.interop.hf_accelerate import accelerate, fast_generation, is_accelerated
from sonata.interop.hf_hybrid import HybridDecoder, hybrid_supported

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 48
SSM = dict(mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
           mamba_chunk_size=16)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
BASE = dict(vocab_size=VOCAB, hidden_size=24, eos_token_id=None, pad_token_id=None, bos_token_id=None)
MODELS = {
    # Bamba: Mamba-2, attention, Mamba-2; partial rotary embedding, no conv bias, an untied head
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        BASE, intermediate_size=40, num_hidden_layers=3, attn_layer_indices=[1], mamba_conv_bias=False,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                    "partial_rotary_factor": 0.5}, **ATTN, **SSM)),
    # Granite 4.0-H's layout without a position embedding, and its multipliers away from 1
    "granite": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        BASE, intermediate_size=20, shared_intermediate_size=28, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5,
        **ATTN, **SSM)),
    # the same with the rotary embedding
    "granite-rope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        BASE, intermediate_size=20, shared_intermediate_size=28, num_hidden_layers=2,
        layer_types=["attention", "mamba"], num_local_experts=3, num_experts_per_tok=1,
        position_embedding_type="rope", residual_multiplier=0.7, **ATTN, **SSM)),
}


def _model(name, seed=0, **over):
    conf_cls, cls, kw = MODELS[name]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, conf_cls)(**{**kw, **over})).eval()
    with torch.no_grad():                  # away from the init, so that every piece matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _pair(name, **over):
    plain = _model(name, **over)
    fast = _model(name, **over)
    fast.load_state_dict(plain.state_dict())
    return plain, accelerate(fast)


def _ids(b=2, T=9, seed=1):
    return torch.randint(0, VOCAB, (b, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_step_matches_the_models_forward(name):
    model = _model(name)
    assert hybrid_supported(model)
    seq = _ids(b=3, T=7)
    dec = HybridDecoder(model, 3)
    got = dec.prefill(seq)
    for t in range(12):
        with torch.no_grad():
            want = model(seq).logits[:, -1]
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item()), (name, t)
        nxt = want.argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], 1)
        got = dec.step(nxt)


def test_the_key_value_buffers_grow(monkeypatch):
    """Keys and values start in a small buffer (here 3 positions) and double when full: a
    9-token prompt and 10 more tokens give the same logits as the model; the rotary factors'
    table by position grows past the prompt too (first 18 positions, then 36)."""
    monkeypatch.setattr(hf_hybrid, "KV_CAPACITY", 3)
    model = _model("granite-rope")
    seq = _ids(b=1, T=9, seed=4)
    dec = HybridDecoder(model, 1)
    got = dec.prefill(seq)
    for _ in range(10):
        with torch.no_grad():
            want = model(seq).logits[:, -1]
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())
        nxt = want.argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], 1)
        got = dec.step(nxt)
    attn = [mx for _, mx, *_ in dec.layers if isinstance(mx, hf_hybrid._AttentionStep)]
    assert attn and attn[0].keys.shape[2] >= 19 and attn[0].t == 19
    assert attn[0].cos.shape == attn[0].sin.shape == (36, 6)           # head_dim 6


def test_the_rotation_is_transformers_bit_for_bit():
    """The decoder's rotary step (tables by position, one index_select and the signed sin in
    place of rotate_half) against Bamba's own apply_rotary_pos_emb (partial rotary, half the
    head): equal bits at the first position, inside the first table and past its growth."""
    from transformers.models.bamba.modeling_bamba import apply_rotary_pos_emb
    model = _model("bamba")
    attn = model.model.layers[1].self_attn
    step = hf_hybrid._AttentionStep(attn, hf_hybrid._rope(model), 2, 8)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 1, attn.head_dim, generator=g), torch.randn(2, 2, 1, attn.head_dim, generator=g)
    for pos in (0, 7, 300):
        cos, sin = model.model.rotary_emb(q, torch.tensor([[pos]]))
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
        c, s = step._factors(pos)
        assert torch.equal(step._rotate(q, c, s), want_q) and torch.equal(step._rotate(k, c, s), want_k), pos


SETTINGS = {
    "greedy": dict(do_sample=False),
    "top-p": dict(do_sample=True, top_p=0.9, temperature=0.8),
    "top-k, min-p": dict(do_sample=True, top_k=7, min_p=0.05),
    "repetition penalty, min length": dict(do_sample=False, repetition_penalty=1.3, min_new_tokens=5),
}


@pytest.mark.parametrize("name", ["bamba", "granite"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_generate_gives_transformers_ids_on_the_fast_path(name, setting, monkeypatch):
    plain, fast = _pair(name)
    assert is_accelerated(fast) and not is_accelerated(plain)
    steps = []
    real = HybridDecoder.step

    def counted(self, idx):
        steps.append(1)
        return real(self, idx)
    monkeypatch.setattr(HybridDecoder, "step", counted)
    prompt = _ids(b=2, T=6, seed=3)
    kw = dict(max_new_tokens=14, **SETTINGS[setting])
    assert fast_generation(fast, prompt, **kw)
    torch.manual_seed(5)
    want = plain.generate(prompt, **kw)
    torch.manual_seed(5)
    got = fast.generate(prompt, **kw)
    assert torch.equal(got, want), setting
    assert len(steps) == 13                       # the first token from the prompt pass


def test_what_it_does_not_mirror_stays_on_transformers_loop(monkeypatch):
    """A linear-scaled rotary embedding, a bfloat16 model, beam search: transformers' own
    loop, the same ids as the model left alone, and no decoder step."""
    calls = []
    monkeypatch.setattr(HybridDecoder, "step", lambda self, idx: calls.append(1))
    prompt = _ids(b=1, T=5, seed=2)
    plain, fast = _pair("bamba", rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})
    assert not hybrid_supported(fast)
    assert torch.equal(fast.generate(prompt, max_new_tokens=6), plain.generate(prompt, max_new_tokens=6))
    plain, fast = _pair("granite")
    assert torch.equal(fast.generate(prompt, max_new_tokens=6, num_beams=2),
                       plain.generate(prompt, max_new_tokens=6, num_beams=2))
    fast.to(torch.bfloat16)
    assert not hybrid_supported(fast) and not fast_generation(fast, prompt, max_new_tokens=6)
    assert calls == []


def test_the_decoder_reads_the_models_weights_in_place():
    model = _model("granite")
    dec = HybridDecoder(model, 1)
    params = {p.data_ptr() for p in model.parameters()}
    _, mixer, _, ffn, moe = dec.layers[0]
    assert mixer.in_w.data_ptr() in params and mixer.out_w.data_ptr() in params
    assert moe.gate_up.data_ptr() in params and ffn.down[0].data_ptr() in params
    assert dec.head.data_ptr() in params and dec.emb.data_ptr() in params
