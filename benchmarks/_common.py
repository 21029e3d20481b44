"""Shared by the benchmark scripts: table printing and the hardware line.
(Timing lives in sonata.lab.timing, the mambapy peer in sonata.lab.peers.)

Benchmarks print tables measured side by side in one run; ratios matter more
than absolute figures on a noisy machine. Nothing here is a test.
"""
from __future__ import annotations

import torch


def print_table(headers, rows, title=None):
    cols = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cols[1:]:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


def hardware_line(device="cpu") -> str:
    import platform

    from sonata.lab.bench import hardware_name
    return (f"hardware: {hardware_name(torch.device(device))}; torch {torch.__version__}; "
            f"python {platform.python_version()}")
