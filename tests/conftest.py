"""Shared fixtures. Tests run offline; real TinyStories data is used when
$SONATA_TINYSTORIES points at a file (CI sets it from ../shared/data)."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("SONATA_PROGRESS", "lines")
# Token caches (sonata.data.token_cache.prepare) of this test session go to a fresh folder, never
# the user's ~/.cache/sonata; subprocesses (CLI, notebooks) inherit it.
_CACHE = tempfile.mkdtemp(prefix="sonata-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# Without a GPU, Triton kernels are tested in its CPU interpreter, which must be
# chosen before anything imports triton.
from sonata.kernels import use_triton_interpreter_without_gpu  # noqa: E402

use_triton_interpreter_without_gpu()

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tinystories_path():
    p = os.environ.get("SONATA_TINYSTORIES")
    if not p or not Path(p).exists():
        pytest.skip("real TinyStories sample not available: set SONATA_TINYSTORIES=/path/to/"
                    "tinystories_train_sample.txt (CI does this from ../shared/data)")
    return Path(p)


@pytest.fixture(scope="module")
def embedded():
    """The embedded corpus's stories (tests/data)."""
    from sonata.data.sources import load_stories
    return load_stories("embedded")


@pytest.fixture(scope="module")
def vocab(embedded):
    """The compact 512-token vocabulary of the embedded corpus's training split."""
    from sonata.data.sources import split_train_val
    from sonata.data.vocab import Vocab
    train, _ = split_train_val(embedded, 0.1)
    return Vocab.build(train, 512)


@pytest.fixture(scope="session")
def tokenizer():
    from sonata.data.vocab import get_tokenizer
    return get_tokenizer()


def tiny_overrides(out=None, **extra):
    """Overrides for a model that trains in seconds on the embedded corpus."""
    o = {"model.d_model": "32", "model.n_layers": "1", "model.d_state": "4",
         "data.seq_len": "32", "data.vocab_size": "300", "data.max_stories": "60",
         "train.max_steps": "6", "train.micro_batch": "4", "train.effective_batch": "4",
         "train.warmup_steps": "2", "train.eval_every": "0", "train.eval_tokens": "512",
         "train.lr": "3e-3"}
    o.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in o.items()]


def run_cli(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "sonata", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout)


def snapshot(folder):
    """Every file's bytes (and every folder) under `folder`, by relative path; None when it does
    not exist: what "a refused command leaves the folder byte-identical" compares."""
    folder = Path(folder)
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def train_in_process(out, **extra):
    """A tiny run into `out` through the command line's own entry point, in this process."""
    from sonata.__main__ import main
    assert main(["train", "--out", str(out), "--progress", "none", *tiny_overrides(**extra)]) == 0
    return out


def wait_for(path, proc, timeout=120):
    """Wait until `path` exists while subprocess `proc` runs; it must still be running then."""
    import time
    deadline = time.monotonic() + timeout
    while not Path(path).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]


def _assert_one_error_line(r, fragment):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:") and fragment in lines[0], lines[0]
    assert "Traceback" not in r.stderr
