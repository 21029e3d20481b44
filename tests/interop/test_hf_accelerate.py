"""sonata.interop.hf_accelerate.accelerate against the same transformers model left alone (random weights saved to a
temporary folder and loaded twice; CPU only, nothing downloaded)."""
import os

import pytest
import torch

from sonata.core.errors import SonataError
from sonata.interop.hf_accelerate import accelerate, is_accelerated, plain_generation, sonata_lm

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 40


def _pair(tmp_path, **over):
    """(plain, accelerated): one random MambaForCausalLM, loaded twice from disk."""
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
              time_step_rank=4, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    kw.update(over)
    hf = transformers.MambaForCausalLM(transformers.MambaConfig(**kw))
    with torch.no_grad():                  # away from the init, so that every piece matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(str(tmp_path / "hf"))
    load = lambda: transformers.MambaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()  # noqa: E731
    return load(), accelerate(load())


def _ids(b=3, T=24, seed=1):
    return torch.randint(0, VOCAB, (b, T), generator=torch.Generator().manual_seed(seed))


def _counting(monkeypatch, module, name):
    """Count the calls of module.name (still calling it)."""
    import importlib
    mod = importlib.import_module(module)
    real, calls = getattr(mod, name), []

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.mark.parametrize("use_cache", [False, True])
def test_logits_within_1e5_and_the_fast_path_runs(tmp_path, monkeypatch, use_cache):
    plain, fast = _pair(tmp_path)
    assert is_accelerated(fast) and not is_accelerated(plain)
    scans = _counting(monkeypatch, "sonata.interop.hf_accelerate", "selective_scan")
    inner = _counting(monkeypatch, "sonata.interop.hf_accelerate", "mamba_inner_fn")
    idx = _ids()
    with torch.no_grad():
        want = plain(idx, use_cache=use_cache).logits
        got = fast(idx, use_cache=use_cache).logits
    assert want.std() > 0.3                                        # not trivially equal
    assert (got - want).abs().max().item() < 1e-5
    # 2 layers, each through sonata: the fused mixer without a cache, the fused scan with one
    assert (len(inner), len(scans)) == ((0, 2) if use_cache else (2, 0))


def test_training_step_gradients_match(tmp_path):
    plain, fast = _pair(tmp_path)
    idx = _ids(b=4, T=64, seed=2)
    grads = []
    for m in (plain, fast):
        m.train()
        loss = m(idx, labels=idx).loss
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    assert abs(l0 - l1) < 1e-5
    assert g0.keys() == g1.keys() and len(g0) > 10
    for n in g0:
        scale = g0[n].abs().max().item()
        assert scale > 0, n
        assert (g1[n] - g0[n]).abs().max().item() <= 1e-4 * max(scale, 1.0), n


def test_a_few_optimizer_steps_follow_the_same_trajectory(tmp_path):
    plain, fast = _pair(tmp_path)
    losses = []
    for m in (plain, fast):
        m.train()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        run = []
        for s in range(5):
            idx = _ids(b=4, T=32, seed=10 + s)
            loss = m(idx, labels=idx).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0][-1] < losses[0][0]                           # it learns
    assert max(abs(a - b) for a, b in zip(*losses)) < 1e-4


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_generation_same_ids_through_sonatas_decoder(tmp_path, monkeypatch, batch):
    plain, fast = _pair(tmp_path)
    steps = _counting(monkeypatch, "sonata.interop.hf_accelerate", "decode")
    prompt = _ids(b=batch, T=7, seed=3)
    want = plain.generate(prompt, max_new_tokens=40, do_sample=False)
    got = fast.generate(prompt, max_new_tokens=40, do_sample=False)
    assert len(steps) == 1                                         # sonata's decoder ran it
    assert got.shape == want.shape == (batch, 47)
    assert torch.equal(got, want)
    assert len(set(got[0, 7:].tolist())) > 3                       # not one repeated token
    assert torch.equal(fast.generate(prompt, max_length=12), plain.generate(prompt, max_length=12))


def test_eos_pads_finished_rows_and_stops_when_all_are_done(tmp_path, monkeypatch):
    plain, fast = _pair(tmp_path)
    steps = _counting(monkeypatch, "sonata.interop.hf_accelerate", "decode")
    prompt = _ids(b=3, T=5, seed=4)
    free = plain.generate(prompt, max_new_tokens=30, do_sample=False)
    eos = int(free[0, 5 + 3])                                       # row 0 says it at its 4th new token
    pad = next(v for v in range(VOCAB) if v != eos and v not in prompt)
    kw = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    want, got = plain.generate(prompt, **kw), fast.generate(prompt, **kw)
    assert len(steps) == 1 and torch.equal(got, want)
    first = (got[0, 5:] == eos).nonzero()[0, 0].item()
    assert (got[0, 5 + first + 1:] == pad).all()                    # padded after its eos
    # a prompt holding the pad token: transformers masks it out, so its own generate runs
    prompt[1, 2] = pad
    assert plain_generation(fast, prompt, **kw) is None
    assert torch.equal(fast.generate(prompt, **kw), plain.generate(prompt, **kw))
    assert len(steps) == 1


def test_sampling_with_top_k_1_is_greedy_and_sampling_draws_valid_ids(tmp_path):
    plain, fast = _pair(tmp_path)
    prompt = _ids(b=2, T=6, seed=5)
    greedy = plain.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(fast.generate(prompt, max_new_tokens=20, do_sample=True, top_k=1), greedy)
    torch.manual_seed(0)
    a = fast.generate(prompt, max_new_tokens=200, do_sample=True, temperature=1.5, top_k=0)
    assert a.shape == (2, 206) and int(a.min()) >= 0 and int(a.max()) < VOCAB
    assert len(set(a[:, 6:].flatten().tolist())) > 20              # a hot sampler spreads out


def test_other_generation_features_go_to_transformers_unchanged(tmp_path):
    plain, fast = _pair(tmp_path)
    prompt = _ids(b=2, T=6, seed=6)
    assert plain_generation(fast, prompt, max_new_tokens=5) is not None
    for kw in (dict(repetition_penalty=1.3), dict(num_beams=2), dict(min_new_tokens=3),
               dict(do_sample=True, top_p=0.9), dict(return_dict_in_generate=True, output_scores=True)):
        assert plain_generation(fast, prompt, max_new_tokens=8, **kw) is None, kw
    torch.manual_seed(0)
    kw = dict(max_new_tokens=12, repetition_penalty=1.3)
    assert torch.equal(fast.generate(prompt, **kw), plain.generate(prompt, **kw))
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0                                                  # left padding: transformers' path
    assert plain_generation(fast, prompt, attention_mask=mask, max_new_tokens=5) is None
    with torch.no_grad():
        want = plain(prompt, attention_mask=mask, use_cache=False).logits
        got = fast(prompt, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got, want)


def test_weights_untouched_and_shared_not_copied(tmp_path):
    plain, fast = _pair(tmp_path)
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    fast.generate(_ids(b=1, T=4), max_new_tokens=5)
    lm = sonata_lm(fast)
    assert lm.embedding.weight.data_ptr() == fast.backbone.embeddings.weight.data_ptr()
    assert all(torch.equal(v, fast.state_dict()[k]) for k, v in before.items())
    with torch.no_grad():                                            # a trained weight is seen at once
        fast.backbone.layers[0].mixer.D.add_(0.5)
        plain.backbone.layers[0].mixer.D.add_(0.5)
    prompt = _ids(b=2, T=5, seed=7)
    assert torch.equal(fast.generate(prompt, max_new_tokens=15), plain.generate(prompt, max_new_tokens=15))
    assert accelerate(fast) is fast and is_accelerated(fast)        # again: nothing changes


def test_untied_head_and_conv_without_bias(tmp_path):
    plain, fast = _pair(tmp_path, tie_word_embeddings=False, use_conv_bias=False)
    with torch.no_grad():
        plain.lm_head.weight.mul_(1.5)
        fast.lm_head.weight.mul_(1.5)
    assert sonata_lm(fast) is None                                   # MambaLM ties its head
    prompt = _ids(b=2, T=6, seed=8)
    with torch.no_grad():
        assert (fast(prompt, use_cache=False).logits - plain(prompt, use_cache=False).logits).abs().max() < 1e-5
    assert torch.equal(fast.generate(prompt, max_new_tokens=10), plain.generate(prompt, max_new_tokens=10))


def test_a_model_without_mamba_mixers_is_one_clear_error():
    with pytest.raises(SonataError, match="no Mamba mixers"):
        accelerate(torch.nn.Linear(3, 3))
