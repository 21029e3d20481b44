"""TensorBoard scalars for a training run (`train.tensorboard=true`).

The trainer hands every metrics row it writes to `metrics.jsonl` to
`TensorBoardLog.write` as well: each numeric field becomes a scalar at the row's
step (loss, lr, tokens/s, grad norm, memory, validation loss and bits per byte,
and whatever else the row holds), grouped as train/, val/ and memory/. The event
files go into the run folder itself, so `tensorboard --logdir runs` lists one run
per folder. Written through `torch.utils.tensorboard`.
"""
from __future__ import annotations

import math
from pathlib import Path

from sonata.core.errors import SonataError


def scalar_tag(key: str) -> str:
    """TensorBoard tag of a metrics-row field: val_loss -> val/loss, peak_mem_bytes ->
    memory/peak_mem_bytes, loss -> train/loss."""
    if key.startswith("val_"):
        return "val/" + key[4:]
    if "mem" in key:
        return "memory/" + key
    return "train/" + key


class TensorBoardLog:
    """One SummaryWriter in `run_dir`; `write(row)` adds the row's numbers at row["step"]."""

    def __init__(self, run_dir):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise SonataError(f"train.tensorboard=true needs the tensorboard package "
                              f"(pip install tensorboard): {e}") from None
        self.dir = Path(run_dir)
        self._writer = SummaryWriter(log_dir=str(self.dir))

    def write(self, row: dict) -> None:
        step = int(row["step"])
        for key, v in row.items():
            if key == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(v) or key in ("loss", "grad_norm", "val_loss", "val_bpb"):
                self._writer.add_scalar(scalar_tag(key), float(v), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
