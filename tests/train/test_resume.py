"""Issue 42: resumes and initialisations that say what they did. Resuming an older copy never
loses the run it came from; a resume's optimizer settings apply; `--init` keeps its weights'
vocabulary; a checkpoint of another version, or one whose bytes are corrupt, is one error line;
a diverged run never names a checkpoint it did not write."""
import json
import random

import pytest
import torch

from conftest import _assert_one_error_line, run_cli, tiny_overrides
from sonata.core import checkpoint as ckpt
from sonata.core.config import Config, apply_overrides, make_config
from sonata.core.errors import TrainingDiverged
from sonata.data.vocab import EOT
from sonata.train.trainer import Trainer


def _rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _copy_steps(folder):
    return sorted(int(p.stem.rsplit("step", 1)[1]) for p in folder.glob("checkpoint-step*.pt"))


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_resuming_an_older_copy_branches_or_discards_but_never_loses_silently(tmp_path):
    """Item 2: train 8 steps keeping 2 copies, then `--resume DIR/checkpoint-step00000006.pt
    train.max_steps=7`: before, steps 7-8 vanished from the metrics, the step-8 state was
    overwritten, the step-6 copy (the one resumed from) was deleted and the abandoned step-8
    copy stayed. Now that is one error line saying what would be lost and changing nothing;
    --out NEW branches (the old run stays whole, the new folder's metrics start with the old
    rows through step 6); --force discards the later state, says so, and keeps the copy it
    resumed from."""
    run = tmp_path / "run"
    base = tiny_overrides(**{"train.max_steps": 8, "train.decay_steps": 8, "train.checkpoint_every": 2,
                             "train.keep_checkpoints": 2})
    r = run_cli("train", "--out", str(run), "--progress", "none", *base)
    assert r.returncode == 0, r.stderr
    copy6 = run / "checkpoint-step00000006.pt"
    assert _copy_steps(run) == [6, 8]
    before, old_rows = _files(run), _rows(run)

    r = run_cli("train", "--resume", str(copy6), "--progress", "none", "train.max_steps=7")
    _assert_one_error_line(r, f"resuming {copy6} (step 6) in {run} would discard that run's later state: "
                              f"checkpoint.pt (step 8), checkpoint-step00000008.pt and 2 metrics rows")
    assert "--out NEW_DIR" in r.stderr and "--force" in r.stderr
    assert _files(run) == before

    branch = tmp_path / "branch"
    r = run_cli("train", "--resume", str(copy6), "--out", str(branch), "--progress", "none", "train.max_steps=7")
    assert r.returncode == 0, r.stderr
    assert _files(run) == before                                   # the old run stays whole
    rows = _rows(branch)
    assert [row["step"] for row in rows] == list(range(1, 8)) and rows[:6] == old_rows[:6]
    assert ckpt.load(branch / "checkpoint.pt")["step"] == 7

    r = run_cli("train", "--resume", str(copy6), "--force", "--progress", "none", "train.max_steps=7")
    assert r.returncode == 0, r.stderr
    assert "discarded checkpoint.pt (step 8), checkpoint-step00000008.pt and 2 metrics rows" in r.stdout
    assert _copy_steps(run) == [6, 7]                             # the resumed copy stays; 8 is gone
    assert ckpt.load(copy6)["step"] == 6 and ckpt.load(run / "checkpoint.pt")["step"] == 7
    assert [row["step"] for row in _rows(run)] == list(range(1, 8))
    assert [row["loss"] for row in _rows(run)] == [row["loss"] for row in rows]   # the branch's timeline


def test_a_resumes_weight_decay_and_beta2_apply_and_are_recorded(tmp_path):
    """Item 3: on resume the optimizer's saved groups won over train.weight_decay and
    train.beta2 while the run's recorded config said the overrides applied."""
    first = Trainer(make_config(tiny_overrides(**{"train.max_steps": 2, "train.decay_steps": 4})), tmp_path,
                    progress="none")
    first.run()
    state = ckpt.load(tmp_path / "checkpoint.pt")
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.1, 0.0]
    cfg = apply_overrides(Config.from_dict(state["config"]),
                          ["train.weight_decay=0.5", "train.beta2=0.9", "train.max_steps=3"])
    tr = Trainer(cfg, tmp_path, state=state, progress="none")
    assert [g["weight_decay"] for g in tr.optimizer.param_groups] == [0.5, 0.0]   # no decay on A, D, norms
    assert all(g["betas"] == (0.9, 0.9) for g in tr.optimizer.param_groups)
    tr.run()
    saved = ckpt.load(tmp_path / "checkpoint.pt")
    assert [g["weight_decay"] for g in saved["optimizer"]["param_groups"]] == [0.5, 0.0]
    assert [tuple(g["betas"]) for g in saved["optimizer"]["param_groups"]] == [(0.9, 0.9)] * 2
    assert (saved["config"]["train"]["weight_decay"], saved["config"]["train"]["beta2"]) == (0.5, 0.9)
    # the moments came through: the resumed step counts go on from the checkpoint's
    assert all(float(s["step"]) == 3 for s in saved["optimizer"]["state"].values())


def _other_text(path, n=90):
    rnd = random.Random(0)
    words = ["robot", "engine", "planet", "copper", "signal", "orbit", "quartz", "lever", "vector", "tunnel",
             "magnet", "piston", "comet", "galaxy", "circuit", "nozzle", "radar", "sensor", "module", "rocket"]
    stories = [" ".join(rnd.choice(words) for _ in range(60)) + "." for _ in range(n)]
    path.write_text(f"\n{EOT}\n".join(stories) + "\n")
    return path


def test_init_keeps_the_initial_checkpoints_vocabulary(tmp_path):
    """Item 5: `train --init CKPT` on other text built a new vocabulary from that text and
    loaded the weights row for row into it (the shapes match, the meanings do not). The run now
    encodes its text with the initial checkpoint's vocabulary; asking for another is one line."""
    a = tmp_path / "a"
    r = run_cli("train", "--out", str(a), "--progress", "none", *tiny_overrides(**{"train.max_steps": 2}))
    assert r.returncode == 0, r.stderr
    text = _other_text(tmp_path / "other.txt")
    b = tmp_path / "b"
    r = run_cli("train", "--init", str(a / "checkpoint.pt"), "--out", str(b), "--progress", "none",
                *tiny_overrides(**{"train.max_steps": 2, "data.source": str(text)}))
    assert r.returncode == 0, r.stderr
    sa, sb = ckpt.load(a / "checkpoint.pt"), ckpt.load(b / "checkpoint.pt")
    assert torch.equal(sa["vocab"]["tokens"], sb["vocab"]["tokens"])
    assert sb["config"]["data"]["vocab_size"] == sa["config"]["data"]["vocab_size"] == 300
    r = run_cli("train", "--init", str(a / "checkpoint.pt"), "--out", str(tmp_path / "c"), "--progress", "none",
                *tiny_overrides(**{"train.max_steps": 2, "data.source": str(text), "data.vocab_size": 400}))
    _assert_one_error_line(r, "has the vocabulary of data.vocab_size=300, which a run from its weights keeps")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("small")
    r = run_cli("train", "--out", str(out), "--progress", "none", *tiny_overrides(**{"train.max_steps": 2}))
    assert r.returncode == 0, r.stderr
    return out / "checkpoint.pt"


@pytest.mark.parametrize("change, fragment", [
    (lambda s: s["config"]["model"].update(d_model="32"), "bad value for model.d_model: '32' is not an int"),
    (lambda s: s["config"]["data"].update(old_key=1), "unknown config key data.old_key"),
    (lambda s: s["plan"].pop("effective_batch"), "does not fit this version of sonata (KeyError"),
])
def test_a_checkpoint_of_another_version_is_one_error_line_naming_it(tmp_path, small_run, change, fragment):
    """Item 13: fields of another type gave tracebacks (`'>' not supported between 'str' and
    'int'`, a KeyError of the plan), and "unknown config key" did not name the checkpoint."""
    state = ckpt.load(small_run)
    change(state)
    old = ckpt.save(state, tmp_path / "old.pt")
    r = run_cli("train", "--resume", str(old), "--out", str(tmp_path / "o"), "train.max_steps=3")
    _assert_one_error_line(r, fragment)
    assert str(old) in r.stderr


def test_a_checkpoint_with_corrupt_tensor_bytes_is_not_resumed(tmp_path, small_run):
    """Item 6 on the command line: 2,000 bytes flipped mid-file, which resumed before."""
    bad = tmp_path / "bad.pt"
    data = bytearray(small_run.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 2000] = bytes(b ^ 0xFF for b in data[mid:mid + 2000])
    bad.write_bytes(bytes(data))
    for args in (("train", "--resume", str(bad), "--out", str(tmp_path / "o"), "train.max_steps=3"),
                 ("eval", str(bad), "--text", str(_other_text(tmp_path / "t.txt")))):
        _assert_one_error_line(run_cli(*args), f"checkpoint {bad} is corrupt")
    assert not (tmp_path / "o" / "checkpoint.pt").exists()


def test_a_diverged_run_never_names_a_checkpoint_it_did_not_write(tmp_path):
    """Item 10: a model with non-finite weights is never saved, yet the divergence message
    said "the last good state is in DIR/checkpoint.pt", a file that did not exist."""
    tr = Trainer(make_config(tiny_overrides(**{"train.max_steps": 10, "train.max_nonfinite": 2})), tmp_path,
                 progress="none")
    with torch.no_grad():
        tr.model.layers[0].mixer.D.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite weights"), pytest.raises(TrainingDiverged) as e:
        tr.run()
    assert not (tmp_path / "checkpoint.pt").exists()
    assert "no checkpoint was written" in str(e.value) and "checkpoint.pt" not in str(e.value)
