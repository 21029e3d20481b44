"""Shared by the benchmark scripts: timing, the mambapy peer, table printing.

Benchmarks print tables measured side by side in one run; ratios matter more
than absolute figures on a noisy machine. Nothing here is a test.
"""
from __future__ import annotations

import statistics
import sys
import time
import types

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device="cpu", warmup=2, repeat=5) -> float:
    """Median wall time of fn() in seconds, device synchronized around each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def import_mambapy():
    """mambapy's LM imports its Mamba-2 module, which needs mamba_ssm's Triton ops at
    import time. We only use Mamba-1 (pure PyTorch parallel scan), so stand-ins for
    those names are enough to import it."""
    if "mamba_ssm" not in sys.modules:
        def _unavailable(*a, **k):
            raise RuntimeError("mamba_ssm is not installed; Mamba-2 is not benchmarked")
        names = ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
                 "mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated"]
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        ssd = sys.modules["mamba_ssm.ops.triton.ssd_combined"]
        ssd.mamba_chunk_scan_combined = ssd.mamba_split_conv1d_scan_combined = _unavailable
    import mambapy.lm
    import mambapy.mamba
    import mambapy.pscan
    return mambapy


def mambapy_lm(d_model, n_layers, d_state, vocab_size, device="cpu"):
    """mambapy's LM at the given size, with tied embeddings like sonata's (same parameter count)."""
    mp = import_mambapy()
    cfg = mp.mamba.MambaConfig(d_model=d_model, n_layers=n_layers, d_state=d_state, pscan=True)
    lm = mp.lm.LM(cfg, vocab_size=vocab_size)
    lm.lm_head.weight = lm.embedding.weight
    return lm.to(device)


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
