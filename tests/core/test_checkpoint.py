import os

import pytest
import torch

from sonata.core import checkpoint as ckpt
from sonata.core.errors import CheckpointError


class _Payload:
    """Unpickling this would create a file: the safe loader must never do it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mknod, (self.marker,))


def test_round_trip(tmp_path):
    p = ckpt.save({"w": torch.arange(5.0), "step": 3, "nested": {"a": [1, 2]}}, tmp_path / "c.pt")
    s = ckpt.load(p)
    assert s["step"] == 3 and torch.equal(s["w"], torch.arange(5.0)) and s["nested"] == {"a": [1, 2]}
    assert [f.name for f in tmp_path.iterdir()] == ["c.pt"]   # no temp file left behind


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"format": ckpt.FORMAT, "x": _Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="could run code"):
        ckpt.load(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize("cut", [10, 200, -50])
def test_truncated_checkpoint_is_refused(tmp_path, cut):
    p = ckpt.save({"w": torch.randn(1000)}, tmp_path / "c.pt")
    data = p.read_bytes()
    p.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ckpt.load(p)


def test_foreign_file_is_not_a_sonata_checkpoint(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a sonata checkpoint"):
        ckpt.load(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not found"):
        ckpt.load(tmp_path / "missing.pt")
