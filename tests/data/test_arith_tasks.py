"""Modular arithmetic without and with brackets (sonata.data.tasks.ModularArithmetic,
ModularArithmeticBrackets): every answer checked against Python's own evaluation of the
sequence written out as text, the formats' invariants, and fixed evaluation sets."""
from __future__ import annotations

import pytest
import torch

from sonata.core.config import make_config
from sonata.data.tasks import ModularArithmetic, ModularArithmeticBrackets, make_task


def _text(task, row) -> str:
    """A sequence as the Python expression it spells (the '=' left out)."""
    m = task.modulus
    sym = {m: "+", m + 1: "-", m + 2: "*"} if isinstance(task, ModularArithmetic) else \
        {m: "+", m + 1: "-", m + 2: "(", m + 3: ")", m + 4: ""}
    return "".join(sym.get(int(t), str(int(t))) for t in row)


@pytest.mark.parametrize("modulus", [2, 5, 7])
@pytest.mark.parametrize("running", [False, True])
def test_arith_answers_are_pythons_value_of_the_expression(modulus, running):
    task = ModularArithmetic(modulus, running)
    gen = torch.Generator().manual_seed(modulus)
    for length in (1, 2, 3, 4, 9, 10, 41):
        x, ans = task.draw(16, length, gen)
        assert x.shape == (16, length) and int(x.max()) < task.vocab_size == modulus + 3
        pos = task.number_positions(length)
        assert int(pos[-1]) == length - 1 and bool((x[:, pos] < modulus).all())
        assert bool((x[:, [t for t in range(length) if t not in pos.tolist()]] >= modulus).all())
        if length % 2 == 0:
            assert bool((x[:, 0] == task.PLUS).all())          # the leading '+'
        want_pos = pos if running else torch.tensor([length - 1])
        assert torch.equal(ans.pos, want_pos)
        for r in range(16):
            for j, p in enumerate(ans.pos.tolist()):
                assert int(ans.target[r, j]) == eval(_text(task, x[r, :p + 1])) % modulus


def test_arith_draws_every_operator_and_number():
    task = ModularArithmetic(5)
    x, ans = task.draw(256, 41, torch.Generator().manual_seed(0))
    counts = torch.bincount(x.flatten(), minlength=task.vocab_size)
    assert bool((counts > 0).all())
    assert sorted(set(ans.target.flatten().tolist())) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("modulus", [2, 5])
def test_arith_brackets_answers_are_pythons_value_of_the_expression(modulus):
    task = ModularArithmeticBrackets(modulus)
    gen = torch.Generator().manual_seed(1)
    for length in (2, 3, 4, 5, 6, 7, 40, 97):
        x, ans = task.draw(12, length, gen)
        assert x.shape == (12, length) and int(x.max()) < task.vocab_size == modulus + 5
        assert bool((x[:, -1] == task.EQUALS).all()) and bool((x[:, :-1] != task.EQUALS).all())
        assert torch.equal(ans.pos, torch.tensor([length - 1]))
        for r in range(12):
            depth = torch.cumsum((x[r] == task.OPEN).long() - (x[r] == task.CLOSE).long(), 0)
            assert int(depth.min()) >= 0 and int(depth[-1]) == 0            # balanced brackets
            assert int(ans.target[r, 0]) == eval(_text(task, x[r])) % modulus


def test_arith_brackets_nests_and_uses_both_operators():
    task = ModularArithmeticBrackets(5)
    x, ans = task.draw(64, 64, torch.Generator().manual_seed(2))
    depth = torch.cumsum((x == task.OPEN).long() - (x == task.CLOSE).long(), 1)
    assert int(depth.max()) >= 4
    assert int((x == task.PLUS).sum()) > 0 and int((x == task.MINUS).sum()) > 0
    assert len(set(ans.target.flatten().tolist())) == 5


@pytest.mark.parametrize("overrides", [{"task.name": "arith", "task.running": "true"},
                                       {"task.name": "arith_brackets", "task.modulus": 3}])
def test_evaluation_sets_are_fixed_by_seed_and_length_and_scored_at_the_end(overrides):
    task = make_task(make_config({"data.seq_len": 40, **overrides}).task)
    blocks, ans = task.eval_blocks(range(0, 6), 256, seed=7)
    x = torch.cat(list(blocks), dim=1)
    blocks2, ans2 = task.eval_blocks(range(3, 6), 256, seed=7)
    assert torch.equal(torch.cat(list(blocks2), dim=1), x[3:]) and torch.equal(ans2.target, ans.target[3:])
    assert torch.equal(ans.pos, torch.tensor([255])) and ans.target.shape == (6, 1)
    for r in range(6):
        assert int(ans.target[r, 0]) == eval(_text(task, x[r])) % task.modulus
    other, _ = task.eval_blocks(range(0, 6), 256, seed=8)
    assert not torch.equal(torch.cat(list(other), dim=1), x)


def test_lengths_a_task_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="at least 2"):
        ModularArithmeticBrackets(5).draw(1, 1, torch.Generator())
    with pytest.raises(ValueError, match="at most 16384"):
        ModularArithmeticBrackets(5).check_length(16385)
    with pytest.raises(ValueError, match="modulus of at least 2"):
        ModularArithmetic(1)
