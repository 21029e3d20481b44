"""sonata.interop.hf_accelerate.accelerate against the same transformers model left alone (random
weights saved to a temporary folder and loaded twice; MambaForCausalLM and Mamba2ForCausalLM;
CPU only, nothing downloaded). Generation: for each setting, the same ids as transformers'
own generate from the same torch generator state (the fast loop draws with the same
`torch.multinomial` calls), and the same processed scores per step."""
import os

import pytest
import torch

from sonata.core.errors import SonataError
from sonata.interop.hf_accelerate import accelerate, fast_generation, is_accelerated, sonata_lm

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 40
FAMILIES = ("mamba", "mamba2")
LOGIT_TOL = {"mamba": 1e-5, "mamba2": 3e-5}     # Mamba-2's float32 chunked sums: ~1e-5 at std 2


def _pair(tmp_path, family="mamba", **over):
    """(plain, accelerated): one random MambaForCausalLM or Mamba2ForCausalLM, loaded twice from disk."""
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
              eos_token_id=None, pad_token_id=None, bos_token_id=None)
    if family == "mamba":
        cls, conf = transformers.MambaForCausalLM, transformers.MambaConfig(time_step_rank=4, **{**kw, **over})
    else:
        cls = transformers.Mamba2ForCausalLM
        conf = transformers.Mamba2Config(num_heads=4, head_dim=16, n_groups=2, chunk_size=16,
                                         **{"tie_word_embeddings": True, **kw, **over})
    hf = cls(conf)
    with torch.no_grad():                  # away from the init, so that every piece matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(str(tmp_path / family))
    load = lambda: cls.from_pretrained(str(tmp_path / family)).eval()  # noqa: E731
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


HFA = "sonata.interop.hf_accelerate"
FUSED = {"mamba": ("mamba_inner_fn", "selective_scan"),
         "mamba2": ("mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined")}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_cache", [False, True])
def test_logits_match_and_the_fast_path_runs(tmp_path, monkeypatch, family, use_cache):
    plain, fast = _pair(tmp_path, family)
    assert is_accelerated(fast) and not is_accelerated(plain)
    no_cache, cached = (_counting(monkeypatch, HFA, n) for n in FUSED[family])
    idx = _ids()
    with torch.no_grad():
        want = plain(idx, use_cache=use_cache).logits
        got = fast(idx, use_cache=use_cache).logits
    assert want.std() > 0.3                                        # not trivially equal
    assert (got - want).abs().max().item() < LOGIT_TOL[family]
    # 2 layers, each through sonata: the fused mixer without a cache, the fused scan with one
    assert (len(no_cache), len(cached)) == ((0, 2) if use_cache else (2, 0))


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradients_match(tmp_path, family):
    plain, fast = _pair(tmp_path, family)
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


# --------------------------------------------------------------------------- generation

def _settings(eos, pad):
    """name -> generate keywords; eos is a token the free greedy run of row 0 says early."""
    return {
        "greedy": dict(do_sample=False),
        "top-p 0.9, temperature 0.8": dict(do_sample=True, top_p=0.9, temperature=0.8),
        "top-k 5": dict(do_sample=True, top_k=5),
        "min-p 0.1": dict(do_sample=True, min_p=0.1, top_k=0),
        "repetition penalty 1.2": dict(do_sample=False, repetition_penalty=1.2),
        "sampling + repetition penalty": dict(do_sample=True, repetition_penalty=1.2, temperature=0.9),
        "min_new_tokens 25 (eos suppressed)": dict(do_sample=False, min_new_tokens=25, eos_token_id=eos,
                                                   pad_token_id=pad),
        "bad_words_ids": dict(do_sample=True, bad_words_ids=[[eos], [pad, eos]]),
        "eos and pad": dict(do_sample=False, eos_token_id=eos, pad_token_id=pad),
        "no_repeat_ngram_size 2": dict(do_sample=True, no_repeat_ngram_size=2),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_every_sampling_setting_gives_transformers_ids_and_scores(tmp_path, monkeypatch, family):
    plain, fast = _pair(tmp_path, family)
    steps = _counting(monkeypatch, HFA, "decoder")
    prompt = _ids(b=3, T=7, seed=3)
    free = plain.generate(prompt, max_new_tokens=30, do_sample=False)
    eos = int(free[0, 7 + 3])                                      # row 0 says it at its 4th new token
    pad = next(v for v in range(VOCAB) if v != eos and v not in prompt)
    for name, kw in _settings(eos, pad).items():
        kw = dict(max_new_tokens=40, return_dict_in_generate=True, output_scores=True, **kw)
        assert fast_generation(fast, prompt, **kw), name
        n = len(steps)
        torch.manual_seed(7)
        want = plain.generate(prompt, **kw)
        torch.manual_seed(7)
        got = fast.generate(prompt, **kw)
        assert len(steps) == n + 1, name                           # sonata's loop ran it
        assert torch.equal(got.sequences, want.sequences), name
        assert len(got.scores) == len(want.scores) == want.sequences.shape[1] - 7, name
        for a, b in zip(got.scores, want.scores):                  # the processed distribution per step
            finite = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), finite), name
            assert (a[finite] - b[finite]).abs().max().item() < 1e-4, name
        short = dict(max_new_tokens=12, **_settings(eos, pad)[name])   # the plain call: a tensor
        torch.manual_seed(8)
        want = plain.generate(prompt, **short)
        torch.manual_seed(8)
        assert torch.equal(fast.generate(prompt, **short), want), name
    # what the settings did: eos padded after, suppressed by min_new_tokens, banned by bad_words_ids
    s = _settings(eos, pad)
    out = fast.generate(prompt, max_new_tokens=30, **s["eos and pad"])
    first = (out[0, 7:] == eos).nonzero()[0, 0].item()
    assert first == 3 and (out[0, 7 + first + 1:] == pad).all()
    assert not (fast.generate(prompt, max_new_tokens=25, **s["min_new_tokens 25 (eos suppressed)"])[:, 7:]
                == eos).any()
    torch.manual_seed(0)
    assert not (fast.generate(prompt, max_new_tokens=60, **s["bad_words_ids"])[:, 7:] == eos).any()


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_spreads_and_top_k_1_is_greedy(tmp_path, family):
    plain, fast = _pair(tmp_path, family)
    prompt = _ids(b=2, T=6, seed=5)
    greedy = plain.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(fast.generate(prompt, max_new_tokens=20, do_sample=True, top_k=1), greedy)
    torch.manual_seed(0)
    a = fast.generate(prompt, max_new_tokens=200, do_sample=True, temperature=1.5, top_k=0)
    assert a.shape == (2, 206) and int(a.min()) >= 0 and int(a.max()) < VOCAB
    assert len(set(a[:, 6:].flatten().tolist())) > 20              # a hot sampler spreads out
    assert torch.equal(fast.generate(prompt, max_length=12), plain.generate(prompt, max_length=12))


def test_custom_processors_criteria_and_streamers_run_in_the_fast_loop(tmp_path, monkeypatch):
    from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class Ban(LogitsProcessor):                                     # no odd ids
        def __call__(self, input_ids, scores):
            scores[:, 1::2] = float("-inf")
            return scores

    class SaysTen(StoppingCriteria):                                # stop a row once it says 10
        def __call__(self, input_ids, scores, **kw):
            return input_ids[:, -1] == 10

    class Collect(BaseStreamer):
        def __init__(self):
            self.got = []

        def put(self, value):
            self.got.append(value.clone())

        def end(self):
            self.got.append("end")

    plain, fast = _pair(tmp_path, "mamba2")
    steps = _counting(monkeypatch, HFA, "decoder")
    prompt = _ids(b=1, T=5, seed=9)
    outs, streams = [], []
    for m in (plain, fast):
        st = Collect()
        torch.manual_seed(3)
        outs.append(m.generate(prompt, max_new_tokens=40, do_sample=True, logits_processor=LogitsProcessorList([Ban()]),
                               stopping_criteria=StoppingCriteriaList([SaysTen()]), streamer=st))
        streams.append(st.got)
    assert len(steps) == 1 and torch.equal(outs[0], outs[1])
    assert (outs[1][0, 5:] % 2 == 0).all()
    assert len(streams[0]) == len(streams[1]) and streams[1][-1] == "end"
    assert all(torch.equal(a, b) for a, b in zip(streams[0][:-1], streams[1][:-1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_what_falls_back_gives_transformers_results(tmp_path, monkeypatch, family):
    plain, fast = _pair(tmp_path, family)
    steps = _counting(monkeypatch, HFA, "decoder")
    prompt = _ids(b=2, T=6, seed=6)
    for kw in (dict(num_beams=2), dict(num_beams=2, do_sample=True), dict(penalty_alpha=0.6, top_k=4),
               dict(return_dict_in_generate=True, output_hidden_states=True), dict(guidance_scale=1.5)):
        assert not fast_generation(fast, prompt, max_new_tokens=8, **kw), kw
    torch.manual_seed(0)
    kw = dict(max_new_tokens=12, num_beams=2)
    assert torch.equal(fast.generate(prompt, **kw), plain.generate(prompt, **kw))
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0                                                  # left padding: transformers' path
    assert not fast_generation(fast, prompt, attention_mask=mask, max_new_tokens=5)
    assert torch.equal(fast.generate(prompt, attention_mask=mask, max_new_tokens=8),
                       plain.generate(prompt, attention_mask=mask, max_new_tokens=8))
    # a prompt holding the pad token: transformers masks it out, and its own loop runs it
    kw = dict(max_new_tokens=8, eos_token_id=3, pad_token_id=int(prompt[1, 2]))
    assert torch.equal(fast.generate(prompt, **kw), plain.generate(prompt, **kw))
    assert len(steps) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_untouched_and_shared_not_copied(tmp_path, family):
    plain, fast = _pair(tmp_path, family)
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    fast.generate(_ids(b=1, T=4), max_new_tokens=5)
    lm = sonata_lm(fast)
    assert lm.embedding.weight.data_ptr() == fast.backbone.embeddings.weight.data_ptr()
    assert all(torch.equal(v, fast.state_dict()[k]) for k, v in before.items())
    assert all(p.requires_grad for p in fast.parameters())           # only sonata's view is frozen
    with torch.no_grad():                                            # a trained weight is seen at once
        fast.backbone.layers[0].mixer.D.add_(0.5)
        plain.backbone.layers[0].mixer.D.add_(0.5)
    prompt = _ids(b=2, T=5, seed=7)
    assert torch.equal(fast.generate(prompt, max_new_tokens=15), plain.generate(prompt, max_new_tokens=15))
    assert accelerate(fast) is fast and is_accelerated(fast)        # again: nothing changes


@pytest.mark.parametrize("family", FAMILIES)
def test_an_untied_head_stays_on_the_fast_path(tmp_path, monkeypatch, family):
    plain, fast = _pair(tmp_path, family, tie_word_embeddings=False, use_conv_bias=False)
    with torch.no_grad():
        plain.lm_head.weight.mul_(1.5)
        fast.lm_head.weight.mul_(1.5)
    lm = sonata_lm(fast)
    assert lm.lm_head.weight.data_ptr() == fast.lm_head.weight.data_ptr() != lm.embedding.weight.data_ptr()
    steps = _counting(monkeypatch, HFA, "decoder")
    prompt = _ids(b=2, T=6, seed=8)
    with torch.no_grad():
        got, want = fast(prompt, use_cache=False).logits, plain(prompt, use_cache=False).logits
        assert (got - want).abs().max() < 2 * LOGIT_TOL[family]
    assert torch.equal(fast.generate(prompt, max_new_tokens=10), plain.generate(prompt, max_new_tokens=10))
    assert len(steps) == 1


def test_mamba2_decoder_against_sonatas_layer_steps(tmp_path):
    """The fast Mamba-2 step against its reference, sonata's `Mamba2Mixer.step` (StateDecoder)."""
    from sonata.interop.hf_accelerate import Mamba2Decoder
    from sonata.model.decode import StateDecoder
    _, fast = _pair(tmp_path, "mamba2")
    lm = sonata_lm(fast)
    prompt = _ids(b=3, T=9, seed=11)
    fastd, ref = Mamba2Decoder(lm, 3), StateDecoder(lm, 3)
    a, b = fastd.prefill(prompt), ref.prefill(prompt)
    assert torch.equal(a, b)
    for t in range(25):
        nxt = b.argmax(-1)
        a, b = fastd.step(nxt), ref.step(nxt)
        assert (a - b).abs().max().item() < 1e-5 * max(1.0, b.abs().max().item()), t


def test_a_model_without_mamba_mixers_is_one_clear_error():
    with pytest.raises(SonataError, match="no Mamba mixers"):
        accelerate(torch.nn.Linear(3, 3))
