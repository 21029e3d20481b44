"""Where a training step's CPU time goes: a torch.profiler table by operator.

    python benchmarks/profile_step.py [--models cpu peer-free] [--batches 8 32] [--steps 10]
                                      [--top 15] [--threads 2]

Seed configuration (d_model 96, 2 layers, d_state 16, L 128, vocabulary 512, fp32),
one step = forward, cross-entropy, backward, AdamW step (PyTorch's fused AdamW, as the
trainer runs it; sonata's model with its own loss kernel), on fixed random batches;
warm-up steps run before the profiler starts. Models: sonata with a scan backend
(`cpu`, `reference`), `free` (sonata's model with its scan swapped for the O(B.L.D)
stand-in of `sonata.peers.free_scan`), `mambapy` (the peer) and `peer-free` (the peer
with the same stand-in: the scan-free peer). Per model and micro-batch: the operators
with the most self CPU time (their share of the step, calls per step), then the share
of matrix multiplies (aten::mm, aten::addmm, aten::bmm) and the layout copies per step.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.memory import steady_cpu_heap  # noqa: E402
from sonata.studies import STEP_SEED, STEP_SEQ_LEN, step_model, train_step  # noqa: E402

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["cpu", "peer-free"])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steady_cpu_heap()             # as sonata's trainer runs; every model profiled with it alike
    print(hardware_line("cpu"))
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
