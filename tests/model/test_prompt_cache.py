"""The prefix-state cache: `Decoder.snapshot` / `restore` (sonata.model.decode) and
`PromptCache` (sonata.lab.generate). A restored state continues bit for bit as the decoder it
was taken from; a prompt that begins with a cached one runs only its new tokens and lands
where one parallel prefill of the whole prompt lands; every engine (the fused Mamba-1 step, its
torch twin, the layers' own steps of Mamba-2, Mamba-3, GDN and hybrids with attention)."""
import pytest
import torch

from models import VOCAB, _ids, _sonata, _vocab
from sonata.core.config import ModelConfig
from sonata.lab.generate import PromptCache, stream_text
from sonata.model import MambaLM
from sonata.model.decode import Decoder, sample_next


def _stack(layers: str, seed=3) -> MambaLM:
    torch.manual_seed(seed)
    kinds = layers.split(",")
    return MambaLM(ModelConfig(arch=kinds[0] if len(set(kinds)) == 1 else "hybrid", layers=layers,
                               n_layers=len(kinds), d_model=32, d_state=8, headdim=16, chunk_size=8,
                               vocab_size=VOCAB)).eval()


MODELS = {"mamba-fused": lambda: (_sonata(seed=4), None), "mamba-torch": lambda: (_sonata(seed=4), False),
          "mamba2": lambda: (_stack("mamba2,mamba2"), None), "mamba3": lambda: (_stack("mamba3"), None),
          "gdn-attention": lambda: (_stack("gdn,attention"), None),
          "mamba2-attention": lambda: (_stack("mamba2,attention,mamba2"), None)}


def _greedy(dec, logits, n):
    """n greedy steps -> every step's logits (copies)."""
    out, nxt = [], torch.empty(logits.shape[0], dtype=torch.long)
    for _ in range(n):
        sample_next(logits, 0.0, out=nxt)
        logits = dec.step(nxt)
        out.append(logits.clone())
    return torch.stack(out)


@pytest.mark.parametrize("name", MODELS)
def test_a_restored_state_continues_bit_for_bit(name):
    m, fused = MODELS[name]()
    prompt = _ids(2, 13, seed=2)
    dec = Decoder(m, 2, fused=fused)
    first = dec.prefill(prompt).clone()
    snap = dec.snapshot()
    want = _greedy(dec, first, 12)
    for again in (dec, Decoder(m, 2, fused=fused)):          # the same decoder, and a fresh one
        logits = again.restore(snap)
        assert torch.equal(logits, first)
        assert torch.equal(_greedy(again, logits, 12), want)
    assert torch.equal(snap.logits, first)                   # the snapshot itself is untouched


@pytest.mark.parametrize("name", ["mamba-fused", "mamba2-attention"])
def test_a_batch_one_snapshot_starts_every_sequence_of_a_batch(name):
    m, fused = MODELS[name]()
    one = Decoder(m, 1, fused=fused)
    one.prefill(_ids(1, 9, seed=6))
    snap = one.snapshot()
    want = _greedy(one, snap.logits.clone(), 5)
    many = Decoder(m, 3, fused=fused)
    got = _greedy(many, many.restore(snap), 5)
    for row in range(3):
        assert torch.allclose(got[:, row], want[:, 0], atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_extend_runs_new_tokens_in_one_pass_where_steps_would_take_them(name):
    """After a prefill and a few steps, `extend` over the next tokens lands where stepping
    them one by one lands (logits, and the steps after), on every engine."""
    m, fused = MODELS[name]()
    ids = _ids(2, 30, seed=4)
    a, b = Decoder(m, 2, fused=fused), Decoder(m, 2, fused=fused)
    for dec in (a, b):
        dec.prefill(ids[:, :9])
        for t in range(9, 12):                               # the ring's slot moves off 0
            dec.step(ids[:, t])
    for t in range(12, 25):
        want = a.step(ids[:, t])
    got = b.extend(ids[:, 12:25])
    assert torch.allclose(got, want, atol=1e-5), name
    for t in range(25, 30):
        assert torch.allclose(b.step(ids[:, t]), a.step(ids[:, t]), atol=1e-5), (name, t)


@pytest.mark.parametrize("name", ["mamba-fused", "mamba2", "gdn-attention"])
def test_the_prompt_cache_runs_only_the_new_tokens_and_lands_where_a_full_prefill_does(name):
    m, _ = MODELS[name]()
    system, turn1, turn2 = [_ids(1, n, seed=s)[0].tolist() for n, s in ((11, 1), (5, 2), (4, 3))]
    cache = PromptCache(m)
    dec, logits = cache.start(system)
    assert cache.reused == 0
    for prompt, reused in ((system + turn1, len(system)), (system + turn1 + turn2, len(system + turn1)),
                           (system + turn2, len(system))):
        dec, logits = cache.start(prompt)
        assert cache.reused == reused
        want = Decoder(m, 1).prefill(torch.tensor([prompt]))
        assert torch.allclose(logits, want, atol=1e-5), prompt
    again_dec, again = cache.start(system + turn1)             # all of it cached: bit for bit
    assert cache.reused == len(system + turn1)
    first_dec, first = PromptCache(m).start(system + turn1)
    assert torch.allclose(again, first, atol=1e-5)
    assert len(cache.entries) == 4


def test_the_cache_forgets_the_least_recently_used_and_refuses_what_cannot_continue():
    m = _sonata(seed=4)
    cache = PromptCache(m, max_entries=2)
    a, b, c = [1, 2, 3], [4, 5], [6]
    cache.start(a)
    cache.start(b)
    cache.start(a + [7])                                      # uses a: b is now the oldest
    assert list(cache.entries) == [tuple(a), tuple(a + [7])]
    with pytest.raises(ValueError, match="at least one token"):
        cache.start([])
    with pytest.raises(ValueError, match="at least 1 entry"):
        PromptCache(m, max_entries=0)
    dec3 = Decoder(m, 3)
    dec2 = Decoder(m, 2)
    dec2.prefill(_ids(2, 4))
    with pytest.raises(ValueError, match="a snapshot of 2 sequences cannot continue 3"):
        dec3.restore(dec2.snapshot())
    other = Decoder(_stack("mamba2"), 2)
    other.prefill(_ids(2, 4))
    with pytest.raises(ValueError, match="another model's decoder"):
        dec2.restore(other.snapshot())
    wider = _sonata(seed=4, d_conv=3)
    w = Decoder(wider, 2)
    w.prefill(_ids(2, 4))
    with pytest.raises(ValueError, match="another model's decoder"):
        dec2.restore(w.snapshot())
    del c


def test_stream_text_with_a_cache_writes_what_it_writes_without():
    m, vocab = _sonata(seed=10), _vocab()
    cache = PromptCache(m)
    for prompt in ("Once upon", "Once upon a time"):
        plain = "".join(stream_text(m, vocab, prompt, 20, temperature=0.0, seed=3))
        cached = "".join(stream_text(m, vocab, prompt, 20, temperature=0.0, seed=3, cache=cache))
        assert cached == plain
    assert cache.reused == len(vocab.encode("Once upon"))
    with pytest.raises(ValueError, match="same model at batch 1"):
        list(stream_text(m, vocab, "Once", 3, cache=PromptCache(m, batch=2)))
