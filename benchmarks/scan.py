"""Selective-scan time per backend: forward, and forward+backward.

    python benchmarks/scan.py [--sizes seed large] [--threads 2] [--repeat 5]

Backends: reference (plain PyTorch loop), cpu (fused numba), triton (fused, CUDA
only: interpreter timings mean nothing), and mambapy's pure-PyTorch parallel scan
(pscan over the materialized (B, L, D, N) tensors) as the peer. All compute the
same thing: softplus(delta + bias), the scan, the D skip and the silu(z) gate; the
last column shows each one's largest deviation from the float64 reference.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.lab.timing import SIZES, default_backends, time_backends  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["seed", "large"], choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", nargs="+", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(hardware_line(args.device))
    rows = time_backends(args.sizes, args.backends or default_backends(args.device), args.device,
                         args.repeat)
    print_table(list(rows[0]), [list(r.values()) for r in rows],
                title=f"selective scan, fp32, median of {args.repeat} after 2 warm-up calls")


if __name__ == "__main__":
    main()
