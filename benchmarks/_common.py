"""Shared by the benchmark scripts: table printing and the hardware line.
(Timing lives in sonata.kernels.timing, the mambapy peer in sonata.peers.)

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
    dev = torch.cuda.get_device_name(0) if torch.device(device).type == "cuda" else (
        platform.processor() or platform.machine())
    return (f"hardware: {dev}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
            f"python {platform.python_version()}")
