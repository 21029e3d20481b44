"""The ten-minute race: sonata against transformers' GPT-2 at equal parameters, data, batch,
context and CPU time (issue 29), every model through sonata's own trainer.

    python benchmarks/race.py [--budget-s 600] [--configs sonata gpt2-lr1e-3 ...] [--seed 0]

Data: the real TinyStories sample ($SONATA_TINYSTORIES, e.g. ../shared/data/...), else the
embedded corpus (the line before the runs and the line under the table say which). Each configuration trains for
--budget-s seconds of training time (sonata.train.schedule) on the same sampler and seed, so every
model sees the same batches, then is scored on the validation split in bits per byte
(sonata.train.evaluate) and on as many tokens of the training stream. Configurations:
sonata.lab.race.RACE (sonata's levers: bf16, context 256 and 512 at the same tokens per step,
weight decay 0.3; GPT-2 at three learning rates and with weight decay 0.3).
One run, one machine: compare the rows, not runs on different days.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.lab.race import RACE, RACE_MAMBA2, RACE_NEW, race_conclusion, speedrun, speedrun_source  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=600.0, help="training seconds per configuration")
    ap.add_argument("--configs", nargs="+", default=list(RACE), choices=list(RACE) + list(RACE_MAMBA2) + list(RACE_NEW))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--curve-points", type=int, default=4)
    ap.add_argument("--out-dir", default=None, help="keep each run's folder (checkpoint.pt, metrics.jsonl) here")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source, note = speedrun_source("tinystories")
    print(hardware_line("cpu"))
    print(note, flush=True)          # before the first run: a fallback to the embedded corpus is not a race
    result = speedrun(args.configs, args.budget_s, source, curve_points=args.curve_points, seed=args.seed,
                      out_dir=args.out_dir, progress="none", configs={**RACE, **RACE_MAMBA2, **RACE_NEW})
    print_table(list(result.rows[0]), [list(r.values()) for r in result.rows],
                title=f"the race: {args.budget_s:g} s of training per configuration")
    print(note)
    print(race_conclusion(result.rows))


if __name__ == "__main__":
    main()
