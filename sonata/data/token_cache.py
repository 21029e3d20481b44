"""The on-disk token cache: `prepare(data_cfg)` turns a data source into one flat
uint16 file of compact ids per split, beside a JSON sidecar, built once and
memory-mapped by training:

  <cache_dir>/tokens/<source>-<key>/train.u16, validation.u16, meta.json

The key (directory name) hashes what the user asked for: the source's identity,
data.max_stories, data.val_fraction, data.vocab_size, where the vocabulary comes from (the
rule and its version, or a checkpoint's fixed vocabulary by hash) and the format version. The
sidecar records what was built: the source's fingerprint (path, size, mtime, sha256
of its first and last MiB, per file), the tokenizer and its rank-file hash, the
vocabulary, the story/token/byte counts and a hash of each cache file's first and
last MiB. A cache whose sidecar disagrees with the source, the request or the files
is rebuilt with a one-line notice, never used.

Preparation streams the source in batches of stories (~4 MiB of text), never holding
the corpus. Each batch is split by story into train and validation, joined with
<|endoftext|> into chunks and encoded with tiktoken on all cores: tiktoken encodes
the text between special tokens independently, so a joined chunk gives exactly the
per-story ids with the end-of-text id between stories, without a Python list per
story. The o200k ids go to a temporary uint32 file per split while the training
split's ids are counted (np.bincount per batch). The vocabulary is then the same rule
as `Vocab.build` over the WHOLE training split (deterministic, and identical to the
in-memory path), and a second, tokenizer-free pass compacts the uint32 files into
the uint16 caches in blocks. Tokenizing once costs a temporary 4 bytes per o200k
token (about the size of the text), removed at the end.

Faults: everything is written under temporary names (`*.<pid>.tmp`) and renamed; the
sidecar, written last, is what makes a cache trusted, and a rebuild removes the old
sidecar first. A killed preparation therefore leaves only temporary files, which the
next preparation of the same key removes (an exclusive lock per key serializes
processes, e.g. the ranks of a data-parallel run). A full disk ends with one error.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sonata.core.errors import DataError, writable_dir
from sonata.core.progress import Progress
from sonata.data.sources import SPLITS, Source, limited, sha256_ends_of, resolve_source, story_batches, validation_mask
from sonata.data.vocab import EOT, O200K_SHA256, VOCAB_RULE_VERSION, Vocab, get_tokenizer

CACHE_FORMAT = 1
CHUNK_TEXT_CHARS = 128 << 10     # text per encoder call (several per batch: one per thread)
COMPACT_BLOCK = 2 << 20          # o200k ids compacted at a time


def default_cache_dir() -> Path:
    """~/.cache/sonata, or $XDG_CACHE_HOME/sonata."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sonata"


def cache_dir_of(data_cfg) -> Path:
    return Path(data_cfg.cache_dir).expanduser() if getattr(data_cfg, "cache_dir", "") else default_cache_dir()


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


def _cache_key(src: Source, data_cfg, vocab_size: int, vocab: Vocab | None = None) -> dict:
    """What a cache is asked to be. `vocabulary` says where its vocabulary comes from: the
    rule over the training split (with the rule's version, so a changed rule never reuses an
    old cache) or a fixed vocabulary (a resumed checkpoint's, by its hash). So a checkpoint's
    vocabulary gets a cache of its own: it never rebuilds, nor is taken for, the cache a
    fresh run of the same data uses."""
    source = (f"rule-{VOCAB_RULE_VERSION}" if vocab is None else
              "fixed-" + hashlib.sha256(np.asarray(vocab.tokens, dtype=np.int64).tobytes()).hexdigest()[:16])
    return {"format": CACHE_FORMAT, "source": src.identity(), "max_stories": data_cfg.max_stories,
            "val_fraction": None if src.has_validation else data_cfg.val_fraction,
            "vocab_size": vocab_size, "vocabulary": source,
            "tokenizer": "o200k_base", "tokenizer_sha256": O200K_SHA256}


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
        if sha256_ends_of(path) != s.get("sha256_ends"):
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
    key = _cache_key(src, data_cfg, data_cfg.vocab_size, vocab)
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
        n = sum(len(s) for s, _ in limited(story_batches(src, "train"), limit))
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
            for stories, nbytes in limited(story_batches(src, split), lim):
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
                              "sha256_ends": sha256_ends_of(s.path)}
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
