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


def _flip_middle(path, n=2000):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


def test_corrupt_tensor_bytes_are_refused_naming_the_file(tmp_path):
    """Issue 42 item 6: a checkpoint with 2,000 bytes flipped mid-file (inside a tensor's
    storage) loaded, resumed, generated and exported. Each member's checksum, recorded when
    it was saved, is now checked at load: a mismatch is a CheckpointError naming the file."""
    p = ckpt.save({"w": torch.randn(20_000), "step": 3}, tmp_path / "c.pt")
    assert torch.equal(ckpt.load(p)["w"], torch.load(p, weights_only=True)["w"])   # intact: loads
    _flip_middle(p)
    assert torch.load(p, weights_only=True)["step"] == 3          # torch itself does not notice
    with pytest.raises(CheckpointError) as e:
        ckpt.load(p)
    assert str(p) in str(e.value) and "corrupt" in str(e.value) and "checksum" in str(e.value)


def _copy_names(folder):
    return sorted(p.name for p in folder.glob("checkpoint-step*.pt"))


def test_keep_last_prunes_this_timelines_copies_in_step_order_and_spares_the_resumed_copy(tmp_path):
    """Issue 42 item 2: pruning sorted the copies' names and counted every copy in the folder,
    so a run resumed from an older copy deleted that copy and kept the abandoned timeline's
    later one. Now: this run's copies (steps up to its own) in numeric step order, never the
    one it resumed from."""
    main = tmp_path / "checkpoint.pt"
    for step in (10, 20, 30, 40):
        ckpt.save({"step": step}, main)
        ckpt.keep_last(main, step, 2)
    assert _copy_names(tmp_path) == ["checkpoint-step00000030.pt", "checkpoint-step00000040.pt"]
    resumed = tmp_path / "checkpoint-step00000030.pt"
    for step in (31, 32, 33):                   # a timeline branched from step 30
        ckpt.save({"step": step}, main)
        ckpt.keep_last(main, step, 2, keep=(resumed,))
    assert _copy_names(tmp_path) == ["checkpoint-step00000030.pt", "checkpoint-step00000032.pt",
                                     "checkpoint-step00000033.pt", "checkpoint-step00000040.pt"]
    assert ckpt.load(resumed)["step"] == 30
    assert list(ckpt.copies(main)) == [30, 32, 33, 40]           # by step


@pytest.mark.parametrize("section, key, value, fragment", [
    ("model", "d_model", "32", "bad value for model.d_model: '32' is not an int"),
    ("train", "max_steps", 8.0, "bad value for train.max_steps: 8.0 is not an int"),
    ("model", "old_field", 1, "unknown config key model.old_field"),
    ("data", None, [1], "config section 'data' is a list"),
])
def test_a_checkpoint_of_another_version_is_one_error_naming_the_file(tmp_path, section, key, value, fragment):
    """Issue 42 item 13: fields of another type gave tracebacks later (in the trainer, the
    model), and "unknown config key" did not name the checkpoint."""
    from sonata.core.config import Config
    cfg = Config().to_dict()
    if key is None:
        cfg[section] = value
    else:
        cfg[section][key] = value
    p = ckpt.save({"config": cfg, "step": 0}, tmp_path / "old.pt")
    with pytest.raises(CheckpointError) as e:
        ckpt.load(p)
    assert str(p) in str(e.value) and fragment in str(e.value) and "another version" in str(e.value)
    assert ckpt.load(ckpt.save({"config": Config().to_dict(), "step": 0}, tmp_path / "ok.pt"))["step"] == 0


def test_an_unreadable_checkpoint_is_called_unreadable_not_corrupt(tmp_path, monkeypatch):
    """Issue 42 item 14: before, a file the user may not read was 'truncated or corrupt'."""
    import builtins
    target = tmp_path / "checkpoint.pt"
    ckpt.save({"w": torch.zeros(3)}, target)

    def denied(path, *a, **k):
        if str(path) == str(target):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *a, **k)

    monkeypatch.setattr(ckpt, "open", denied, raising=False)     # root reads any file: simulate a denial
    with pytest.raises(CheckpointError, match=r"cannot be read \(Permission denied\)") as e:
        ckpt.load(target)
    assert "corrupt" not in str(e.value) and str(target) in str(e.value)


@pytest.mark.parametrize("vocab, why", [
    ({"kind": "gpt2", "tokens": torch.arange(3)}, "kind 'gpt2'"),
    ("o200k", "kind 'str'"),
    ({"kind": "o200k_base+bytes", "tokens": torch.rand(3)}, "not a 1-D integer tensor"),
    ({"kind": "o200k_base+bytes", "tokens": [1, 2]}, "not a 1-D integer tensor"),
    ({"kind": "o200k_base+bytes", "tokens": torch.tensor([5, -1])}, "not distinct non-negative"),
    ({"kind": "o200k_base+bytes", "tokens": torch.tensor([5, 5])}, "not distinct non-negative"),
])
def test_a_bad_vocabulary_is_refused_naming_the_file(tmp_path, vocab, why):
    """Before, a checkpoint whose vocabulary was another kind or not a tensor of ids loaded and
    failed later (a KeyError or AttributeError deep in the trainer, or 'unknown vocabulary
    kind' naming no file); now the load is one CheckpointError naming the file and the fault."""
    p = ckpt.save({"format": ckpt.FORMAT, "vocab": vocab}, tmp_path / "c.pt")
    with pytest.raises(CheckpointError, match=f"checkpoint {p} holds a vocabulary .*: .*{why}"):
        ckpt.load(p)
    good = {"kind": "o200k_base+bytes", "tokens": torch.tensor([9, 4, 200_000])}
    assert torch.equal(ckpt.load(ckpt.save({"format": ckpt.FORMAT, "vocab": good}, tmp_path / "g.pt"))["vocab"]["tokens"],
                       good["tokens"])
