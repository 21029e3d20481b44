"""Synthetic tasks of the Mamba papers: induction heads and selective copying (Mamba, Gu and Dao
2023, section 4.1), multi-query associative recall (Mamba-2, Dao and Gu 2024, section 9.1), and
state tracking: parity, a modular sum and modular arithmetic without and with brackets
(Mamba-3, Lahoti et al. 2026). Seeded generators that
draw fresh sequences every step, and the formats written out exactly, so anyone can generate the
same data.

Induction heads (`InductionHeads`, the paper's Table 2). Vocabulary 16: ids 0..14 are the
content tokens, id 15 is the special token S. A sequence of length L (L >= 4):

    position s            S                      s uniform in [0, min(16, L - 2) - 1]
    position s + 1        A                      A uniform in 0..14: the answer
    position L - 1        S                      the query
    every other position  uniform in 0..14       (never S)

The answer A is read from the logits at the last position, L - 1 (the only position with a
loss and the only one scored). Chance is 1/15 among content tokens (the paper quotes 1/16).
Content tokens after A may repeat A by chance; the answer is always the token that followed
the first S.

Selective copying (`SelectiveCopying`, the paper's Table 1). Vocabulary 16: id 0 is noise,
id 1 the marker, ids 2..15 the 14 data tokens. With `n_data` data tokens (16 in the paper)
and a region of `region` positions (4,096 in the paper; a parameter here: L = region +
n_data):

    positions 0 .. region - 1   noise, except n_data positions drawn without replacement
                                (then sorted) holding data tokens uniform in 2..15
    positions region ..  L - 1  the marker, n_data times

The answer at marker position region + i (i = 0 .. n_data - 1) is the i-th data token in
order of position: the loss and the score are on those n_data positions. Chance 1/14.

Multi-query associative recall (`MQAR`; Arora et al. 2023, "Zoology", in the Mamba-2 paper's
form: T/4 key-value pairs, T 256..1,024, vocabulary 8,192). Vocabulary V (`task.vocab_size`):
id 0 is the filler, ids 1..V/2 - 1 the keys, ids V/2..V - 1 the values (disjoint ranges). With
D key-value pairs (`task.n_pairs`; 0, the default and the paper's rule: D = L // 4 at each
length L, so a longer test sequence holds more pairs) and L >= 4D:

    positions 0 .. 2D - 1       k_1 v_1 k_2 v_2 .. k_D v_D: D distinct keys uniform among the
                                V/2 - 1 keys, D distinct values uniform among the V/2 values
    q_j = 2D + (j (L - 2D)) // D, j = 0 .. D - 1
                                the j-th query: the key k_p(j), p a uniform permutation of
                                1..D (every key queried once, in random order)
    every other position        the filler 0

The answer at q_j is v_p(j), the value that followed the queried key: read from the logits at
q_j, the loss and the score on those D positions only. The queries are spread evenly over the
positions after the pairs (at L = 4D: every other one, q_j = 2D + 2j, each followed by a
filler). Zoology places its queries at power-law gaps and fills the gaps with random tokens;
here the query positions depend on L only, so every row of a batch shares them. Chance 2/V
(uniform over the values; a model that knows only which values were in its context gets 1/D).
`MQAR_GRIDS` holds the paper's grid and a CPU-sized one. `task.mix_pairs=true`: each training
batch draws its pair count uniformly from D, D/2, D/4, D/8 (those >= 1; the same positions
rule at the smaller count), validation and tests stay at D. Measured at length 64, 16 pairs,
width 64 (issue 40): attention trained on D alone stayed at 1/D for 20,000 steps; on the mix it
reaches 99% within 3,000.

Parity and modular sum (`Parity`, `ModularSum`: the state-tracking tasks of the Mamba-3 paper,
which follows the formal-language protocol of Grazzi et al. 2025 and Deletang et al. 2023: one
answer, at the end). Vocabulary m (`task.modulus`, 5 by default; parity: m = 2): ids 0..m - 1
are the tokens and the answers. A sequence of length L (L >= 1):

    every position              uniform in 0..m - 1

The answer is (x_0 + .. + x_{L-1}) mod m (parity: the number of ones mod 2), read from the
logits at the last position L - 1 (the only position with a loss and the only one scored).
`task.running=true`: the training loss at every position t, on (x_0 + .. + x_t) mod m (the
running parity: every prefix, so every length up to L, in one sequence); the score, at
validation and test lengths alike, stays the last position's. Chance 1/m.
`STATE_TRACKING` holds the trained length and the longer test lengths.

Modular arithmetic without and with brackets (`ModularArithmetic`, `ModularArithmeticBrackets`:
the other two columns of the Mamba-3 paper's state-tracking table, Table 5b, which takes both
from Grazzi et al. 2025, who take them from Deletang et al. 2023; modulus m = 5 there).

Without brackets (`arith`). Vocabulary m + 3: ids 0..m - 1 the numbers (and the answers), m
'+', m + 1 '-', m + 2 '*'. A sequence of length L (L >= 1) alternates number, operator,
number, .., number, each number uniform in 0..m - 1, each operator uniform among the three;
at an even L position 0 holds a leading '+' (0 + ..., the value unchanged), so the last
position is always a number. The answer is the expression's value mod m with multiplication
binding first (1 + 2 * 3 = 2 mod 5; Deletang et al.'s rule), read at the last position.
`task.running=true`: the training loss at every number, on the value of the expression that
ends there (its prefix); the score stays the last position's. Chance 1/m.

With brackets (`arith_brackets`). Vocabulary m + 5: ids 0..m - 1 the numbers, m '+', m + 1
'-', m + 2 '(', m + 3 ')', m + 4 '='. A sequence of length L (2 <= L <= 16,384) is an
expression of L - 1 tokens, then '='. An expression of n tokens is, for n = 1..4, d, -d, (d)
or (-d) with d uniform in 0..m - 1; for n >= 5, (E1 op E2) with E1 of n1 tokens, n1 uniform in
1..n - 4, E2 of n - n1 - 3, op '+' or '-' with probability 1/2 (Grazzi et al.'s generator,
without '*' as they ran it). The answer is its value mod m, read at the '=' (the last
position, the only one with a loss). A prefix has no value, so there is no `running` form.
Chance 1/m.

Determinism. `draw(n, length, gen)` takes a torch.Generator: a training sampler owns one and
checkpoints its state (`TaskSampler`), so a resumed run sees the same sequences. Evaluation
sets are fixed by (seed, length): sequence r of the set is drawn by generators seeded by
(seed, length, r), its content block by block (EVAL_BLOCK positions, each block from its own
generator: the block size is part of the set's definition), so `eval_blocks` yields any rows
of it without the others and a sequence of 2^20 tokens is never held whole (selective copying
and MQAR draw each row whole, from one generator, as in training).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from sonata.core.config import parse_curriculum

IGNORE = -100        # target of a position without a loss
EVAL_BLOCK = 1 << 14  # positions per generated evaluation block (part of an evaluation set's definition)


@dataclass(frozen=True)
class Answers:
    """Where a batch is scored: `pos` (k,) positions shared by every row, `target` (n, k)."""
    pos: torch.Tensor
    target: torch.Tensor


class Task:
    """A synthetic task: its vocabulary, the sequences and where the answers are."""
    name = ""
    vocab_size = 16
    min_length = 1

    def draw(self, n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, Answers]:
        """n fresh sequences (n, length) int64 and their answers, from `gen`."""
        raise NotImplementedError

    def draw_train(self, n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, Answers]:
        """A training batch (the sampler's): `draw`, unless the task mixes easier forms in."""
        return self.draw(n, length, gen)

    def targets(self, x: torch.Tensor, ans: Answers) -> torch.Tensor:
        """Per-position targets (n, length): the answer at answer positions, IGNORE elsewhere."""
        y = torch.full_like(x, IGNORE)
        y[:, ans.pos] = ans.target
        return y

    def check_length(self, length: int) -> None:
        if length < self.min_length:
            raise ValueError(f"{self.name} sequences need at least {self.min_length} positions, got {length}")

    def eval_blocks(self, rows: range, length: int, seed: int):
        """(blocks, answers) of the sequences `rows` (a range of row numbers) of the evaluation
        set (seed, length): an iterator over (len(rows), <= EVAL_BLOCK) int64 pieces which,
        concatenated, are the sequences, and their answers. No more than one block is held."""
        metas = [self._eval_meta(length, seed, r) for r in rows]

        def pieces():
            for i, t0 in enumerate(range(0, length, EVAL_BLOCK)):
                yield torch.stack([self._eval_piece(m, length, seed, r, i, t0)
                                   for r, m in zip(rows, metas)])
        return pieces(), self._answers(metas, length)

    def _eval_meta(self, length: int, seed: int, row: int):
        """What sequence `row` needs besides its content blocks (its answers)."""
        raise NotImplementedError

    def _eval_piece(self, meta, length: int, seed: int, row: int, i: int, t0: int) -> torch.Tensor:
        """Block i (positions t0 ..) of sequence `row`."""
        raise NotImplementedError

    def _answers(self, metas, length: int) -> Answers:
        raise NotImplementedError

    def chance(self) -> float:
        raise NotImplementedError

    def summary(self, length: int) -> dict:
        return {"task": self.name, "vocab_size": self.vocab_size, "train_length": length,
                "chance": self.chance()}


def _seeded(*key: int) -> torch.Generator:
    g = torch.Generator()
    h = 0x9E3779B97F4A7C15
    for k in key:                                  # a stable 64-bit mix of the key
        h = ((h ^ (k & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    g.manual_seed(h & 0x7FFFFFFFFFFFFFFF)
    return g


class InductionHeads(Task):
    name = "induction"
    vocab_size = 16
    S = 15                  # the special token
    n_content = 15          # content ids 0..14
    max_start = 16          # the first S lies in [0, min(max_start, L - 2) - 1]
    min_length = 4

    def _meta(self, n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        hi = min(self.max_start, length - 2)
        s = torch.randint(0, hi, (n,), generator=gen)
        a = torch.randint(0, self.n_content, (n,), generator=gen)
        return s, a

    def _place(self, x: torch.Tensor, t0: int, length: int, s: torch.Tensor, a: torch.Tensor) -> None:
        """Write S, A and the final S into x, the positions [t0, t0 + x.shape[1]) of the sequences."""
        rows = torch.arange(x.shape[0])
        t1 = t0 + x.shape[1]
        for pos, val in ((s, self.S), (s + 1, a)):
            inside = (pos >= t0) & (pos < t1)
            x[rows[inside], pos[inside] - t0] = val if isinstance(val, int) else val[inside]
        if t0 <= length - 1 < t1:
            x[:, length - 1 - t0] = self.S

    def draw(self, n, length, gen):
        self.check_length(length)
        s, a = self._meta(n, length, gen)
        x = torch.randint(0, self.n_content, (n, length), generator=gen)
        self._place(x, 0, length, s, a)
        return x, Answers(torch.tensor([length - 1]), a[:, None])

    def _eval_meta(self, length, seed, row):
        self.check_length(length)
        return self._meta(1, length, _seeded(seed, length, row, -1))        # (s, a), one each

    def _eval_piece(self, meta, length, seed, row, i, t0):
        x = torch.randint(0, self.n_content, (1, min(EVAL_BLOCK, length - t0)), generator=_seeded(seed, length, row, i))
        self._place(x, t0, length, *meta)
        return x[0]

    def _answers(self, metas, length):
        return Answers(torch.tensor([length - 1]), torch.cat([a for _, a in metas])[:, None])

    def chance(self) -> float:
        return 1 / self.n_content


class SelectiveCopying(Task):
    name = "copying"
    vocab_size = 16
    NOISE, MARKER = 0, 1
    first_data = 2          # data ids 2..15

    def __init__(self, n_data: int = 16):
        self.n_data = n_data
        self.min_length = 2 * n_data

    def draw(self, n, length, gen):
        self.check_length(length)
        k, region = self.n_data, length - self.n_data
        # k distinct positions per row: the first k of a random permutation, sorted
        pos = torch.rand(n, region, generator=gen).argsort(dim=1)[:, :k].sort(dim=1).values
        data = torch.randint(self.first_data, self.vocab_size, (n, k), generator=gen)
        x = torch.full((n, length), self.NOISE, dtype=torch.long)
        x.scatter_(1, pos, data)
        x[:, region:] = self.MARKER
        return x, Answers(torch.arange(region, length), data)

    def _eval_meta(self, length, seed, row):
        return self.draw(1, length, _seeded(seed, length, row, -1))         # (x, answers) of the row

    def _eval_piece(self, meta, length, seed, row, i, t0):
        return meta[0][0, t0:t0 + EVAL_BLOCK]

    def _answers(self, metas, length):
        return Answers(metas[0][1].pos, torch.cat([ans.target for _, ans in metas]))

    def chance(self) -> float:
        return 1 / (self.vocab_size - self.first_data)


class MQAR(Task):
    name = "mqar"
    FILLER = 0

    def __init__(self, vocab_size: int = 8192, n_pairs: int = 0, mix_pairs: bool = False):
        if vocab_size < 4:
            raise ValueError(f"mqar needs a vocabulary of at least 4 (keys 1..V/2-1, values V/2..V-1), got {vocab_size}")
        self.vocab_size, self.n_pairs, self.mix_pairs = vocab_size, n_pairs, mix_pairs
        self.first_value = vocab_size // 2                  # keys 1 .. first_value - 1, values first_value .. V - 1
        self.n_keys, self.n_values = self.first_value - 1, vocab_size - self.first_value
        self.min_length = 4 * (n_pairs or 1)

    def pairs(self, length: int) -> int:
        """D, the key-value pairs of a sequence of `length`: task.n_pairs, or length // 4."""
        return self.n_pairs or length // 4

    def pair_ladder(self, length: int) -> list[int]:
        """The pair counts a mixed training batch draws from (`task.mix_pairs`): D, D/2, D/4,
        D/8, the ones >= 1, each once."""
        d = self.pairs(length)
        return sorted({max(1, d >> k) for k in range(4)})

    def query_positions(self, length: int, d: int = 0) -> torch.Tensor:
        d = d or self.pairs(length)
        return 2 * d + torch.arange(d) * (length - 2 * d) // d

    def check_length(self, length: int) -> None:
        super().check_length(length)
        d = self.pairs(length)
        if d > min(self.n_keys, self.n_values):
            raise ValueError(f"mqar at length {length} has {d} key-value pairs, more than the {self.n_keys} "
                             f"keys of vocabulary {self.vocab_size} (task.vocab_size)")

    def draw(self, n, length, gen, d: int = 0):
        self.check_length(length)
        d = d or self.pairs(length)
        keys = torch.rand(n, self.n_keys, generator=gen).argsort(dim=1)[:, :d] + 1             # (n, D) distinct
        values = torch.rand(n, self.n_values, generator=gen).argsort(dim=1)[:, :d] + self.first_value
        order = torch.rand(n, d, generator=gen).argsort(dim=1)                                  # p, per row
        x = torch.full((n, length), self.FILLER, dtype=torch.long)
        x[:, 0:2 * d:2], x[:, 1:2 * d:2] = keys, values
        pos = self.query_positions(length, d)
        x[:, pos] = keys.gather(1, order)
        return x, Answers(pos, values.gather(1, order))

    def draw_train(self, n, length, gen):
        """With `mix_pairs`: the batch's pair count drawn uniformly from `pair_ladder(length)`
        (one per batch: its rows share the query positions), so the lookup is learned where
        few pairs make it easy and carries to D (Zoology trains on a mix of pair counts too);
        scored and validated at D alone."""
        if not self.mix_pairs:
            return self.draw(n, length, gen)
        ladder = self.pair_ladder(length)
        d = ladder[int(torch.randint(len(ladder), (1,), generator=gen))]
        return self.draw(n, length, gen, d)

    def _eval_meta(self, length, seed, row):
        return self.draw(1, length, _seeded(seed, length, row, -1))         # (x, answers) of the row

    def _eval_piece(self, meta, length, seed, row, i, t0):
        return meta[0][0, t0:t0 + EVAL_BLOCK]

    def _answers(self, metas, length):
        return Answers(metas[0][1].pos, torch.cat([ans.target for _, ans in metas]))

    def chance(self) -> float:
        return 1 / self.n_values

    def summary(self, length: int) -> dict:
        return {**super().summary(length), "n_pairs": self.pairs(length)}


class ModularSum(Task):
    name = "modsum"

    def __init__(self, modulus: int = 5, running: bool = False):
        if modulus < 2:
            raise ValueError(f"{self.name} needs a modulus of at least 2, got {modulus}")
        self.modulus, self.vocab_size, self.running = modulus, modulus, running

    def draw(self, n, length, gen):
        self.check_length(length)
        x = torch.randint(0, self.modulus, (n, length), generator=gen)
        if self.running:                                   # every prefix's answer
            return x, Answers(torch.arange(length), x.cumsum(dim=1) % self.modulus)
        return x, Answers(torch.tensor([length - 1]), x.sum(dim=1, keepdim=True) % self.modulus)

    def _eval_block(self, length, seed, row, i, t0) -> torch.Tensor:
        return torch.randint(0, self.modulus, (min(EVAL_BLOCK, length - t0),), generator=_seeded(seed, length, row, i))

    def _eval_meta(self, length, seed, row):
        """The row's answer: its blocks drawn once here and summed (and again, one at a time, by
        _eval_piece), so no more than one block is held."""
        self.check_length(length)
        return sum(int(self._eval_block(length, seed, row, i, t0).sum())
                   for i, t0 in enumerate(range(0, length, EVAL_BLOCK))) % self.modulus

    def _eval_piece(self, meta, length, seed, row, i, t0):
        return self._eval_block(length, seed, row, i, t0)

    def _answers(self, metas, length):
        return Answers(torch.tensor([length - 1]), torch.tensor(metas, dtype=torch.long)[:, None])

    def chance(self) -> float:
        return 1 / self.modulus

    def summary(self, length: int) -> dict:
        return {**super().summary(length), "running": self.running}


class Parity(ModularSum):
    name = "parity"

    def __init__(self, running: bool = False):
        super().__init__(2, running)


class ModularArithmetic(Task):
    """Modular arithmetic without brackets (see the module docstring): numbers and +, -, *
    alternating, multiplication first, the value mod m at the last position (every number's
    prefix value with `running`)."""
    name = "arith"

    def __init__(self, modulus: int = 5, running: bool = False):
        if modulus < 2:
            raise ValueError(f"{self.name} needs a modulus of at least 2, got {modulus}")
        self.modulus, self.running = modulus, running
        self.PLUS, self.MINUS, self.TIMES = modulus, modulus + 1, modulus + 2
        self.vocab_size = modulus + 3

    def number_positions(self, length: int) -> torch.Tensor:
        """Where the numbers are: the odd positions of an even length (position 0 holds a
        leading '+'), the even ones of an odd length; the last position is always a number."""
        return torch.arange(length % 2 == 0, length, 2)

    def prefix_values(self, nums: torch.Tensor, ops: torch.Tensor) -> torch.Tensor:
        """nums (n, k) in 0..m-1, ops (n, k - 1) among PLUS/MINUS/TIMES -> (n, k): the value
        mod m of the expression ending at each number (multiplication binds first)."""
        m = self.modulus
        done = torch.zeros_like(nums[:, 0])                  # the sum of the finished terms
        term = nums[:, 0].clone()                            # the open term (its sign included)
        out = torch.empty_like(nums)
        out[:, 0] = term
        for j in range(1, nums.shape[1]):
            op, v = ops[:, j - 1], nums[:, j]
            times = op == self.TIMES
            done = torch.where(times, done, (done + term) % m)
            term = torch.where(times, term * v, torch.where(op == self.PLUS, v, -v)) % m
            out[:, j] = (done + term) % m
        return out

    def draw(self, n, length, gen):
        self.check_length(length)
        pos = self.number_positions(length)
        k = len(pos)
        nums = torch.randint(0, self.modulus, (n, k), generator=gen)
        ops = torch.randint(0, 3, (n, k - 1), generator=gen) + self.PLUS
        x = torch.full((n, length), self.PLUS, dtype=torch.long)       # a leading '+' at an even length
        x[:, pos] = nums
        x[:, pos[1:] - 1] = ops
        values = self.prefix_values(nums, ops)
        if self.running:
            return x, Answers(pos, values)
        return x, Answers(torch.tensor([length - 1]), values[:, -1:])

    def _eval_meta(self, length, seed, row):
        return self.draw(1, length, _seeded(seed, length, row, -1))         # (x, answers) of the row

    def _eval_piece(self, meta, length, seed, row, i, t0):
        return meta[0][0, t0:t0 + EVAL_BLOCK]

    def _answers(self, metas, length):
        last = torch.tensor([length - 1])
        return Answers(last, torch.cat([ans.target[:, -1:] for _, ans in metas]))     # scored at the end

    def chance(self) -> float:
        return 1 / self.modulus

    def summary(self, length: int) -> dict:
        return {**super().summary(length), "modulus": self.modulus, "running": self.running}


class ModularArithmeticBrackets(Task):
    """Modular arithmetic with brackets (see the module docstring): a random bracketed
    expression of + and - over 0..m-1, then '=', its value mod m read at '='."""
    name = "arith_brackets"
    min_length = 2
    max_length = 1 << 14            # the generator recurses about length / 4 deep

    def __init__(self, modulus: int = 5):
        if modulus < 2:
            raise ValueError(f"{self.name} needs a modulus of at least 2, got {modulus}")
        self.modulus = modulus
        self.PLUS, self.MINUS, self.OPEN, self.CLOSE, self.EQUALS = range(modulus, modulus + 5)
        self.vocab_size = modulus + 5

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if length > self.max_length:
            raise ValueError(f"{self.name} sequences are at most {self.max_length} positions, got {length}")

    def expression(self, length: int, rng: random.Random) -> tuple[list[int], int]:
        """A random expression of exactly `length` tokens and its value mod m: 1 to 4 tokens
        are d, -d, (d), (-d); longer ones are (left op right), the left part's length uniform
        in 1..length - 4, op + or -."""
        m, d = self.modulus, rng.randrange(self.modulus)
        short = {1: ([d], d), 2: ([self.MINUS, d], -d % m), 3: ([self.OPEN, d, self.CLOSE], d),
                 4: ([self.OPEN, self.MINUS, d, self.CLOSE], -d % m)}
        if length in short:
            return short[length]
        left_n = rng.randint(1, length - 4)
        left, a = self.expression(left_n, rng)
        right, b = self.expression(length - left_n - 3, rng)
        plus = rng.random() < 0.5
        return ([self.OPEN, *left, self.PLUS if plus else self.MINUS, *right, self.CLOSE],
                (a + b if plus else a - b) % m)

    def draw(self, n, length, gen):
        self.check_length(length)
        x = torch.empty((n, length), dtype=torch.long)
        y = torch.empty((n, 1), dtype=torch.long)
        for r in range(n):                 # each row from its own stream, seeded by `gen`
            toks, val = self.expression(length - 1, random.Random(int(torch.randint(1 << 62, (1,), generator=gen))))
            x[r, :-1], x[r, -1], y[r, 0] = torch.tensor(toks), self.EQUALS, val
        return x, Answers(torch.tensor([length - 1]), y)

    def _eval_meta(self, length, seed, row):
        return self.draw(1, length, _seeded(seed, length, row, -1))         # (x, answers) of the row

    def _eval_piece(self, meta, length, seed, row, i, t0):
        return meta[0][0, t0:t0 + EVAL_BLOCK]

    def _answers(self, metas, length):
        return Answers(torch.tensor([length - 1]), torch.cat([ans.target for _, ans in metas]))

    def chance(self) -> float:
        return 1 / self.modulus

    def summary(self, length: int) -> dict:
        return {**super().summary(length), "modulus": self.modulus}


@dataclass(frozen=True)
class MQARGrid:
    """A grid of MQAR runs (the Mamba-2 paper's figure 8: 2 layers; trained length T with T/4
    pairs, model width, state size N): `points()` and each point's config `overrides`; the
    model's architecture (model.arch) is the caller's. `test_lengths(T)`: T and longer."""
    vocab_size: int
    lengths: tuple
    d_models: tuple
    d_states: tuple
    n_layers: int = 2
    test_factors: tuple = (1, 2, 4)

    def points(self) -> list[tuple[int, int, int]]:
        return [(t, d, n) for t in self.lengths for d in self.d_models for n in self.d_states]

    def overrides(self, length: int, d_model: int, d_state: int) -> dict:
        return {"task.name": "mqar", "task.vocab_size": self.vocab_size, "data.seq_len": length,
                "model.n_layers": self.n_layers, "model.d_model": d_model, "model.d_state": d_state}

    def test_lengths(self, length: int) -> tuple:
        return tuple(length * f for f in self.test_factors)


MQAR_GRIDS = {
    # Mamba-2 paper, section 9.1: T 256..1,024 (T/4 pairs), vocabulary 8,192, 2 layers, width
    # 32..256; Mamba-1 at N = 16, Mamba-2 at N = 16, 64, 256
    "paper": MQARGrid(vocab_size=8192, lengths=(256, 512, 1024), d_models=(32, 64, 128, 256),
                      d_states=(16, 64, 256)),
    # minutes a run on a laptop's CPU: shorter sequences, a smaller vocabulary (511 keys: enough
    # for the 256 pairs of the longest test length, 4 x 256)
    "cpu": MQARGrid(vocab_size=1024, lengths=(64, 128, 256), d_models=(32, 64), d_states=(16, 32, 64)),
}

# Parity and modsum: the trained length and the test lengths (4x the trained length and beyond)
STATE_TRACKING = {"train_length": 64, "test_lengths": (64, 128, 256, 512, 1024)}


def make_task(cfg) -> Task:
    """The task of a TaskConfig (`task.name` and its parameters: `task.n_data`, `task.vocab_size`,
    `task.n_pairs`, `task.modulus`, `task.running`)."""
    if cfg.name == "induction":
        return InductionHeads()
    if cfg.name == "copying":
        return SelectiveCopying(cfg.n_data)
    if cfg.name == "mqar":
        return MQAR(cfg.vocab_size, cfg.n_pairs, cfg.mix_pairs)
    if cfg.name == "parity":
        return Parity(cfg.running)
    if cfg.name == "modsum":
        return ModularSum(cfg.modulus, cfg.running)
    if cfg.name == "arith":
        return ModularArithmetic(cfg.modulus, cfg.running)
    if cfg.name == "arith_brackets":
        return ModularArithmeticBrackets(cfg.modulus)
    raise ValueError(f"no task {cfg.name!r}")


class TaskSampler:
    """Fresh sequences of one length every step, from a seeded generator (the checkpointed
    state: a resumed run draws what an uninterrupted one would). The trainer's batch sampler
    for a task: `draw(n, shard)` -> (x, y), y the answer at answer positions and IGNORE
    elsewhere. Data parallel: every rank draws the whole global batch (cheap) and keeps its
    shard, so the order is a single process's."""

    def __init__(self, task: Task, length: int, seed: int, device=None, curriculum: str = ""):
        self.stages = parse_curriculum(curriculum) or [(length, 0)]
        for stage_length, _ in self.stages:
            task.check_length(stage_length)
        self.task, self.seq_len = task, self.stages[0][0]
        self.device = torch.device(device or "cpu")
        self.gen = torch.Generator()
        self.gen.manual_seed(seed)
        self.draws = 0            # one per optimizer step: where the curriculum is

    def length_at(self, draw: int) -> int:
        """The training length of the `draw`-th batch (0-based) under the curriculum."""
        end = 0
        for length, steps in self.stages:
            end += steps
            if draw < end or steps == 0:
                return length
        return self.stages[-1][0]

    def draw(self, n: int, shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        rank, world = shard
        if n % world:
            raise ValueError(f"cannot split {n} sequences evenly across {world} ranks")
        self.seq_len = self.length_at(self.draws)
        self.draws += 1
        x, ans = self.task.draw_train(n, self.seq_len, self.gen)
        y = self.task.targets(x, ans)
        per = n // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "draws": self.draws}

    def load_state_dict(self, d: dict) -> None:
        self.gen.set_state(d["gen"])
        self.draws = int(d.get("draws", 0))


def answer_loss(logits: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
    """`loss_fn(logits, targets)` over the answer positions only (y != IGNORE)."""
    keep = y != IGNORE
    return loss_fn(logits[keep], y[keep])


@dataclass
class TaskEval:
    """Loss (nats per answer) and accuracy (share of answers whose argmax is right) on
    `sequences` fixed sequences of `length`."""
    loss: float
    accuracy: float
    sequences: int
    length: int

    def fields(self) -> dict:
        """What a metrics row and the summary report."""
        return {"val_loss": self.loss, "val_acc": self.accuracy}


# Positions per forward call in chunked evaluation: (rows x chunk) at most this many tokens,
# so a sequence of 2^20 keeps a few tens of MiB of activations whatever the batch (2^16 measured
# 1.77 GiB of peak resident set for the seed-sized task model; this, under 1 GiB).
EVAL_TOKENS = 1 << 14
# Answers per call of the head in evaluation: their logits, (this many x vocabulary) floats
# (32 MiB at MQAR's vocabulary of 8,192), are all the scoring holds beside the forward's own
# activations, however many answers a batch has.
EVAL_ANSWERS = 1 << 10


def _at_answers(model, head, x, state, chunked: bool, pos: torch.Tensor):
    """`model` over the block x (b, t), carrying `state` when `chunked` -> (what is scored at
    the positions `pos` (k,) of the block, (b, k, .), the new state). `head` (a MambaLM's
    `lm_head`): the model's `hidden` states there, which the caller runs the head on; `head`
    None: the model's whole logits, read at `pos`."""
    run = model.hidden if head is not None else model
    if chunked:
        out, state = run(x, state, return_state=True)
    else:
        out, state = run(x), None
    return out[:, pos], state


def _score(feats: torch.Tensor, head, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy (float64) and the count of right argmaxes at the answers whose
    head inputs (or, `head` None, logits) are `feats` (b, k, .) and targets `target` (b, k),
    EVAL_ANSWERS answers' logits at a time."""
    feats, target = feats.reshape(-1, feats.shape[-1]), target.reshape(-1)
    loss = torch.zeros((), dtype=torch.float64, device=target.device)
    right = torch.zeros((), dtype=torch.int64, device=target.device)
    for a in range(0, target.numel(), EVAL_ANSWERS):
        part = feats[a:a + EVAL_ANSWERS]
        logits, y = (part if head is None else head(part)).float(), target[a:a + EVAL_ANSWERS]
        loss += torch.nn.functional.cross_entropy(logits, y, reduction="sum").double()
        right += (logits.argmax(-1) == y).sum()
        del logits                         # before the next slice's logits are made
    return loss, right


@torch.no_grad()
def evaluate_task(model, task: Task, length: int, n: int, seed: int, *, chunked: bool = True,
                  device=None) -> TaskEval:
    """Loss and accuracy of `model` on the n fixed sequences of (seed, length), scored at the
    answer positions. A batch of sequences at a time (at most EVAL_TOKENS positions per
    forward call); `chunked`: each batch runs block by block (`EVAL_BLOCK` positions) carrying
    its recurrent state (`model(x, state, return_state=True)`), so memory grows neither with
    the length nor with n (but for attention, whose state is every key and value: pass
    chunked=False, one pass over each whole sequence). Each block is reduced at once to the
    summed loss and the count of right answers, so no logits outlive their block; the head
    (`lm_head` over `hidden`, a MambaLM's) runs at the answer positions alone, EVAL_ANSWERS at
    a time, so none are computed where nothing is scored (a model without them: its whole
    logits, read at the answers)."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = max(1, min(n, EVAL_TOKENS // min(EVAL_BLOCK if chunked else length, length)))
    head = getattr(model, "lm_head", None) if hasattr(model, "hidden") else None   # a MambaLM's
    loss = torch.zeros((), dtype=torch.float64, device=device)          # summed over the answers
    right = torch.zeros((), dtype=torch.int64, device=device)
    answers = 0
    try:
        for r0 in range(0, n, rows):             # a batch of sequences at a time, block by block
            blocks, ans = task.eval_blocks(range(r0, min(n, r0 + rows)), length, seed)
            if not chunked:
                blocks = [torch.cat(list(blocks), dim=1)]
            state, t0 = None, 0
            for x in blocks:
                t1 = t0 + x.shape[1]
                inside = (ans.pos >= t0) & (ans.pos < t1)
                feats, state = _at_answers(model, head, x.to(device), state, chunked,
                                           (ans.pos[inside] - t0).to(device))
                block_loss, block_right = _score(feats, head, ans.target[:, inside].to(device))
                del feats                         # not held through the next forward
                loss += block_loss
                right += block_right
                t0 = t1
            answers += ans.target.numel()
    finally:
        model.train(was_training)
    return TaskEval(loss=float(loss) / answers, accuracy=int(right) / answers, sequences=n, length=length)


LONG = 1 << 16      # lengths above this are scored on `n_long` sequences (each costs n / n_long times more)


def _status_kib(field: str) -> int | None:
    """A `VmRSS` / `VmHWM` line of /proc/self/status in KiB (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> int | None:
    """Start measuring a new resident-set peak from now (Linux: `5` to /proc/self/clear_refs
    resets VmHWM to the current resident set) -> the resident bytes now, or None where the
    peak cannot be reset (peak_rss_bytes is then the process's peak so far)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    rss = _status_kib("VmRSS")
    return None if rss is None else rss * 1024


def peak_rss_bytes() -> int:
    """The resident set's peak since the last reset_peak_rss (the process's peak where it
    cannot be reset)."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024      # bytes on macOS, KiB on Linux


def accuracy_by_length(model, task: Task, lengths, n: int = 256, n_long: int = 32, seed: int = 1234,
                       budget_s: float = 0.0, on_row=None) -> list[dict]:
    """Accuracy (and loss) per test length on fixed sequences: n per length up to LONG, n_long
    beyond. Recurrent models run chunk by chunk (bounded memory); attention runs each whole
    sequence (its state is every key and value, and its time grows with the square of the
    length). `budget_s` > 0: a length whose time, extrapolated from the last length measured
    (linearly for recurrent models, quadratically for attention, times the sequence count),
    would pass the budget is not run, and neither is any longer one: its row says so.
    `on_row(row)` is called as each row is done. Rows: length, sequences, accuracy, loss,
    seconds, peak_rss_mib (the resident set's peak during this length's evaluation: the
    process's peak is reset before each length on Linux, so a model trained in the same
    process does not show its training's peak here; elsewhere the process's peak so far),
    eval_mib (that peak above the resident set when the length began: what the evaluation
    itself added; None where the peak cannot be reset), note."""
    attention = getattr(getattr(model, "cfg", None), "arch", "") == "attention"
    rows, last, stop = [], None, None
    for length in lengths:
        k = n if length <= LONG else n_long
        if stop is None and budget_s and last is not None:
            est = last[2] * (length / last[0]) ** (2 if attention else 1) * k / last[1]
            if est > budget_s:
                stop = (f"not run: about {est:,.0f} s at this length (time grows with the "
                        f"{'square of the length: attention' if attention else 'length'}) > budget {budget_s:g} s")
        if stop is not None:
            row = {"length": length, "sequences": 0, "accuracy": None, "loss": None, "seconds": None,
                   "peak_rss_mib": None, "eval_mib": None, "note": stop}
        else:
            before = reset_peak_rss()
            t0 = time.perf_counter()
            ev = evaluate_task(model, task, length, k, seed, chunked=not attention)
            dt = time.perf_counter() - t0
            last = (length, k, dt)
            row = {"length": length, "sequences": k, "accuracy": ev.accuracy, "loss": ev.loss,
                   "seconds": round(dt, 2), "peak_rss_mib": round(peak_rss_bytes() / 2**20),
                   "eval_mib": None if before is None else round((peak_rss_bytes() - before) / 2**20),
                   "note": "whole sequences" if attention else f"chunks of {EVAL_BLOCK:,}"}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
