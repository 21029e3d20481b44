"""Where the stories come from: a data source's files (or the hub's dataset), read
whole (`load_stories`, the in-memory reference) or streamed in batches of stories
(`story_batches`, what `sonata.data.token_cache.prepare` reads), and the train/validation
split by story when a source has no validation split of its own.
"""
from __future__ import annotations

import codecs
import hashlib
import os
import random
import re
import socket
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sonata.core.errors import DataError
from sonata.data.vocab import EOT

EMBEDDED_CORPUS = Path(__file__).resolve().parents[2] / "data" / "stories.txt"
HUB_ID = "roneneldan/TinyStories"
SPLIT_SEED = 20231107       # fixed: the train/validation split never depends on train.seed


# --------------------------------------------------------------------------- corpus

def split_stories(text: str) -> list[str]:
    """Stories of an `<|endoftext|>`-separated text, stripped, empty ones dropped."""
    return [s.strip() for s in text.split(EOT) if s.strip()]


def read_text(path: Path, what: str = "data file") -> str:
    """The UTF-8 text of a file; a missing or undecodable file is one error naming it as `what`."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{what} not found: {path}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"cannot read {what} {path}: {e.strerror}") from None


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


def _load_hub(hint: str, **kw):
    """`datasets.load_dataset(HUB_ID, **kw)`; fails fast and clearly when offline (only
    a local Hugging Face cache can answer then: no retry loop), `hint` saying what to do."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or not _hub_reachable()
    if offline:
        _force_hub_offline()
    import datasets
    if offline:
        _force_hub_offline()
    try:
        return datasets.load_dataset(HUB_ID, **kw)
    except Exception:
        raise DataError(f"cannot load {HUB_ID} from the Hugging Face hub "
                        f"({'offline' if offline else 'download failed'}); {hint}") from None


def load_tinystories_hub() -> list[str]:
    """TinyStories' training split from the Hugging Face hub (see `_load_hub`)."""
    return _texts_from_dataset(_load_hub("point data.source at a local TinyStories .txt or .parquet "
                                         "file, or set SONATA_TINYSTORIES=/path/to/file", split="train"))


def load_stories(source: str = "embedded", max_stories: int = 0) -> list[str]:
    """The stories of a data source, in order.

    `embedded`: the project's own corpus (data/stories.txt). `tinystories`: the file
    named by $SONATA_TINYSTORIES if set, else the hub. Anything else is a path to an
    `<|endoftext|>`-separated .txt file, a .parquet file with a `text` column, or a
    folder laid out like the hub dataset.
    """
    if source == "embedded":
        stories = split_stories(read_text(EMBEDDED_CORPUS))
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


# --------------------------------------------------------------------------- streamed sources

SPLITS = ("train", "validation")
_VAL_WORDS = {"validation", "valid", "val", "dev"}
_TEST_WORDS = {"test", "testing", "eval", "evaluation"}
BATCH_TEXT_BYTES = 4 << 20       # text per streamed batch of stories


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


def sha256_ends_of(path: Path, n: int = 1 << 20) -> str:
    """sha256 of a file's first and last `n` bytes (all of a smaller one): a cheap fingerprint of a large file."""
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
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256_ends": sha256_ends_of(path)}


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
    dd = _load_hub("point data.source at a local TinyStories .txt, .parquet or folder, "
                   "or set SONATA_TINYSTORIES=/path/to/it")
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


def limited(batches, limit: int):
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
