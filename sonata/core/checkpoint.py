"""Checkpoints and the run's other files: written atomically, loaded safely.

Save: the bytes are serialized in memory first (so their size is known), written
to a temp file in the same folder, flushed and fsync'ed, then renamed over the
target (and the folder fsync'ed), so a crash at any moment leaves either the old
or the new file, never half of one. A write that fails (disk full, I/O error)
raises `WriteError` naming the path, what was written and how many bytes it
needed; its temp file is removed and the previous file stays. Temp files left by
a process that was killed mid-write are removed by the next save. Load: every member
of the archive (each tensor's storage, the pickle) is checked against the CRC-32 that
torch.save recorded for it, so a corrupt byte anywhere is refused before anything is
read; then `torch.load(weights_only=True)`, so a file that would run code is refused;
a training checkpoint's config must be one this version reads (its keys, types and
values). Every failure is a `CheckpointError` with one line naming the file and the
problem.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import torch

from sonata.core import inject
from sonata.core.config import Config
from sonata.core.errors import CheckpointError, ConfigError, SonataError, WriteError
from sonata.core.jsonsafe import finite_json

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
    try:                              # unreadable is not corrupt: say which (is_zipfile says neither)
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror or type(e).__name__})") from None
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut one has no directory
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt (not a complete torch archive)")
    _check_bytes(path)
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
    if "config" in state:
        try:
            Config.from_dict(state["config"])
        except ConfigError as e:
            raise CheckpointError(f"checkpoint {path} holds a configuration this version of sonata cannot "
                                  f"use (written by another version?): {e}") from None
    bad = _bad_vocab(state.get("vocab"))
    if bad:
        raise CheckpointError(f"checkpoint {path} holds a vocabulary this version of sonata cannot use: {bad}")
    return state


def _bad_vocab(v) -> str | None:
    """What is wrong with a checkpoint's vocabulary (`Vocab.state_dict()`: kind "o200k_base+bytes"
    and a 1-D integer tensor of distinct o200k ids), or None (also for a run without one)."""
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("kind") != "o200k_base+bytes":
        return f"kind {v.get('kind') if isinstance(v, dict) else type(v).__name__!r} (expected 'o200k_base+bytes')"
    t = v.get("tokens")
    if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.dtype.is_floating_point or t.dtype.is_complex \
            or t.dtype == torch.bool:
        return "its tokens are not a 1-D integer tensor"
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= 2 ** 31 or t.unique().numel() != t.numel()):
        return "its tokens are not distinct non-negative o200k ids"
    return None


def _check_bytes(path: Path) -> None:
    """Each member of the archive against the CRC-32 torch.save recorded for it at save (a
    tensor's storage is one member): a mismatch is a CheckpointError naming file and member."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({first[:160]})") from None
    if bad is not None:
        what = "a tensor's bytes" if "/data/" in bad else "its bytes"
        raise CheckpointError(f"checkpoint {path} is corrupt: {what} ({bad}) do not match the checksum "
                              f"recorded when it was saved")


class MetricsLog:
    """metrics.jsonl: one JSON row per line, appended and flushed row by row. Opened for
    a resumed run, rows past the checkpoint's step are dropped first (the file is
    rewritten atomically, so a kill at that moment loses nothing), and `last_row`, the
    checkpoint's row of its own step, is added when the file lacks it (the process that
    writes the file died after the step, before its row). `source`: the metrics of the run a
    resume branches from (its checkpoint is in another folder), whose rows through the
    checkpoint's step start this file when it does not exist yet."""

    @classmethod
    def for_run(cls, out_dir, step: int, last_row: dict | None, resumed_from=None) -> "MetricsLog":
        """A run's metrics.jsonl in `out_dir`, resumed at `step` from the checkpoint file
        `resumed_from` (None: a new run); a branch from another folder's checkpoint starts with
        that run's rows."""
        out_dir = Path(out_dir)
        branched = resumed_from is not None and Path(resumed_from).resolve().parent != out_dir.resolve()
        return cls(out_dir / "metrics.jsonl", through_step=step, last_row=last_row,
                   source=Path(resumed_from).parent / "metrics.jsonl" if branched else None)

    def __init__(self, path, through_step: int = 0, last_row: dict | None = None, source=None):
        self.path = Path(path)
        read = self.path if self.path.exists() or source is None else Path(source)
        if through_step and (read.exists() or last_row):
            kept, last = [], 0
            text = read.read_text(errors="replace") if read.exists() else ""
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:        # a row cut by a kill
                    continue
                if row.get("step", 0) <= through_step:
                    kept.append(line + "\n")
                    last = max(last, row.get("step", 0))
            if last_row is not None and last_row.get("step") == through_step and last < through_step:
                kept.append(finite_json(last_row) + "\n")
            write_atomic(self.path, "".join(kept).encode(), "metrics file")
        elif not through_step:
            write_atomic(self.path, b"", "metrics file")
        self._f = open(self.path, "a")

    def write(self, row: dict) -> None:
        line = finite_json(row) + "\n"
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
RUN_LOCK = ".sonata-run.lock"        # held (flock) by the process that runs into the folder
RUN_LOCKED_ENV = "SONATA_RUN_LOCKED"  # set by a launcher that holds the lock for its workers
_locks: dict[str, list] = {}          # folder -> [open lock file, depth] of the locks this process holds


def _describe_holder(who: str | None) -> str:
    import sys
    import time
    if who is None:                      # the command line, or the program that called the Trainer
        main = (os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c")
                else "python -c" if sys.argv else "python")
        who = (f"python -m sonata {' '.join(sys.argv[1:])}" if main == "__main__.py"
               else f"Trainer.run() in {main}")
    return f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: {who}"[:400]


def _lock_open(path: Path, folder: Path):
    """The lock file `path`, opened and flock'ed exclusively, or a SonataError naming its holder.
    The file is never removed (by anyone: a removed lock file lets two later runs each lock a
    file of their own); should it be replaced all the same, the inode is checked after locking
    and the lock taken again on the file the path now names."""
    import fcntl
    for _ in range(16):
        try:
            f = open(path, "a+")
        except OSError as e:
            raise SonataError(f"--out {folder}: cannot open its lock file {path.name}: "
                              f"{e.strerror or e}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            who = f.read().strip() or "a process that has not yet said which"
            f.close()
            raise SonataError(f"--out {folder} is in use by another run ({who}): wait for it to end, "
                              f"or choose another --out") from None
        try:
            same = os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
        except OSError:
            same = False
        if same:
            return f
        f.close()                         # locked a file that was unlinked meanwhile: again
    raise SonataError(f"--out {folder}: its lock file {path.name} keeps being replaced; is another "
                      f"program removing it?")


@contextlib.contextmanager
def run_folder_lock(folder, who: str | None = None):
    """An exclusive lock on run folder `folder` (created if needed) for the body: one run per
    folder, whoever starts it (the command line, `Trainer.run()` from a notebook or a script,
    a benchmark). flock: the kernel lets go when the process ends, killed or not, so no stale
    lock outlives it. A second run into the folder fails at once with one line naming the
    holder (`who`, default: this process's command line), written into the lock file when
    it is taken. Re-entrant in one process (the command line holds it around `Trainer.run()`,
    which takes it again); a launcher holding it for its workers (RUN_LOCKED_ENV) lets them
    pass. The lock file stays in the folder (an empty `.sonata-run.lock` when unheld)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder.resolve())
    if os.environ.get(RUN_LOCKED_ENV) == key:
        yield
        return
    if key in _locks:
        _locks[key][1] += 1
        try:
            yield
        finally:
            _locks[key][1] -= 1
        return
    f = _lock_open(folder / RUN_LOCK, folder)
    f.seek(0)
    f.truncate()
    f.write(_describe_holder(who))
    f.flush()
    _locks[key] = [f, 1]
    try:
        yield
    finally:
        del _locks[key]
        try:
            f.seek(0)
            f.truncate()                  # unheld: says nobody (a reader sees an empty file)
        except OSError:
            pass
        f.close()                         # closing lets go of the flock


def holds_run_folder(folder) -> bool:
    """Whether this process holds `folder`'s lock (or runs for a launcher that does)."""
    key = str(Path(folder).resolve())
    return key in _locks or os.environ.get(RUN_LOCKED_ENV) == key


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


def claim_run_folder(out, resume=None, force: bool = False) -> list[Path]:
    """Before a new run writes into `out`: a folder that holds another run is refused with one
    line pointing at --resume (to continue it) or --force (to replace it), unless `force`;
    with `force`, that run's files are removed (returned). Resuming a checkpoint of the folder
    itself continues that run (`claim_for_resume` judges it). Call it with the folder's lock
    held and after every check of the command has passed: it is the command's first write."""
    found = run_files(out)
    if not found or (resume and Path(resume).resolve().parent == Path(out).resolve()):
        return []
    if not force:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        hint = (f"--resume {Path(out) / 'checkpoint.pt'} continues it"
                if (Path(out) / "checkpoint.pt").exists() else "choose another --out")
        raise SonataError(f"--out {out} holds a run ({names}): {hint}, or --force replaces it")
    for p in found:
        p.unlink(missing_ok=True)
    return found


def copies(path) -> dict[int, Path]:
    """The kept copies of checkpoint `path` (`<stem>-step<N>.pt`) by step N, in step order."""
    path = Path(path)
    found = {}
    for p in path.parent.glob(f"{path.stem}-step*{path.suffix}"):
        n = p.name[len(path.stem) + len("-step"):-len(path.suffix)]
        if n.isdigit():
            found[int(n)] = p
    return dict(sorted(found.items()))


def keep_last(path, step: int, k: int, keep=()) -> None:
    """Keep a copy of checkpoint `path` as `<stem>-step<N>.pt` (a hard link: no second
    write) and remove all but the last `k` copies of this run, in numeric step order:
    the copies of steps up to `step` (a copy of a later step is another timeline's) other
    than those in `keep` (the copy the run resumed from is never removed)."""
    path = Path(path)
    keep = {Path(p).resolve() for p in keep if p}
    copy = path.with_name(f"{path.stem}-step{step:08d}{path.suffix}")
    if copy.resolve() not in keep:
        try:
            copy.unlink(missing_ok=True)
            os.link(path, copy)
        except OSError:                       # no hard links here: write it out
            write_atomic(copy, path.read_bytes(), "checkpoint")
    mine = [p for n, p in copies(path).items() if n <= step and p.resolve() not in keep]
    for old in mine[:-k]:
        old.unlink(missing_ok=True)


def _rows_after(metrics: Path, step: int) -> int:
    n = 0
    for line in (metrics.read_text(errors="replace").splitlines() if metrics.exists() else ()):
        try:
            n += json.loads(line).get("step", 0) > step
        except (json.JSONDecodeError, AttributeError, TypeError):
            continue
    return n


def claim_for_resume(resume, state: dict, out, force: bool) -> str | None:
    """Before resuming checkpoint `resume` (`state`, its loaded dict) into folder `out`. In the
    checkpoint's own folder, when that run went on past `step` (its checkpoint.pt or a kept
    copy is of a later step): a SonataError saying what would be lost, pointing at --out (a
    new folder branches from `resume`, the old run stays whole) and --force (which discards
    it: the later copies are removed and checkpoint.pt becomes `resume`, so the folder holds
    one timeline; returns the line saying so). Otherwise nothing happens (None)."""
    resume, out, step = Path(resume), Path(out), state.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise CheckpointError(f"checkpoint {resume} does not fit this version of sonata (its step is "
                              f"{step!r}, not a number of steps)")
    if resume.resolve().parent != out.resolve():
        return None
    main = out / "checkpoint.pt"
    later = [p for n, p in copies(main).items() if n > step]
    what = [p.name for p in later]
    if main.exists() and main.resolve() != resume.resolve():
        try:
            main_step = int(load(main)["step"])
        except (CheckpointError, KeyError, TypeError, ValueError):
            main_step = -1                 # unreadable: nothing of value is lost with it
        if main_step > step:
            what.insert(0, f"{main.name} (step {main_step})")
    if not what:
        return None
    rows = _rows_after(out / "metrics.jsonl", step)
    lost = ", ".join(what) + (f" and {rows} metrics rows" if rows else "")
    if not force:
        raise SonataError(f"resuming {resume} (step {step}) in {out} would discard that run's later "
                          f"state: {lost}; give --out NEW_DIR to continue from step {step} in a new "
                          f"folder (this one stays whole), or --force to discard it")
    for p in later:
        p.unlink(missing_ok=True)
    write_atomic(main, resume.read_bytes(), "checkpoint")
    return f"resuming from step {step} of {out}: discarded {lost}"
