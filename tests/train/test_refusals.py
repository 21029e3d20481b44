"""A refused command changes nothing; one lock for every writer; validation that matches the model.

Every command that writes checks all it is given (the overrides against the config they change,
the --init / --resume files loaded, the weights against the model) before the first file is
created, removed or replaced: an exit 2 leaves every folder byte-identical. The run folder's lock
lives in `Trainer.run()`, so a notebook's or a script's run and a command-line run exclude each
other, and the lock file is never removed."""
import fcntl
import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, _assert_one_error_line, run_cli, snapshot, tiny_overrides, train_in_process, wait_for
from sonata.__main__ import _wrote, main
from sonata.core import checkpoint as ckpt
from sonata.core.config import make_config
from sonata.core.errors import SonataError
from sonata.train.trainer import Trainer


def one_error(capsys, argv, fragment):
    capsys.readouterr()
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error:") and fragment in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of 4 steps with kept copies of steps 2, 3 and 4."""
    return train_in_process(tmp_path_factory.mktemp("refusals") / "run",
                            **{"train.max_steps": 4, "train.checkpoint_every": 1, "train.keep_checkpoints": 3})


@pytest.fixture
def run(finished, tmp_path):
    """A fresh copy of the finished run, to be refused into."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def test_a_refused_init_leaves_the_run_folder_byte_identical(run, tmp_path, capsys):
    """Issue 57 item 1: `--init X --out DIR --force` removed DIR's run (its checkpoint, metrics and
    summary) before loading X, then failed on X: the only copy of the weights was gone. Every
    refusal now comes first; a good --init with --force replaces the run and trains from the weights."""
    before = snapshot(run)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    common = ["train", "--out", str(run), "--force", "--progress", "none", *tiny_overrides()]
    one_error(capsys, [*common, "--init", str(junk)], "corrupt")
    one_error(capsys, [*common, "--init", str(run / "missing.pt")], "checkpoint not found")
    one_error(capsys, [*common, "--init", str(run / "checkpoint-step00000003.pt"), "model.d_model=48"],
              "embedding.weight is (300, 32) in the checkpoint and (300, 48) in this model")
    one_error(capsys, [*common, "--init", str(run / "checkpoint.pt"), "model.n_layers=2"],
              "the first layers.1.")
    one_error(capsys, [*common, "--init", str(run / "checkpoint.pt"), "train.max_step=3"],
              "unknown config key 'train.max_step'")
    assert snapshot(run) == before
    # the command the issue meant to run: a new run from the old one's weights, replacing it
    weights = ckpt.load(run / "checkpoint.pt")["model"]
    assert main([*common, "--init", str(run / "checkpoint.pt"), "train.max_steps=2", "train.lr=1e-9",
                 "train.warmup_steps=0"]) == 0
    assert ckpt.copies(run / "checkpoint.pt") == {}                          # the old run's copies went
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    new = ckpt.load(run / "checkpoint.pt")["model"]
    assert all(torch.allclose(new[k], weights[k], atol=1e-6) for k in weights)   # trained from them


def test_a_typo_on_resume_discards_nothing(run, capsys):
    """Issue 57 item 2: resuming an older copy with --force and a mistyped override discarded the
    later checkpoint, the later copy and the later metrics rows, then refused the key. Overrides
    are now applied to the checkpoint's config first, and so is a change the weights cannot take."""
    before = snapshot(run)
    old = run / "checkpoint-step00000003.pt"
    one_error(capsys, ["train", "--resume", str(old), "--force", "train.max_step=5"],
              "unknown config key 'train.max_step'")
    one_error(capsys, ["train", "--resume", str(old), "--force", "model.d_model=48"], "does not match")
    one_error(capsys, ["train", "--resume", str(old), "train.max_steps=5"], "would discard that run's later state")
    assert snapshot(run) == before
    assert main(["train", "--resume", str(old), "--force", "--progress", "none", "train.max_steps=5"]) == 0
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_validation_errors_create_no_folder(tmp_path, capsys):
    """Issue 57 items 6, 7, 11, 12: a hybrid's attention layers, a Mamba-3 rotation that rotates
    no pair, float32's range, and weights that do not fit are each one line before any folder is made."""
    out = tmp_path / "never"
    base = ["train", "--out", str(out), "--progress", "none", *tiny_overrides()]
    one_error(capsys, [*base, "model.layers=mamba2,attention", "model.n_heads=5"],
              "model.n_heads (5) must divide model.d_model (32) into heads of even width (rotary positions "
              "rotate pairs): the attention layers of model.layers=mamba2,attention")
    one_error(capsys, [*base, "model.arch=mamba3", "model.d_state=16", "model.rope_fraction=0.1"],
              "model.rope_fraction=0.1 rotates no pair of the 16 state channels")
    one_error(capsys, [*base, "model.arch=mamba3", "model.d_state=3"], "give at least 0.666667 to rotate a pair")
    one_error(capsys, [*base, "model.embed_std=1e300"], "model.embed_std must be within float32's range")
    one_error(capsys, [*base, "model.embed_std=1e5"], "model.embed_std must be in (0, 10000]")
    one_error(capsys, [*base, "model.dt_max=1e39"], "model.dt_max must be within float32's range")
    one_error(capsys, [*base, "model.d_model=4294967296"], "model.d_model must be at most 2,147,483,647")
    one_error(capsys, [*base, "train.weight_decay=1000"], "train.weight_decay (1000) x train.lr (0.003) must be below 1")
    one_error(capsys, [*base, "model.d_model=65536", "model.n_layers=64"], "memory budget exceeded: this run needs at least")
    one_error(capsys, [*base, "train.micro_batch=0", "train.fixed_micro_batch=1000000000"],
              "one micro-batch of 1000000000 x 32 tokens' logits")
    src = tmp_path / "src"
    assert main(["train", "--out", str(src), "--progress", "none", *tiny_overrides(**{"train.max_steps": 1})]) == 0
    one_error(capsys, [*base, "--init", str(src / "checkpoint.pt"), "model.arch=attention"],
              "(the checkpoint's model is mamba, this one attention)")
    assert not out.exists()
    # the ends of the ranges run: the one pair a fraction of 2/16 rotates, embed_std at its ceiling
    for extra in (["model.arch=mamba3", "model.d_state=16", "model.rope_fraction=0.125"],
                  ["model.embed_std=10000", "train.max_steps=2"]):
        assert main([*base, "--force", *extra]) == 0
        assert ckpt.load(out / "checkpoint.pt")["step"] >= 1


def test_the_wrote_line_names_only_files_that_exist(tmp_path):
    """Issue 57 item 12: a run whose weights were not finite printed `wrote .../checkpoint.pt`,
    a file it never wrote (the trainer keeps non-finite weights out of every checkpoint)."""
    out = tmp_path / "nan"
    tr = Trainer(make_config(tiny_overrides(**{"train.max_steps": 2})), out, progress="none")

    def poison(trainer, row):
        if row["step"] == 2:
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite weights"):
        tr.run(on_step=poison)
    line = _wrote(out, tr)
    assert not (out / "checkpoint.pt").exists()
    assert line == (f"wrote {out}/metrics.jsonl, {out}/summary.json; no checkpoint of this run: "
                    f"its weights are not finite")
    good = tmp_path / "good"
    tr = Trainer(make_config(tiny_overrides(**{"train.max_steps": 1})), good, progress="none")
    tr.run()
    assert _wrote(good, tr) == f"wrote {good}/metrics.jsonl, {good}/checkpoint.pt, {good}/summary.json"


HOLD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import tiny_overrides
from sonata.core.config import make_config
from sonata.train.trainer import Trainer
out, flag, release = Path({out!r}), Path({flag!r}), Path({release!r})
def hold(trainer, row):
    flag.touch()
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
Trainer(make_config(tiny_overrides(**{{"train.max_steps": 1}})), out, progress="none").run(on_step=hold)
"""


def test_a_library_run_holds_its_folder_against_the_command_line(tmp_path):
    """Issue 57 item 3: only the command line took the run folder's lock, so a `Trainer(cfg, DIR).run()`
    (a notebook's run) and a CLI run could write into one folder. The lock lives in Trainer.run()
    now: while a script's run holds DIR, `train --out DIR --force` is refused naming it and removes
    nothing; the script's run then ends normally."""
    out, flag, release = tmp_path / "lib", tmp_path / "started", tmp_path / "release"
    script = HOLD.format(tests=str(REPO / "tests"), out=str(out), flag=str(flag), release=str(release))
    holder = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for(flag, holder)
        before = snapshot(out)
        r = run_cli("train", "--out", str(out), "--force", "--progress", "none", *tiny_overrides())
        _assert_one_error_line(r, f"--out {out} is in use by another run (pid {holder.pid}, started ")
        assert "Trainer.run() in python -c" in r.stderr
        assert snapshot(out) == before
        release.touch()
        assert holder.wait(timeout=120) == 0, holder.communicate()[1][-2000:]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert ckpt.load(out / "checkpoint.pt")["step"] == 1
    assert (out / ckpt.RUN_LOCK).read_text() == ""                          # unheld: nobody named


def test_a_command_line_run_holds_its_folder_against_a_library_run(tmp_path):
    """The other way round: while `python -m sonata train` runs into DIR, a Trainer(cfg, DIR).run()
    from Python is refused with one line naming the command, before it writes anything."""
    out = tmp_path / "cli"
    args = ["train", "--out", str(out), "--progress", "none",
            *tiny_overrides(**{"train.max_steps": 400, "train.decay_steps": 400, "train.checkpoint_every": 1})]
    first = subprocess.Popen([sys.executable, "-m", "sonata", *args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(out / "checkpoint.pt", first)
        tr = Trainer(make_config(tiny_overrides()), out, progress="none")
        rows = len((out / "metrics.jsonl").read_text().splitlines())
        with pytest.raises(SonataError, match=rf"in use by another run \(pid {first.pid}, started .*: "
                                              rf"python -m sonata train --out {out}"):
            tr.run()
        assert len((out / "metrics.jsonl").read_text().splitlines()) >= rows     # its rows are all there
        assert tr.record.step == 0
    finally:
        first.kill()
        first.wait()


def test_the_lock_file_is_never_removed_so_two_later_runs_never_both_hold_it(tmp_path):
    """Issue 57 item 3, the lock file: a refused run removed the lock file it had made. A process
    that had opened that file before could then lock the removed file while a later run locked a new
    one: two holders. The file now stays, and every opener locks the same file."""
    out = tmp_path / "k"
    path = out / ckpt.RUN_LOCK
    early = None
    with pytest.raises(SonataError, match="holds"):
        with ckpt.run_folder_lock(out):
            early = open(path)                           # another process's open, before the refusal
            raise SonataError("--out holds a run (a refused claim)")
    assert path.exists()
    fcntl.flock(early, fcntl.LOCK_EX | fcntl.LOCK_NB)    # that process now holds the lock...
    try:
        with pytest.raises(SonataError, match="is in use by another run"):
            with ckpt.run_folder_lock(out):              # ...so a later run is refused, not a second holder
                pass
    finally:
        early.close()
    with ckpt.run_folder_lock(out):                      # free again: taken, and re-entered by this process
        assert ckpt.holds_run_folder(out)
        with ckpt.run_folder_lock(out):
            assert "pid" in path.read_text()
        assert ckpt.holds_run_folder(out)
    assert not ckpt.holds_run_folder(out) and path.read_text() == ""


def test_the_lock_is_taken_again_when_its_file_was_replaced(tmp_path, monkeypatch):
    """Should a lock file be removed and made anew all the same (by hand, or an older sonata), a
    run that locked the removed file finds out (the inode differs) and locks the file the path names."""
    out = tmp_path / "k"
    out.mkdir()
    path = out / ckpt.RUN_LOCK
    path.write_text("")
    real = fcntl.flock
    replaced = []

    def flock_then_replace(f, op):
        real(f, op)
        if not replaced:                                 # between this open and the check: replaced
            replaced.append(True)
            path.unlink()
            path.write_text("")
    monkeypatch.setattr(fcntl, "flock", flock_then_replace)
    with ckpt.run_folder_lock(out):
        f = ckpt._locks[str(out.resolve())][0]
        import os
        assert os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
    assert replaced


def test_eval_lengths_are_bounded(tmp_path, capsys):
    """Issue 57 item 10: `eval --lengths 99999999999999999999` ran until killed (--budget-s cannot
    stop the first length). Lengths above 2^24 are one error line, at once."""
    out = tmp_path / "task"
    assert main(["train", "--out", str(out), "--progress", "none", "task.name=parity", "model.d_model=16",
                 "model.n_layers=1", "model.d_state=4", "data.seq_len=16", "train.max_steps=1",
                 "train.micro_batch=4", "train.effective_batch=4", "task.eval_seqs=4"]) == 0
    t0 = time.monotonic()
    one_error(capsys, ["eval", str(out / "checkpoint.pt"), "--lengths", "16,99999999999999999999"],
              "--lengths: each length must be at most 16,777,216 (2^24) tokens, not 99,999,999,999,999,999,999")
    one_error(capsys, ["eval", str(out / "checkpoint.pt"), "--lengths", str(2 ** 24 + 1)], "at most 16,777,216")
    assert time.monotonic() - t0 < 60
    assert main(["eval", str(out / "checkpoint.pt"), "--lengths", "16,32", "--n", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["length"] for r in rows] == [16, 32] and all(0 <= r["accuracy"] <= 1 for r in rows)
