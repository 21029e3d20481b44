"""Where a training step's CPU time goes: a torch.profiler table by operator.

    python benchmarks/profile_step.py [--models cpu peer-free] [--batches 8 32] [--steps 10]
                                      [--top 15] [--threads 2]
    python benchmarks/profile_step.py --race [sonata sonata-bf16 gpt2-lr6e-3 ...]

Seed configuration (d_model 96, 2 layers, d_state 16, L 128, vocabulary 512, fp32),
one step = forward, cross-entropy, backward, AdamW step (PyTorch's fused AdamW, as the
trainer runs it; sonata's model with its own loss kernel), on fixed random batches;
warm-up steps run before the profiler starts. Models: sonata with a scan backend
(`cpu`, `reference`), `free` (sonata's model with its scan swapped for the O(B.L.D)
stand-in of `sonata.lab.peers.free_scan`), `mambapy` (the peer) and `peer-free` (the peer
with the same stand-in: the scan-free peer). Per model and micro-batch: the operators
with the most self CPU time (their share of the step, calls per step), then the share
of matrix multiplies (aten::mm, aten::addmm, aten::bmm) and the layout copies per step.

--race: the ten-minute race's models instead (sonata.lab.race.RACE: vocabulary 2048, global
batch 16, each at its own precision and context; `sonata.lab.speed.race_step`), and per model
the step's wall time split into matrix multiplies, sonata's fused kernels (the autograd
Functions of the scan, conv, norm and loss kernels), the other PyTorch operators, and the
rest (Python and what the profiler does not see). The profiler's own cost per operator
makes every step slower than in the race: compare the shares, not the speeds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.lab.race import RACE  # noqa: E402
from sonata.lab.speed import STEP_SEED, STEP_SEQ_LEN, race_step, step_model, train_step
from sonata.train.memory import steady_cpu_heap  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def profile_model(name: str, batch: int, steps: int, warmup: int):
    """-> (rows of (operator, self CPU us, calls) sorted by time, total self CPU us)."""
    g = torch.Generator().manual_seed(batch)
    x = torch.randint(0, STEP_SEED["vocab_size"], (batch, STEP_SEQ_LEN), generator=g)
    y = torch.randint(0, STEP_SEED["vocab_size"], (batch, STEP_SEQ_LEN), generator=g)
    step = train_step(step_model(name, torch.device("cpu")), x, y)
    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


def profile_race(name: str, steps: int, warmup: int):
    """-> (operator rows as profile_model's, their total self CPU us, wall us of the steps,
    tokens per step) for race configuration `name`."""
    step, tokens = race_step(name)
    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) * 1e6
    rows = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows), wall, tokens


def _fused(op: str) -> bool:
    """sonata's fused kernels as the profiler names them: their autograd Functions
    (SelectiveScanFn, ... and their backwards) and their custom ops (sonata::cross_entropy,
    sonata::cross_entropy_backward, ...)."""
    return op.endswith("Fn") or op.endswith("FnBackward") or op.startswith("sonata::")


def race_split(names, steps: int, warmup: int) -> None:
    """Print the race models' step split: matmuls, sonata's fused kernels, the other
    PyTorch operators, and the rest (Python and whatever the profiler does not see)."""
    table = []
    for name in names:
        rows, ops, wall, tokens = profile_race(name, steps, warmup)
        mm = sum(us for op, us, _ in rows if op in MATMULS)
        fused = sum(us for op, us, _ in rows if _fused(op))
        rest = max(wall - ops, 0.0)
        top = [op for op, _, _ in rows if op not in MATMULS and not _fused(op)][:3]
        table.append([name, f"{wall / 1e3 / steps:.1f}", f"{tokens * steps / (wall / 1e6):,.0f}",
                      f"{100 * mm / wall:.0f}%", f"{100 * fused / wall:.0f}%", f"{100 * (ops - mm - fused) / wall:.0f}%",
                      f"{100 * rest / wall:.0f}%", ", ".join(top)])
    print_table(["model", "ms/step", "tokens/s", "matmuls", "fused kernels", "other operators", "rest",
                 "largest other operators"], table,
                title=f"the race's models: one step of 2,048 tokens, {steps} steps under the profiler")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["cpu", "peer-free"])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--race", nargs="*", choices=list(RACE), default=None, metavar="NAME",
                    help="profile the race's models instead (no names: all of sonata.lab.race.RACE)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steady_cpu_heap()             # as sonata's trainer runs; every model profiled with it alike
    print(hardware_line("cpu"))
    if args.race is not None:
        race_split(args.race or list(RACE), args.steps, args.warmup)
        return
    summary = []
    for batch in args.batches:
        for name in args.models:
            rows, total = profile_model(name, batch, args.steps, args.warmup)
            table = [[op, f"{us / 1e3 / args.steps:.2f}", f"{100 * us / total:.1f}%",
                      f"{cnt / args.steps:g}"] for op, us, cnt in rows[:args.top]]
            print_table(["operator", "self CPU ms/step", "share", "calls/step"], table,
                        title=f"{name}, micro-batch {batch}: {total / 1e3 / args.steps:.1f} ms "
                              f"self CPU per step ({args.steps} steps)")
            mm = sum(us for op, us, _ in rows if op in MATMULS)
            copies = sum(cnt for op, _, cnt in rows if op == "aten::copy_") / args.steps
            summary.append([name, batch, f"{total / 1e3 / args.steps:.1f}", f"{100 * mm / total:.1f}%",
                            f"{copies:g}"])
    print_table(["model", "micro-batch", "self CPU ms/step", "matmul share", "aten::copy_/step"],
                summary, title="summary (matmul = aten::mm + aten::addmm + aten::bmm)")


if __name__ == "__main__":
    main()
