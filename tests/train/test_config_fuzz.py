"""Property: over the whole config schema, `train ... train.max_steps=1` either trains or ends with
exit status 2 and one `error:` line, and after every exit 2 the `--out` folder given (a fresh
one, or one holding a finished run replaced with --force) is byte-identical to before.

Hypothesis draws one to three overrides per example from every key of the six config sections:
values of the wrong type, empty strings, both ends of each range and just past them, float32's
overflow (1e39, 1e300), NaN and infinities, the sizes a typo makes (2^31, 10^30), every choice of
the string-valued keys, and unknown keys. The command runs in this process (`sonata.__main__.main`,
as `python -m sonata` does), on the embedded corpus with a tiny model.

`make test` runs FUZZ_EXAMPLES (default 30) examples from a fixed seed; `make fuzz` runs many more
(SONATA_FUZZ_EXAMPLES, default 400) from a fresh seed each time.
"""
from __future__ import annotations

import os
import shutil
import typing
from dataclasses import fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, snapshot, tiny_overrides, train_in_process
from sonata.__main__ import main
from sonata.core import config as C
from sonata.model import families

EXAMPLES = int(os.environ.get("SONATA_FUZZ_EXAMPLES", "30"))
FRESH_SEED = os.environ.get("SONATA_FUZZ_FRESH") == "1"      # make fuzz: a new draw each time

# The run's length is the property's own (one step); the rest of the schema is drawn.
FIXED = {"train.max_steps", "train.max_seconds", "train.decay_steps"}
CHOICES = {
    "model.arch": families.ARCHS + ("", "mamba4"),
    "model.layers": ("", "mamba2,attention", "mamba,mamba3", "attention", "mamba2,,mamba", "gdn", ","),
    "model.backend": ("auto", "reference", "cpu", "triton", "", "cuda"),
    "model.a_param": ("log", "direct", ""),
    "data.source": ("embedded", "", "/nonexistent/stories.txt"),
    "data.cache_dir": ("", "/proc/sonata-cache"),
    "train.precision": ("auto", "fast") + C.PRECISIONS + ("", "fp8"),
    "train.device": ("auto", "cpu", "cuda", "tpu"),
    "profile.name": ("auto", "", "gpu") + tuple(C.PRESETS),
    "profile.candidates": ("", "1,2,4", "0", "a,b", "3"),
    "profile.precision": ("",) + C.PRECISIONS + ("fp64",),
    "debug.leak": C.LEAKS + ("",),
    "task.name": C.TASKS + ("", "sorting"),
    "task.curriculum": ("", "16:2,32", "16:2", "x", "32:0,64"),
}
INTS = (-1, 0, 1, 2, 3, 4, 7, 16, 64, 300, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 10 ** 30)
FLOATS = ("-1", "0", "1e-45", "1e-4", "0.5", "1", "2", "1e4", "1e39", "1e300", "nan", "inf", "-inf")
JUNK = ("", "abc", "1.5", "true", " ")
# A batch of 2^16 sequences is a valid setting that trains its one step for half a minute:
# make fuzz draws it, make test's 30 examples leave it out
BATCH_KEYS = {"train.effective_batch", "profile.effective_batch"}


def _schema() -> dict[str, type]:
    out = {}
    for section in fields(C.Config):
        cls = section.type if isinstance(section.type, type) else getattr(C, section.type.split("[")[0], None)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            key = f"{section.name}.{f.name}"
            if key not in FIXED:
                out[key] = hints[f.name]
    return out


SCHEMA = _schema()


def _value(key: str):
    typ = SCHEMA.get(key, str)
    if key in CHOICES:
        return st.sampled_from(CHOICES[key] + JUNK[1:2])
    if typ is bool:
        return st.sampled_from(("true", "false", "1", "0", "yes", "maybe") + JUNK[:2])
    if typ is int:
        ints = INTS if FRESH_SEED or key not in BATCH_KEYS else tuple(v for v in INTS if v != 2 ** 16)
        return st.sampled_from(tuple(str(v) for v in ints) + JUNK)
    if typ is float:
        return st.sampled_from(FLOATS + JUNK[:2])
    return st.sampled_from(JUNK + ("x" * 300,))


KEYS = st.sampled_from(sorted(SCHEMA) + ["model.d_modle", "train.max_step", "nosection.key", "model", "a.b.c"])
OVERRIDES = st.lists(KEYS.flatmap(lambda k: _value(k).map(lambda v: f"{k}={v}")), min_size=1, max_size=3)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run folder holding a finished run (checkpoint, a kept copy, metrics, summary)."""
    return train_in_process(tmp_path_factory.mktemp("fuzz") / "finished",
                            **{"train.max_steps": 2, "train.checkpoint_every": 1, "train.keep_checkpoints": 1})


def _fuzz(finished_run, tmp_path_factory, overrides, replace, capsys):
    threads = torch.get_num_threads()
    base = tmp_path_factory.mktemp("fuzz-example")
    os.chdir(base)                 # a relative value (data.cache_dir=abc) lands in the example's folder
    out = base / "run"
    if replace:
        shutil.copytree(finished_run, out)
    before = snapshot(out)
    argv = ["train", "--out", str(out), "--progress", "none", *(["--force"] if replace else []),
            *tiny_overrides(**{"train.max_steps": 1, "train.eval_tokens": 256}), *overrides]
    capsys.readouterr()
    try:
        code = main(argv)
    finally:
        torch.set_num_threads(threads)
        os.chdir(REPO)
    got = capsys.readouterr()
    lines = [ln for ln in got.err.splitlines() if ln.strip()]
    assert code in (0, 2), (overrides, code, got.err[-2000:])
    assert "Traceback" not in got.err, (overrides, got.err[-2000:])
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("error:"), (overrides, got.err[-2000:])
        assert snapshot(out) == before, (overrides, lines[0])
    else:
        assert not any(ln.startswith("error:") for ln in lines), (overrides, got.err[-2000:])
        wrote = got.out.strip().splitlines()[-1]
        assert (out / "summary.json").exists() and (out / "metrics.jsonl").exists(), overrides
        assert (out / "checkpoint.pt").exists() or "no checkpoint of this run" in wrote, (overrides, wrote)
    shutil.rmtree(base, ignore_errors=True)
    return code


_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=not FRESH_SEED, database=None,
                     suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@_settings
@given(overrides=OVERRIDES, replace=st.booleans())
def test_every_train_override_runs_or_is_one_error_line_that_changes_nothing(
        finished_run, tmp_path_factory, overrides, replace, capsys):
    _fuzz(finished_run, tmp_path_factory, overrides, replace, capsys)


def test_the_fuzz_draws_from_every_key_of_the_schema():
    """The schema the property draws from is the config's: each section's every field but the
    run's length, which the property fixes at one step."""
    every = {f"{s.name}.{f.name}" for s in fields(C.Config) for f in fields(getattr(C.Config(), s.name))}
    assert set(SCHEMA) == every - FIXED
    assert {"model.embed_std", "model.layers", "task.curriculum", "profile.memory_budget_mb"} <= set(SCHEMA)
