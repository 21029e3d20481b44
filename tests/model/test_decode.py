"""The fast decoder (sonata.model.decode.Decoder, and its fused numba step sonata.kernels.selective.decode_cpu)
against the model's plain token-by-token reference, and generation built on it. numba is a
dependency: a broken numba fails here instead of skipping."""
import pytest
import torch

from sonata.lab.generate import generate_text, stream_text
from sonata.model.decode import Decoder
from sonata.model.quant import set_int8
from models import _ids, _sonata, _vocab


def test_decoder_matches_the_reference_step_and_parallel_forward():
    m = _sonata(seed=8, backend="reference").double()
    idx = _ids(3, 17)
    with torch.no_grad():
        full = m(idx)
        dec = Decoder(m, 3)
        first = dec.prefill(idx[:, :2]).clone()                          # shorter than d_conv
        assert torch.allclose(first, full[:, 1], atol=1e-10)
        for t in range(2, 17):
            assert torch.allclose(dec.step(idx[:, t]), full[:, t], atol=1e-10), t


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_decode_step_matches_the_torch_step(batch):
    """The numba step (sonata.kernels.selective.decode_cpu, used for float32 on CPU) against the torch
    step it replaces, from the same prefill, over 50 tokens: logits and both states."""
    m = _sonata(seed=12)
    idx = _ids(batch, 60, seed=5)
    fused, plain = Decoder(m, batch), Decoder(m, batch, fused=False)
    assert fused.fused and not plain.fused
    # the prefill (one parallel pass) against the model's plain token-by-token step
    with torch.no_grad():
        states = [layer.mixer.empty_state(batch, "cpu") for layer in m.layers]
        for t in range(10):
            ref, states = m.step(idx[:, t], states)
    first = fused.prefill(idx[:, :10])
    assert (first - ref).abs().max().item() < 1e-5
    assert torch.equal(plain.prefill(idx[:, :10]), first)      # both load the same states
    for t in range(10, 60):
        a, b = fused.step(idx[:, t]), plain.step(idx[:, t])
        assert (a - b).abs().max().item() < 1e-5, t
    assert (fused.ssm_state - plain.ssm_state).abs().max().item() < 1e-5
    assert (fused.conv_state - plain.conv_state).abs().max().item() < 1e-5
    assert fused.pos == plain.pos


def test_fused_decode_step_runs_only_where_it_applies():
    m = _sonata(seed=13)
    assert Decoder(m, 2).fused
    assert not Decoder(m.double(), 2).fused                            # float64: the torch step
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        Decoder(m, 2, fused=True)
    m = _sonata(seed=13)
    set_int8(m, True)
    assert not Decoder(m, 2).fused                                     # int8: the torch step


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_greedy_generate_equals_reference_generate(batch):
    m = _sonata(seed=14)
    prompt = _ids(batch, 7, seed=6)
    assert torch.equal(m.generate(prompt, 64, temperature=0), m.generate_reference(prompt, 64, temperature=0))


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.9, 20), (1.0, 0)])
def test_fast_generate_equals_reference_generate(temperature, top_k):
    m = _sonata(seed=9)
    prompt = _ids(4, 6)
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    fast = m.generate(prompt, 40, temperature=temperature, top_k=top_k, generator=g1)
    ref = m.generate_reference(prompt, 40, temperature=temperature, top_k=top_k, generator=g2)
    assert torch.equal(fast, ref)


def test_stop_tokens_and_pad_follow_the_rule_on_the_full_generation():
    """Greedy decoding with stop ids (two ids the greedy rows really produce): the same tokens
    as a run without them, cut once every row has stopped (or at the full length if a row
    never does); with `pad`, each row's columns after its first stop id are pad (transformers'
    eos / pad_token_id rule, the one loop sonata.interop.hf_accelerate's generate runs)."""
    from sonata.model.decode import generate
    m = _sonata(seed=15)
    prompt = _ids(3, 5, seed=2)
    full = generate(m, prompt, 48, temperature=0)
    new = full[:, 5:]
    stops = [int(new[0, 3]), int(new[2, 10])]               # ids the greedy rows really produce
    first = [next((j for j in range(48) if int(new[r, j]) in stops), None) for r in range(3)]
    end = max(first) + 1 if all(f is not None for f in first) else 48
    got = generate(m, prompt, 48, temperature=0, stop_token=stops)
    assert torch.equal(got, full[:, :5 + end])
    padded = generate(m, prompt, 48, temperature=0, stop_token=stops, pad=0)
    want = full[:, :5 + end].clone()
    for r, f in enumerate(first):
        if f is not None:
            want[r, 5 + f + 1:] = 0
    assert torch.equal(padded, want) and not torch.equal(padded, full[:, :5 + end])
    assert torch.equal(generate(m, prompt, 48, temperature=0, stop_token=[]), full)
    assert torch.equal(generate(m, prompt, 48, temperature=0, stop_token=stops[0]),
                       generate(m, prompt, 48, temperature=0, stop_token=[stops[0]]))


def test_stream_text_equals_batch_generation():
    m = _sonata(seed=10)
    vocab = _vocab()
    for prompt in ("Once upon", ""):
        streamed = "".join(stream_text(m, vocab, prompt, 30, temperature=0.8, top_k=10, seed=3))
        whole = generate_text(m, vocab, prompt, n=1, max_new_tokens=30, temperature=0.8, top_k=10, seed=3)[0]
        assert prompt + streamed == whole


def test_training_after_generation_in_the_same_process():
    """Generation runs under torch.inference_mode; a process that samples first and trains
    after must train (a tensor the cpu kernels cache, once made as an inference tensor, could
    not be saved for backward: checked in a fresh process, where generation comes first)."""
    import subprocess
    import sys
    code = """
import torch
from sonata.core.config import ModelConfig
from sonata.model.lm import MambaLM
m = MambaLM(ModelConfig(d_model=16, n_layers=1, d_state=4, vocab_size=300, backend="cpu"))
m.generate(torch.zeros(1, 3, dtype=torch.long), 4)
idx = torch.randint(0, 300, (2, 9))
torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
print("trained")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "trained", r.stderr[-800:]


def test_an_untied_head_decodes_like_the_parallel_forward():
    """model.tie_embeddings=false: the head is its own weight (moved off the embedding's by
    _sonata), and the fused step, the torch step and the parallel forward all read it."""
    m = _sonata(seed=15, tie_embeddings=False, embed_std=1.0)
    assert m.lm_head.weight is not m.embedding.weight
    assert not torch.allclose(m.lm_head.weight, m.embedding.weight)
    idx = _ids(2, 30, seed=6)
    with torch.no_grad():
        full = m(idx)
    for fused in (True, False):
        dec = Decoder(m, 2, fused=fused)
        assert (dec.prefill(idx[:, :5]) - full[:, 4]).abs().max().item() < 1e-5
        for t in range(5, 30):
            assert (dec.step(idx[:, t]) - full[:, t]).abs().max().item() < 1e-5, (fused, t)


@pytest.mark.parametrize("weights", ["int8", "bf16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_weight_only_int8_and_bf16_decode_equal_float32_decode_of_the_rounded_weights(weights, batch):
    """The fused step reading int8 (per-output scales) or bfloat16 projections and head is the
    float32 fused step on those weights dequantized (decode.dequantized_copy), step by step,
    from the same state (the prompt's prefill is the model's own float32 forward)."""
    from sonata.model.decode import dequantized_copy

    m = _sonata(seed=21)
    idx = _ids(batch, 40, seed=8)
    low, oracle = Decoder(m, batch, weights=weights), Decoder(dequantized_copy(m, weights), batch)
    assert low.fused and low.weights == weights and low._weights[3].dtype == {"int8": "int8", "bf16": "uint16"}[weights]
    assert torch.equal(low.prefill(idx[:, :8]), Decoder(m, batch).prefill(idx[:, :8]))
    oracle.restore(low.snapshot())
    for t in range(8, 40):
        a, b = low.step(idx[:, t]), oracle.step(idx[:, t])
        assert (a - b).abs().max().item() < 1e-5, t
    assert (low.ssm_state - oracle.ssm_state).abs().max().item() < 1e-5
    full = Decoder(m, batch)                         # and it is not the float32 model itself
    full.prefill(idx[:, :8])
    assert (full.step(idx[:, 8]) - low.step(idx[:, 8])).abs().max().item() > 0


def test_weight_only_decode_is_mamba1s_fused_step_and_refuses_the_rest():
    m = _sonata(seed=22)
    prompt = _ids(2, 5)
    out = m.generate(prompt, 12, temperature=0, weights="int8")
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    with pytest.raises(ValueError, match="weights must be one of fp32, int8, bf16"):
        Decoder(m, 1, weights="q4")
    with pytest.raises(ValueError, match="weights=int8 is the fused Mamba-1 step's"):
        Decoder(m.double(), 1, weights="int8")
    from sonata.core.config import ModelConfig
    from sonata.model import MambaLM
    m2 = MambaLM(ModelConfig(arch="mamba2", d_model=32, n_layers=1, d_state=8, headdim=16, vocab_size=300))
    with pytest.raises(ValueError, match="weights=bf16 is the fused Mamba-1 step's"):
        m2.generate(prompt, 3, weights="bf16")
