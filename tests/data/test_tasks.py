"""The synthetic tasks (sonata.data.tasks): each generator puts the answer where its docstring says,
deterministically per seed; training on a task through the trainer, for every architecture,
resumes exactly; chunked evaluation gives the one-pass figures; the command line's task
evaluation. Then the Mamba-2 and Mamba-3 papers' tasks: multi-query associative recall and state
tracking (parity, a modular sum): formats, scoring, training and the command line."""
from __future__ import annotations

import json
import os

import pytest
import torch

from sonata.core import checkpoint as ckpt
from sonata.core.errors import CheckpointError
from sonata.core.config import ModelConfig, make_config
from sonata.model.lm import MambaLM
from sonata.data.tasks import (EVAL_BLOCK, IGNORE, MQAR, MQAR_GRIDS, STATE_TRACKING, InductionHeads,
                               ModularArithmeticBrackets, ModularSum, Parity, SelectiveCopying, TaskSampler,
                               accuracy_by_length, evaluate_task, make_task)
from sonata.train.trainer import Trainer
from conftest import _assert_one_error_line, run_cli


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("length", [4, 5, 17, 64, 300])
def test_induction_format(length):
    task = InductionHeads()
    x, ans = task.draw(500, length, gen(3))
    assert x.shape == (500, length) and x.dtype == torch.long
    assert ans.pos.tolist() == [length - 1]
    assert (x[:, -1] == task.S).all()                              # the query
    body = x[:, :-1]
    assert ((body == task.S).sum(1) == 1).all()                     # S once before the query
    s = (body == task.S).int().argmax(1)
    assert int(s.max()) < min(16, length - 2)                      # near the start
    assert torch.equal(x[torch.arange(500), s + 1], ans.target[:, 0])   # the answer follows it
    assert int(ans.target.min()) >= 0 and int(ans.target.max()) <= 14
    if length >= 64:
        assert len(set(s.tolist())) == 16 and len(set(ans.target[:, 0].tolist())) == 15
    x2, ans2 = task.draw(500, length, gen(3))
    assert torch.equal(x, x2) and torch.equal(ans.target, ans2.target)
    x3, _ = task.draw(500, length, gen(4))
    assert not torch.equal(x, x3)


@pytest.mark.parametrize("n_data,length", [(16, 32), (16, 272), (4, 9)])
def test_copying_format(n_data, length):
    task = SelectiveCopying(n_data)
    x, ans = task.draw(200, length, gen(5))
    region = length - n_data
    assert ans.pos.tolist() == list(range(region, length))
    assert (x[:, region:] == task.MARKER).all()
    head = x[:, :region]
    data_mask = head >= task.first_data
    assert (data_mask.sum(1) == n_data).all()
    assert ((head == task.NOISE) | data_mask).all()
    for row, tgt in zip(head, ans.target):                          # the data tokens, in order
        assert row[row >= task.first_data].tolist() == tgt.tolist()
    x2, _ = task.draw(200, length, gen(5))
    assert torch.equal(x, x2)
    y = task.targets(x, ans)
    assert (y[:, :region] == IGNORE).all() and torch.equal(y[:, region:], ans.target)


def test_too_short_sequences_are_refused():
    with pytest.raises(ValueError, match="at least 4"):
        InductionHeads().draw(1, 3, gen(0))
    with pytest.raises(ValueError, match="at least 32"):
        SelectiveCopying(16).draw(1, 31, gen(0))


@pytest.mark.parametrize("length", [64, EVAL_BLOCK + 37, 3 * EVAL_BLOCK])
def test_evaluation_sets_are_fixed_by_seed_and_length(length):
    """Sequence r of a set is the same whichever rows are asked for with it; blocks of at most
    EVAL_BLOCK positions; the format of the task; another seed, other sequences."""
    task = InductionHeads()
    blocks, ans = task.eval_blocks(range(6), length, seed=9)
    blocks = list(blocks)
    x = torch.cat(blocks, 1)
    assert all(b.shape[1] <= EVAL_BLOCK for b in blocks)
    assert x.shape == (6, length) and (x[:, -1] == task.S).all()
    s = (x[:, :-1] == task.S).int().argmax(1)
    assert ((x[:, :-1] == task.S).sum(1) == 1).all()
    assert torch.equal(x[torch.arange(6), s + 1], ans.target[:, 0])
    blocks, part = task.eval_blocks(range(2, 4), length, 9)
    assert torch.equal(torch.cat(list(blocks), 1), x[2:4]) and torch.equal(part.target, ans.target[2:4])
    other = torch.cat(list(task.eval_blocks(range(6), length, 10)[0]), 1)
    assert not torch.equal(x, other)
    c = SelectiveCopying(16)
    blocks, cans = c.eval_blocks(range(3), 48, 9)
    y, cpart = c.eval_blocks(range(1, 2), 48, 9)
    assert torch.equal(torch.cat(list(blocks), 1)[1:2], next(y)) and torch.equal(cans.target[1:2], cpart.target)


def test_sampler_state_resumes_the_same_sequences_and_shards():
    task = InductionHeads()
    a = TaskSampler(task, 40, seed=1)
    a.draw(8)
    state = a.state_dict()
    want = a.draw(8)
    b = TaskSampler(task, 40, seed=99)
    b.load_state_dict(state)
    got = b.draw(8)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    c = TaskSampler(task, 40, seed=99)
    c.load_state_dict(state)
    half = c.draw(8, shard=(1, 2))
    assert torch.equal(half[0], want[0][4:])


@pytest.mark.parametrize("arch", ["mamba", "lti"])
def test_chunked_task_evaluation_equals_one_pass(arch):
    """A 2 x EVAL_BLOCK + 5 sequence scored in blocks with the carried state gives the loss of
    one pass over it."""
    torch.manual_seed(0)
    m = MambaLM(ModelConfig(arch=arch, vocab_size=16, d_model=16, n_layers=2, d_state=4, backend="cpu"))
    L = 2 * EVAL_BLOCK + 5
    a = evaluate_task(m, InductionHeads(), L, 3, seed=2, chunked=True)
    b = evaluate_task(m, InductionHeads(), L, 3, seed=2, chunked=False)
    assert a.loss == pytest.approx(b.loss, abs=1e-5) and a.accuracy == b.accuracy


def task_overrides(arch, **extra):
    o = {"task.name": "induction", "model.arch": arch, "model.d_model": 16, "model.n_layers": 2,
         "model.d_state": 4, "data.seq_len": 24, "train.micro_batch": 4, "train.effective_batch": 8,
         "train.warmup_steps": 2, "train.eval_every": 3, "task.eval_seqs": 16, "train.lr": 3e-3,
         "train.decay_steps": 10, "train.weight_decay": 0.0}
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


@pytest.mark.parametrize("arch", ["mamba", "lti", "mamba2", "attention"])
def test_every_architecture_trains_a_task_and_resumes_exactly(tmp_path, arch):
    """Ten steps in one run equal five, a checkpoint, and five more: every loss and weight."""
    whole = Trainer(make_config(task_overrides(arch, **{"train.max_steps": 10})), tmp_path / "a",
                    progress="none")
    s = whole.run()
    assert s["steps"] == 10 and 0 <= s["val_acc"] <= 1 and "val_bpb" not in s
    assert s["data"]["task"] == "induction" and s["val_sequences"] == 16
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert "val_acc" in rows[2] and rows[-1]["tokens"] == 10 * 8 * 24
    first = Trainer(make_config(task_overrides(arch, **{"train.max_steps": 5})), tmp_path / "b",
                    progress="none")
    first.run()
    state = ckpt.load(tmp_path / "b" / "checkpoint.pt")
    assert state["vocab"] is None and state["config"]["task"]["name"] == "induction"
    cfg = make_config(task_overrides(arch, **{"train.max_steps": 10}))
    second = Trainer(cfg, tmp_path / "b", state=state, progress="none")
    second.run()
    assert [r["loss"] for r in whole.history[5:]] == [r["loss"] for r in second.history]
    for (k, v), w in zip(whole.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(v, w), k


def test_the_training_loss_is_the_answers_only():
    """The first step's loss is the cross-entropy at the last position alone of the batch the
    sampler draws (the same seed), computed here from a copy of the initial weights."""
    tr = Trainer(make_config(task_overrides("mamba", **{"train.max_steps": 1, "train.eval_every": 0})),
                 None, progress="none")
    model = MambaLM(tr.cfg.model)
    model.load_state_dict(tr.model.state_dict())
    x, y = TaskSampler(tr.task, 24, seed=tr.cfg.train.seed).draw(8)
    assert ((y != IGNORE).sum(1) == 1).all() and (y[:, -1] != IGNORE).all()
    want = torch.nn.functional.cross_entropy(model(x)[:, -1], y[:, -1]).item()
    tr.run()
    assert tr.history[0]["loss"] == pytest.approx(want, abs=1e-6)


def test_accuracy_by_length_rows_and_budget():
    torch.manual_seed(0)
    m = MambaLM(ModelConfig(arch="attention", vocab_size=16, d_model=16, n_layers=1))
    rows = accuracy_by_length(m, InductionHeads(), [16, 32, 4096], n=4, budget_s=1.0)
    assert [r["length"] for r in rows] == [16, 32, 4096]
    assert rows[0]["sequences"] == 4 and 0 <= rows[0]["accuracy"] <= 1 and rows[0]["note"] == "whole sequences"
    assert rows[2]["accuracy"] is None and "square of the length" in rows[2]["note"]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="the peak is reset through Linux's /proc")
def test_the_peak_resident_set_is_each_lengths_own():
    """A model trained in the same process (a notebook) once showed its training's peak
    (5,319 MiB) on every length: the peak is reset before each length now. Here 600 MiB
    touched and freed before the evaluation do not appear in its row."""
    import numpy as np
    big = np.ones(600 * 2**20, dtype=np.uint8)
    del big
    torch.manual_seed(0)
    m = MambaLM(ModelConfig(vocab_size=16, d_model=16, n_layers=1))
    from sonata.data.tasks import peak_rss_bytes
    process_peak = max(peak_rss_bytes(), 600 * 2**20)
    row = accuracy_by_length(m, InductionHeads(), [64], n=4)[0]
    assert row["peak_rss_mib"] * 2**20 < process_peak - 400 * 2**20, (row, process_peak / 2**20)
    assert 0 <= row["eval_mib"] <= row["peak_rss_mib"]


def test_cli_task_train_and_eval(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", "--out", str(out), "--progress", "none",
                *task_overrides("mamba", **{"train.max_steps": 4}))
    assert r.returncode == 0, r.stderr
    assert "val_acc" in json.loads(r.stdout.splitlines()[0])
    r = run_cli("eval", str(out / "checkpoint.pt"), "--lengths", "24,100", "--n", "8", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert [row["length"] for row in res["rows"]] == [24, 100]
    assert all(row["sequences"] == 8 and 0 <= row["accuracy"] <= 1 for row in res["rows"])
    r = run_cli("eval", str(out / "checkpoint.pt"), "--lengths", "24")
    assert r.returncode == 0 and "length        24: accuracy" in r.stdout, r.stdout + r.stderr
    for args, words in ((["--lengths", "3"], "at least 4"), (["--lengths", "x"], "comma-separated"),
                        (["--text", "f.txt"], "--lengths, not --text")):
        r = run_cli("eval", str(out / "checkpoint.pt"), *args)
        _assert_one_error_line(r, words)
    r = run_cli("generate", str(out / "checkpoint.pt"))
    _assert_one_error_line(r, "no text vocabulary")
    for bad, words in (("task.name=dyck", "task.name"), ("model.arch=rnn", "model.arch"),
                       ("data.seq_len=3", "at least 4")):
        r = run_cli("train", "--out", str(tmp_path / "bad"), "task.name=induction", bad)
        _assert_one_error_line(r, words)


def test_curriculum_lengths_follow_the_schedule_and_resume():
    s = TaskSampler(InductionHeads(), 64, seed=0, curriculum="8:2,16:3,32")
    lengths = [s.draw(2)[0].shape[1] for _ in range(7)]
    assert lengths == [8, 8, 16, 16, 16, 32, 32]
    state = s.state_dict()
    r = TaskSampler(InductionHeads(), 64, seed=5, curriculum="8:2,16:3,32")
    r.load_state_dict(state)
    assert torch.equal(r.draw(2)[0], s.draw(2)[0]) and r.seq_len == 32
    tr = Trainer(make_config(task_overrides("mamba", **{"train.max_steps": 4, "train.eval_every": 0,
                                                         "task.curriculum": "8:2,16"})), None, progress="none")
    tr.run()
    assert [r["step_tokens"] for r in tr.history] == [64, 64, 128, 128]
    assert tr.history[-1]["tokens"] == 384


@pytest.mark.parametrize("text,words", [("64:10,x", "length:steps"), ("64,128", "length:steps"),
                                        ("64:10,128:5", "length:steps"), ("2:5,64", "under 4")])
def test_bad_curriculum_is_a_config_error(text, words):
    from sonata.core.errors import ConfigError
    with pytest.raises(ConfigError, match=words):
        make_config(["task.name=induction", f"task.curriculum={text}"])


def test_a_curriculum_stage_restarts_the_leak_detector_and_a_constant_rate_cap_does_not_warn():
    """The memory a longer stage needs is the workload's: the detector follows each stage on its
    own (its samples are the last stage's steps). A budgeted run capped by steps at a constant
    learning rate (min_lr_ratio 1: always at its floor) has nothing to warn about."""
    import warnings

    from sonata.train.leak import STAGE_SETTLE_STEPS, leak_threshold
    cfg = make_config(task_overrides("mamba", **{"train.max_steps": 9, "train.eval_every": 0,
                                                  "task.curriculum": "8:4,64", "train.max_seconds": 600,
                                                  "train.decay_steps": 0, "train.min_lr_ratio": 1.0}))
    tr = Trainer(cfg, None, progress="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr.run()
    assert len(tr.leak.samples) == 5 and tr.ended_by == "steps"
    assert tr.leak.skip == STAGE_SETTLE_STEPS         # the longer stage's heap settles first
    assert tr.leak.threshold == leak_threshold(tr.history[-1]["step_tokens"])


def test_cli_init_starts_a_new_run_from_weights(tmp_path):
    """--init takes the weights only: the new run's first loss is the old model's (not the fresh
    init's), its steps start at 1; another architecture's weights, or --init with --resume, are
    one error line."""
    a = tmp_path / "a"
    r = run_cli("train", "--out", str(a), "--progress", "none", *task_overrides("mamba", **{"train.max_steps": 30}))
    assert r.returncode == 0, r.stderr
    b = tmp_path / "b"
    r = run_cli("train", "--out", str(b), "--init", str(a / "checkpoint.pt"), "--progress", "none",
                *task_overrides("mamba", **{"train.max_steps": 2, "train.seed": 1}))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    sa, sb = ckpt.load(a / "checkpoint.pt"), ckpt.load(b / "checkpoint.pt")
    assert sb["step"] == 2 and sb["optimizer"]["state"][0]["step"] == 2     # a fresh optimizer
    w = "layers.0.mixer.in_proj.weight"
    assert (sb["model"][w] - sa["model"][w]).abs().max() < 0.05           # two steps from a's weights
    r = run_cli("train", "--out", str(tmp_path / "c"), "--init", str(a / "checkpoint.pt"),
                *task_overrides("attention", **{"train.max_steps": 1}))
    _assert_one_error_line(r, "do not fit this model")
    r = run_cli("train", "--out", str(tmp_path / "d"), "--init", str(a / "checkpoint.pt"),
                "--resume", str(a / "checkpoint.pt"))
    _assert_one_error_line(r, "use one")


def test_init_from_an_untied_head_needs_an_untied_model():
    """An untied head loaded into a tied model would overwrite the embedding it shares: refused,
    naming the setting; the untied model takes the weights, head and embedding each their own."""
    src = Trainer(make_config(task_overrides("mamba", **{"model.tie_embeddings": False})), None, progress="none")
    with torch.no_grad():
        src.model.lm_head.weight.add_(1.0)
    state = src.model.state_dict()
    tied = Trainer(make_config(task_overrides("mamba")), None, progress="none")
    emb = tied.model.embedding.weight.detach().clone()
    with pytest.raises(CheckpointError, match="train with model.tie_embeddings=false"):
        tied.start_from(state)
    assert torch.equal(tied.model.embedding.weight, emb)                    # nothing loaded
    untied = Trainer(make_config(task_overrides("mamba", **{"model.tie_embeddings": False})), None, progress="none")
    untied.start_from(state)
    assert torch.equal(untied.model.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(untied.model.embedding.weight, state["embedding.weight"])
    tied.start_from(tied.model.state_dict())                                 # a tied state loads as before


# ---- multi-query associative recall (MQAR) ----------------------------------------------------

@pytest.mark.parametrize("vocab,n_pairs,length", [(16, 0, 16), (16, 0, 19), (8192, 0, 256), (64, 3, 20),
                                                  (64, 0, 4), (1024, 0, 1024), (32, 5, 57)])
def test_mqar_format(vocab, n_pairs, length):
    """Keys and values from disjoint ranges, distinct within a row; every query a key of the
    first part, each queried once; the answer the value that followed it; filler elsewhere;
    answers at the query positions only; the same sequences from the same seed."""
    task = MQAR(vocab, n_pairs)
    n = 64
    x, ans = task.draw(n, length, gen(7))
    d = n_pairs or length // 4
    half = vocab // 2
    assert x.shape == (n, length) and x.dtype == torch.long and task.vocab_size == vocab
    keys, values = x[:, 0:2 * d:2], x[:, 1:2 * d:2]
    assert int(keys.min()) >= 1 and int(keys.max()) < half                  # keys 1..V/2-1
    assert int(values.min()) >= half and int(values.max()) < vocab          # values V/2..V-1
    pos = ans.pos.tolist()
    assert len(pos) == d == ans.target.shape[1] and pos == sorted(set(pos)) and pos[0] == 2 * d
    assert pos == [2 * d + j * (length - 2 * d) // d for j in range(d)]
    assert all(b - a >= 2 for a, b in zip(pos, pos[1:])) and pos[-1] < length
    if length == 4 * d:
        assert pos == list(range(2 * d, length, 2))                         # the paper's T/4: packed
    rest = torch.ones(length, dtype=torch.bool)
    rest[:2 * d] = False
    rest[ans.pos] = False
    assert (x[:, rest] == task.FILLER).all()
    for row in range(n):
        k, v, q = keys[row].tolist(), values[row].tolist(), x[row, ans.pos].tolist()
        assert len(set(k)) == d and len(set(v)) == d
        assert sorted(q) == sorted(k)                                       # every key queried once
        table = dict(zip(k, v))
        assert ans.target[row].tolist() == [table[key] for key in q]        # the value paired with it
    y = task.targets(x, ans)
    keep = y != IGNORE
    assert keep.sum(1).tolist() == [d] * n and keep[:, ans.pos].all()
    assert torch.equal(y[:, ans.pos], ans.target)
    x2, ans2 = task.draw(n, length, gen(7))
    assert torch.equal(x, x2) and torch.equal(ans.target, ans2.target)
    if d > 1:
        assert not torch.equal(x, task.draw(n, length, gen(8))[0])


def test_mqar_draws_uniformly():
    """Over many rows every key and every value appears, and the query order is not the pairs'."""
    task = MQAR(32, 0)
    x, ans = task.draw(2000, 32, gen(1))
    assert set(x[:, 0:16:2].flatten().tolist()) == set(range(1, 16))
    assert set(x[:, 1:16:2].flatten().tolist()) == set(range(16, 32))
    first_query_is_first_key = (x[:, 16] == x[:, 0]).float().mean()
    assert 0.05 < float(first_query_is_first_key) < 0.2                     # 1/8 by chance


def test_mqar_longer_lengths_and_too_few_keys():
    task = MQAR(64, 0)                                 # 31 keys: at most 31 pairs, so length <= 127
    assert task.pairs(64) == 16 and task.pairs(127) == 31
    task.check_length(127)
    with pytest.raises(ValueError, match="32 key-value pairs, more than the 31 keys"):
        task.draw(1, 128, gen(0))
    with pytest.raises(ValueError, match="at least 12"):
        MQAR(64, 3).draw(1, 11, gen(0))
    fixed = MQAR(64, 4)                                # fixed pairs: a longer sequence spreads the queries
    _, ans = fixed.draw(2, 1000, gen(0))
    assert ans.pos.tolist() == [8, 256, 504, 752]


def test_mqar_evaluation_sets_are_fixed_by_seed_and_length():
    task = MQAR(128, 0)
    blocks, ans = task.eval_blocks(range(5), 200, seed=3)
    x = torch.cat(list(blocks), 1)
    assert x.shape == (5, 200) and torch.equal(ans.pos, task.query_positions(200))
    for row in range(5):
        table = dict(zip(x[row, 0:100:2].tolist(), x[row, 1:100:2].tolist()))
        assert ans.target[row].tolist() == [table[k] for k in x[row, ans.pos].tolist()]
    blocks, part = task.eval_blocks(range(2, 4), 200, 3)
    assert torch.equal(torch.cat(list(blocks), 1), x[2:4]) and torch.equal(part.target, ans.target[2:4])
    assert not torch.equal(torch.cat(list(task.eval_blocks(range(5), 200, 4)[0]), 1), x)


def test_mqar_mixed_training_batches_draw_the_pair_ladder_and_validation_stays_at_d():
    """task.mix_pairs: each training batch holds D, D/2, D/4 or D/8 pairs (every batch a valid
    MQAR batch at its count, every count drawn), the same batches again from the same seed, and
    the evaluation sets unchanged (D pairs); without the switch every batch has D."""
    mixed, plain = MQAR(256, 0, mix_pairs=True), MQAR(256, 0)
    assert mixed.pair_ladder(64) == [2, 4, 8, 16] and mixed.pair_ladder(8) == [1, 2] and MQAR(64, 3).pair_ladder(40) == [1, 3]
    sampler = TaskSampler(mixed, 64, seed=5)
    counts = []
    for _ in range(40):
        x, y = sampler.draw(8)
        keep = y != IGNORE
        d = int(keep[0].sum())
        assert keep.sum(1).tolist() == [d] * 8                              # one count per batch
        assert (x[:, 2 * d:][~keep[:, 2 * d:]] == MQAR.FILLER).all()
        for row in range(8):
            table = dict(zip(x[row, 0:2 * d:2].tolist(), x[row, 1:2 * d:2].tolist()))
            assert len(table) == d and y[row, keep[row]].tolist() == [table[k] for k in x[row, keep[row]].tolist()]
        assert keep[0].nonzero().flatten().tolist() == mixed.query_positions(64, d).tolist()
        counts.append(d)
    assert set(counts) == {2, 4, 8, 16}
    again = TaskSampler(MQAR(256, 0, mix_pairs=True), 64, seed=5)
    assert [int((again.draw(8)[1][0] != IGNORE).sum()) for _ in range(40)] == counts
    resumed = TaskSampler(MQAR(256, 0, mix_pairs=True), 64, seed=77)          # from a checkpoint's state
    resumed.load_state_dict(sampler.state_dict())
    want, got = sampler.draw(8), resumed.draw(8)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    plain_sampler = TaskSampler(plain, 64, seed=5)
    assert all(int((plain_sampler.draw(8)[1] != IGNORE).sum(1).max()) == 16 for _ in range(5))
    a, ans_a = mixed.eval_blocks(range(3), 64, seed=2)
    b, ans_b = plain.eval_blocks(range(3), 64, seed=2)
    assert torch.equal(torch.cat(list(a), 1), torch.cat(list(b), 1)) and torch.equal(ans_a.target, ans_b.target)
    assert make_task(make_config({"task.name": "mqar", "task.mix_pairs": True}).task).mix_pairs


# ---- state tracking: parity and a modular sum -------------------------------------------------

@pytest.mark.parametrize("task", [Parity(), Parity(running=True), ModularSum(5), ModularSum(7, running=True)],
                         ids=["parity", "parity-running", "modsum5", "modsum7-running"])
@pytest.mark.parametrize("length", [1, 2, 17, 300])
def test_state_tracking_format(task, length):
    """Tokens uniform in 0..m-1; the answer the sum mod m of the whole sequence at the last
    position, or of each prefix at every position (running); the same from the same seed."""
    m = task.modulus
    x, ans = task.draw(400, length, gen(11))
    assert x.shape == (400, length) and int(x.min()) >= 0 and int(x.max()) < m and task.vocab_size == m
    if length >= 17:
        assert set(x.flatten().tolist()) == set(range(m))
    prefix = x.cumsum(1) % m
    if task.running:
        assert ans.pos.tolist() == list(range(length)) and torch.equal(ans.target, prefix)
    else:
        assert ans.pos.tolist() == [length - 1] and torch.equal(ans.target[:, 0], prefix[:, -1])
        if m == 2 and length >= 17:
            assert 0.4 < float(ans.target.float().mean()) < 0.6                 # odd and even alike
    y = task.targets(x, ans)
    assert ((y != IGNORE).sum(1) == (length if task.running else 1)).all() and (y[:, -1] == prefix[:, -1]).all()
    x2, ans2 = task.draw(400, length, gen(11))
    assert torch.equal(x, x2) and torch.equal(ans.target, ans2.target)
    assert task.chance() == 1 / m


@pytest.mark.parametrize("task", [Parity(), ModularSum(5, running=True)], ids=["parity", "modsum-running"])
def test_state_tracking_evaluation_sets_span_blocks(task):
    """A test sequence of 2 x EVAL_BLOCK + 3 comes in blocks; its one answer (running or not: the
    score is the last position's) is the sum mod m of all of them; rows fixed by (seed, length)."""
    L = 2 * EVAL_BLOCK + 3
    blocks, ans = task.eval_blocks(range(3), L, seed=5)
    blocks = list(blocks)
    assert [b.shape[1] for b in blocks] == [EVAL_BLOCK, EVAL_BLOCK, 3]
    x = torch.cat(blocks, 1)
    assert ans.pos.tolist() == [L - 1] and torch.equal(ans.target[:, 0], x.sum(1) % task.modulus)
    blocks, part = task.eval_blocks(range(1, 2), L, 5)
    assert torch.equal(torch.cat(list(blocks), 1), x[1:2]) and torch.equal(part.target, ans.target[1:2])


# ---- scoring ----------------------------------------------------------------------------------

class _Oracle(torch.nn.Module):
    """Logits from the rule itself: `fn(x, state) -> (answer ids (n, L), state)` as one-hot logits.
    A parameter so that evaluate_task finds a device."""

    def __init__(self, fn, vocab):
        super().__init__()
        self.fn, self.vocab, self.p = fn, vocab, torch.nn.Parameter(torch.zeros(()))

    def forward(self, x, state=None, return_state=False):
        ids, state = self.fn(x, state)
        logits = 30.0 * torch.nn.functional.one_hot(ids, self.vocab).float()
        return (logits, state) if return_state else logits


def _running_sum(m, skip_last=False):
    def fn(x, state):
        s0 = torch.zeros(x.shape[0], dtype=torch.long) if state is None else state
        cs = (s0[:, None] + x.cumsum(1)) % m
        out = cs.clone()
        if skip_last:                                   # wrong exactly where the last token counts
            out[:, 1:] = cs[:, :-1]
        return out, cs[:, -1]
    return fn


def _recall(x, state):
    """At each position, the value that followed the same key earlier (the filler if none)."""
    out = torch.zeros_like(x)
    for r, row in enumerate(x.tolist()):
        seen = {}
        for t, tok in enumerate(row):
            out[r, t] = seen.get(tok, 0)
            if t + 1 < len(row) and row[t + 1] and tok not in seen:
                seen[tok] = row[t + 1]
    return out, None


def test_scoring_reads_the_answer_positions():
    """The rule itself scores 1 (loss near 0), carried across blocks for the running sum; a
    model wrong only where the last token matters scores about chance; MQAR's recall, 1."""
    L = 2 * EVAL_BLOCK + 5
    for task in (Parity(), ModularSum(5)):
        ev = evaluate_task(_Oracle(_running_sum(task.modulus), task.modulus), task, L, 4, seed=1)
        assert ev.accuracy == 1.0 and ev.loss < 1e-6
        ev = evaluate_task(_Oracle(_running_sum(task.modulus, skip_last=True), task.modulus), task, 64, 400, seed=1)
        assert abs(ev.accuracy - task.chance()) < 0.1
    task = MQAR(64, 0)
    ev = evaluate_task(_Oracle(_recall, 64), task, 96, 8, seed=2, chunked=False)
    assert ev.accuracy == 1.0 and ev.loss < 1e-6
    rows = accuracy_by_length(_Oracle(_recall, 64), task, [48, 96], n=4)
    assert [r["accuracy"] for r in rows] == [1.0, 1.0]


# ---- the trainer and the command line ---------------------------------------------------------

NEW_TASKS = {"mqar": {"task.name": "mqar", "task.vocab_size": 64, "data.seq_len": 32},
             "mqar-fixed": {"task.name": "mqar", "task.vocab_size": 32, "task.n_pairs": 4, "data.seq_len": 40},
             "parity": {"task.name": "parity", "data.seq_len": 16},
             "parity-running": {"task.name": "parity", "task.running": "true", "data.seq_len": 16},
             "modsum": {"task.name": "modsum", "task.modulus": 3, "data.seq_len": 16},
             "arith-running": {"task.name": "arith", "task.running": "true", "data.seq_len": 15},
             "arith_brackets": {"task.name": "arith_brackets", "data.seq_len": 24}}


@pytest.mark.parametrize("name", list(NEW_TASKS))
def test_new_tasks_train_through_the_trainer_with_the_loss_on_the_answers(name):
    """A few steps of each task; the first step's loss is the cross-entropy at the answer
    positions alone of the sampler's batch (from a copy of the initial weights)."""
    cfg = make_config(task_overrides("mamba", **{"train.max_steps": 3, **NEW_TASKS[name]}))
    tr = Trainer(cfg, None, progress="none")
    task = make_task(cfg.task)
    assert tr.task.vocab_size == task.vocab_size == tr.cfg.model.vocab_size
    model = MambaLM(tr.cfg.model)
    model.load_state_dict(tr.model.state_dict())
    x, y = TaskSampler(tr.task, cfg.data.seq_len, seed=cfg.train.seed).draw(8)
    keep = y != IGNORE
    want = torch.nn.functional.cross_entropy(model(x)[keep], y[keep]).item()
    s = tr.run()
    assert tr.history[0]["loss"] == pytest.approx(want, abs=1e-5)
    assert s["steps"] == 3 and 0 <= s["val_acc"] <= 1 and s["data"]["task"] == cfg.task.name
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in tr.history)


def test_mqar_trains_for_mamba2_and_attention():
    for arch in ("mamba2", "attention"):
        s = Trainer(make_config(task_overrides(arch, **{"train.max_steps": 2, **NEW_TASKS["mqar"]})), None,
                    progress="none").run()
        assert s["steps"] == 2 and 0 <= s["val_acc"] <= 1


@pytest.mark.parametrize("name,lengths", [("mqar", "32,64,124"), ("parity-running", "16,64,20000")])
def test_cli_trains_and_scores_the_new_tasks(tmp_path, name, lengths):
    """`train task.name=...` then `eval CKPT --lengths` at the trained and longer lengths; a
    length the task cannot hold is one error line."""
    out = tmp_path / "run"
    r = run_cli("train", "--out", str(out), "--progress", "none",
                *task_overrides("mamba", **{"train.max_steps": 3, **NEW_TASKS[name]}))
    assert r.returncode == 0, r.stderr
    assert "val_acc" in json.loads(r.stdout.splitlines()[0])
    r = run_cli("eval", str(out / "checkpoint.pt"), "--lengths", lengths, "--n", "8", "--n-long", "2", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["task"] == NEW_TASKS[name]["task.name"]
    assert [row["length"] for row in res["rows"]] == [int(v) for v in lengths.split(",")]
    assert all(0 <= row["accuracy"] <= 1 for row in res["rows"])
    if name == "mqar":                   # 64 / 2 - 1 = 31 keys: 124 positions hold 31 pairs, 128 hold 32
        r = run_cli("eval", str(out / "checkpoint.pt"), "--lengths", "124")
        assert r.returncode == 0 and "length       124: accuracy" in r.stdout, r.stdout + r.stderr
        r = run_cli("eval", str(out / "checkpoint.pt"), "--lengths", "32,128")
        _assert_one_error_line(r, "32 key-value pairs, more than the 31 keys")


@pytest.mark.parametrize("overrides,words", [
    ({"task.name": "mqar", "task.vocab_size": 2}, "task.vocab_size must be in 4..65536"),
    ({"task.name": "mqar", "task.n_pairs": -1}, "task.n_pairs must be >= 0"),
    ({"task.name": "mqar", "task.vocab_size": 16, "data.seq_len": 64}, "16 key-value pairs but task.vocab_size=16 has only 7 keys"),
    ({"task.name": "mqar", "task.vocab_size": 64, "task.curriculum": "32:5,256"}, "at length 256 has 64"),
    ({"task.name": "mqar", "task.n_pairs": 8, "data.seq_len": 31}, "at least 32"),
    ({"task.name": "modsum", "task.modulus": 1}, "task.modulus must be in 2..65536"),
    ({"task.name": "mqar", "task.running": "true"}, "task.running=true is for task.name=parity, modsum or arith"),
    ({"task.name": "arith_brackets", "task.running": "true"}, "not arith_brackets"),
    ({"task.name": "arith", "task.modulus": 1}, "task.modulus must be in 2..65536"),
    ({"task.name": "arith_brackets", "data.seq_len": 1}, "at least 2"),
    ({"task.name": "arith_brackets", "task.curriculum": "8:5,16385"}, "at most 16384 positions, not 16385"),
    ({"task.name": "parity", "task.running": "maybe"}, "task.running"),
])
def test_bad_task_settings_are_a_config_error(overrides, words):
    from sonata.core.errors import ConfigError
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        make_config({"data.seq_len": 64, **overrides})


def test_a_bad_task_setting_on_the_command_line_is_one_error_line(tmp_path):
    r = run_cli("train", "--out", str(tmp_path / "bad"), "task.name=mqar", "task.vocab_size=16", "data.seq_len=64")
    _assert_one_error_line(r, "has only 7 keys")


def test_the_grids_and_lengths_are_valid_runs():
    """Every point of both MQAR grids is a valid configuration (for each architecture of the
    comparison) whose test lengths the task can hold; the paper's grid is the paper's."""
    paper, cpu = MQAR_GRIDS["paper"], MQAR_GRIDS["cpu"]
    assert paper.vocab_size == 8192 and paper.lengths == (256, 512, 1024) and paper.n_layers == 2
    assert paper.d_models == (32, 64, 128, 256) and 16 in paper.d_states and 256 in paper.d_states
    assert max(cpu.lengths) < min(paper.lengths) * 2 and cpu.vocab_size < paper.vocab_size
    for grid in (paper, cpu):
        for length, d_model, d_state in grid.points():
            for arch in ("mamba", "mamba2", "attention"):
                cfg = make_config({**grid.overrides(length, d_model, d_state), "model.arch": arch})
                assert cfg.data.seq_len == length and cfg.model.d_state == d_state
            task = make_task(cfg.task)
            assert task.pairs(length) == length // 4
            for test_length in grid.test_lengths(length):
                task.check_length(test_length)
            assert max(grid.test_lengths(length)) > length
    train, tests = STATE_TRACKING["train_length"], STATE_TRACKING["test_lengths"]
    assert train in tests and 4 * train in tests and max(tests) > 4 * train
    for name in ("parity", "modsum"):
        make_config({"task.name": name, "data.seq_len": train})


@pytest.mark.parametrize("task", [MQAR(64, 0), ModularArithmeticBrackets(5)], ids=["mqar", "arith_brackets"])
def test_a_new_tasks_sampler_resumes_the_same_sequences(task):
    a = TaskSampler(task, 32, seed=1, curriculum="16:2,32")
    a.draw(4)
    state = a.state_dict()
    want = a.draw(4)
    b = TaskSampler(task, 32, seed=9, curriculum="16:2,32")
    b.load_state_dict(state)
    got = b.draw(4)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
