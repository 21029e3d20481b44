"""Training tokens/s with its proof of validity, through the benchmark harness.

    python benchmarks/validity.py [--steps 30] [--threads 2] [--micro 8 16 32] [--leak]

Each configuration (the seed model at each micro-batch; with --leak also the
deliberately leaky `debug.leak=keep_graph` run) is measured by `sonata.lab.bench.run_bench`:
two runs from the same seed, the median of 5-step windows after 3 warm-up steps, peak
memory, the leak detector's slope, non-finite steps, reproducibility, fallbacks and
host-to-device bytes, and a verdict. A figure whose checks fail is INVALID, not a speed.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.lab.bench import run_bench  # noqa: E402


def validity_table(micro_batches, steps: int, threads: int, leak: bool = False, extra=()) -> None:
    # fixed_micro_batch: these are micro-benchmarks of given batches, whatever the profile's cap
    configs = [(f"seed, micro-batch {m}", [f"train.fixed_micro_batch={m}", f"train.effective_batch={m}",
                                           f"train.threads={threads}", "train.precision=fp32", *extra])
               for m in micro_batches]
    if leak:
        m = micro_batches[0]
        configs.append((f"seed, micro-batch {m}, debug.leak=keep_graph",
                        configs[0][1] + ["debug.leak=keep_graph"]))
    rows = []
    for name, ov in configs:
        rec = run_bench(ov, steps=steps)
        rows.append([name, f"{rec.tok_per_s:,.0f}" if rec.tok_per_s else "-",
                     f"{rec.tok_per_s_best_window:,.0f}" if rec.tok_per_s_best_window else "-",
                     f"{rec.peak_mem_bytes / 2**20:,.0f}", f"{rec.mem_slope_bytes_per_step / 2**20:+.2f}",
                     rec.nonfinite, rec.reproducible, rec.fallbacks, rec.h2d_bytes_in_steps, rec.verdict,
                     "; ".join(r.split(":")[0] for r in rec.reasons) or "-"])
    print_table(["run", "tok/s (median window)", "best window", "peak MiB", "MiB/step", "non-finite",
                 "reproducible", "fallbacks", "h2d B", "verdict", "reasons"], rows,
                title=f"training throughput with validity (sonata.lab.bench, {steps} steps x 2 runs, "
                      f"3 warm-up steps excluded)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--leak", action="store_true", help="also measure the leaky run")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(hardware_line("cuda" if torch.cuda.is_available() else "cpu"))
    validity_table(args.micro, args.steps, args.threads, leak=args.leak)


if __name__ == "__main__":
    main()
