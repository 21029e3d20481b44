"""train.tensorboard=true: every metrics row is in the run folder's TensorBoard event
file, read back with tensorboard's own event reader."""
import json

import pytest

from conftest import tiny_overrides
from sonata.core.config import make_config
from sonata.train.tensorboard_log import scalar_tag
from sonata.train.trainer import Trainer

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_training_run_writes_every_metrics_row_as_scalars(tmp_path):
    cfg = make_config(tiny_overrides(**{"train.tensorboard": "true", "train.eval_every": 3}))
    Trainer(cfg, tmp_path, progress="none").run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert list(tmp_path.glob("events.out.tfevents.*"))
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in ("loss", "lr", "tok_per_s", "grad_norm", "mem_bytes", "peak_mem_bytes", "val_loss", "val_bpb"):
        assert scalar_tag(key) in tags, key
    for key in ("loss", "lr", "tok_per_s", "grad_norm"):
        got = {e.step: e.value for e in acc.Scalars(scalar_tag(key))}
        assert sorted(got) == [r["step"] for r in rows] == list(range(1, 7))
        for r in rows:
            assert got[r["step"]] == pytest.approx(r[key], rel=1e-6)
    val = {e.step: e.value for e in acc.Scalars("val/bpb")}
    assert sorted(val) == [3, 6] and val[6] == pytest.approx(rows[-1]["val_bpb"], rel=1e-6)


def test_tensorboard_is_off_by_default(tmp_path):
    Trainer(make_config(tiny_overrides(**{"train.max_steps": 1})), tmp_path, progress="none").run()
    assert not list(tmp_path.glob("events.out.tfevents.*"))
