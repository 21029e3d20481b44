"""Checkpoints and the run's other files: written atomically, loaded safely.

Save: the bytes are serialized in memory first (so their size is known), written
to a temp file in the same folder, flushed and fsync'ed, then renamed over the
target (and the folder fsync'ed), so a crash at any moment leaves either the old
or the new file, never half of one. A write that fails (disk full, I/O error)
raises `WriteError` naming the path, what was written and how many bytes it
needed; its temp file is removed and the previous file stays. Temp files left by
a process that was killed mid-write are removed by the next save. Load:
`torch.load(weights_only=True)`, so a file that would run code is refused; every
failure is a `CheckpointError` with one line naming the file and the problem.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import torch

from sonata.core import inject
from sonata.core.errors import CheckpointError, WriteError

FORMAT = "sonata-checkpoint-v1"

_writes = 0          # atomic writes of this process (a test switch counts them: sonata.core.inject)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale_temp(path: Path) -> None:
    """Remove temp files of `path` left by processes that no longer run (killed mid-write)."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def write_atomic(path, data: bytes, what: str) -> Path:
    """Write `data` to `path` atomically; WriteError (path, what, bytes) when it fails."""
    global _writes
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _writes += 1
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        clear_stale_temp(path)
        with open(tmp, "wb") as f:
            inject.disk_full(_writes)                     # test-only; nothing when unset
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        inject.slow_save()                                # test-only; nothing when unset
        os.replace(tmp, path)
    except OSError as e:
        advice = ("the previous checkpoint, if any, is unchanged",) if what == "checkpoint" else ()
        raise WriteError(path, what, len(data), e.strerror or str(e), *advice) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save(state: dict, path) -> Path:
    return write_atomic(path, to_bytes({"format": FORMAT, **state}), "checkpoint")


def load(path, map_location="cpu") -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"checkpoint path is a folder, not a file: {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut one has no directory
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt (not a complete torch archive)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        what = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln),
                    "unsupported content")
        raise CheckpointError(f"refusing checkpoint {path}: it holds objects that are not plain "
                              f"tensors and containers and could run code ({what[:160]})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({first[:160]})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a sonata checkpoint")
    return state


class MetricsLog:
    """metrics.jsonl: one JSON row per line, appended and flushed row by row. Opened for
    a resumed run, rows past the checkpoint's step are dropped first (the file is
    rewritten atomically, so a kill at that moment loses nothing), and `last_row`, the
    checkpoint's row of its own step, is added when the file lacks it (the process that
    writes the file died after the step, before its row)."""

    def __init__(self, path, through_step: int = 0, last_row: dict | None = None):
        self.path = Path(path)
        if through_step and (self.path.exists() or last_row):
            kept, last = [], 0
            text = self.path.read_text(errors="replace") if self.path.exists() else ""
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:        # a row cut by a kill
                    continue
                if row.get("step", 0) <= through_step:
                    kept.append(line + "\n")
                    last = max(last, row.get("step", 0))
            if last_row is not None and last_row.get("step") == through_step and last < through_step:
                kept.append(json.dumps(last_row) + "\n")
            write_atomic(self.path, "".join(kept).encode(), "metrics file")
        elif not through_step:
            write_atomic(self.path, b"", "metrics file")
        self._f = open(self.path, "a")

    def write(self, row: dict) -> None:
        line = json.dumps(row) + "\n"
        try:
            self._f.write(line)
            self._f.flush()
        except OSError as e:
            raise WriteError(self.path, "metrics row", len(line.encode()), e.strerror or str(e)) from None

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:          # the failed row was reported already
            pass


RUN_FILES = ("checkpoint.pt", "metrics.jsonl", "summary.json", "model_int8.pt")


def run_files(folder) -> list[Path]:
    """The files of a training run in `folder` (what a run writes there: its checkpoint and
    kept copies, metrics, summary, int8 export, TensorBoard events), sorted; [] for a folder
    that holds no run or does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [folder / n for n in RUN_FILES if (folder / n).exists()]
    found += folder.glob("checkpoint-step*.pt")
    found += folder.glob("events.out.tfevents.*")
    return sorted(set(found))


def keep_last(path, step: int, k: int) -> None:
    """Keep a copy of checkpoint `path` as `<stem>-step<N>.pt` (a hard link: no second
    write) and remove all but the last `k` such copies."""
    path = Path(path)
    copy = path.with_name(f"{path.stem}-step{step:08d}{path.suffix}")
    try:
        copy.unlink(missing_ok=True)
        os.link(path, copy)
    except OSError:                       # no hard links here: write it out
        write_atomic(copy, path.read_bytes(), "checkpoint")
    for old in sorted(path.parent.glob(f"{path.stem}-step*{path.suffix}"))[:-k]:
        old.unlink(missing_ok=True)
