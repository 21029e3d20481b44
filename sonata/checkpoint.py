"""Checkpoints: written atomically, loaded safely.

Save: a temp file in the same folder, flushed and fsync'ed, then renamed over
the target (and the folder fsync'ed), so a crash at any moment leaves either the
old or the new checkpoint, never half of one. Load: `torch.load(weights_only=True)`,
so a file that would run code is refused; every failure is a `CheckpointError`
with one line naming the file and the problem.
"""
from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch

from sonata.errors import CheckpointError

FORMAT = "sonata-checkpoint-v1"


def save(state: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


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
