"""Selective-scan time per backend: forward, and forward+backward.

    python benchmarks/scan.py [--sizes seed large] [--threads 2] [--repeat 5]

Backends: reference (plain PyTorch loop), cpu (fused numba), triton (fused, CUDA
only: interpreter timings mean nothing), and mambapy's pure-PyTorch parallel scan
(pscan over the materialized (B, L, D, N) tensors) as the peer. All compute the
same thing: softplus(delta + bias), the scan, the D skip and the silu(z) gate.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, import_mambapy, median_time, print_table  # noqa: E402

from sonata.kernels import resolve_backend, selective_scan, selective_scan_ref  # noqa: E402

SIZES = {  # name: (batch, d_inner, N, L)
    "seed": (8, 192, 16, 128),       # one layer of the seed model, micro-batch 8
    "seed-b32": (32, 192, 16, 128),
    "large": (8, 768, 16, 512),
    "small": (2, 64, 16, 64),
}


def make_inputs(batch, d, n, L, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = dict(u=r(batch, d, L), delta=r(batch, d, L) * 0.5 - 1.0,
             A=-torch.exp(torch.log(torch.arange(1, n + 1).float()).repeat(d, 1)),
             B=r(batch, n, L), C=r(batch, n, L), D=torch.ones(d), z=r(batch, d, L),
             delta_bias=torch.rand(d, generator=g) * 0.5 - 4.0)
    return {k: v.to(device=device, dtype=dtype if k not in ("A", "D", "delta_bias") else torch.float32)
            for k, v in t.items()}


def mambapy_scan(u, delta, A, B, C, D, z, delta_bias):
    """mambapy's selective_scan (pscan) in our layout, with the same bias/softplus/gate."""
    pscan = import_mambapy().pscan.pscan
    x = u.transpose(1, 2)                                           # (b, L, d)
    dt = F.softplus(delta.transpose(1, 2) + delta_bias)             # (b, L, d)
    deltaA = torch.exp(dt.unsqueeze(-1) * A)                        # (b, L, d, n)
    BX = dt.unsqueeze(-1) * B.transpose(1, 2).unsqueeze(2) * x.unsqueeze(-1)
    hs = pscan(deltaA, BX)
    y = (hs @ C.transpose(1, 2).unsqueeze(-1)).squeeze(3) + D * x
    return (y * F.silu(z.transpose(1, 2))).transpose(1, 2)


def max_error(name, inp) -> float:
    """Largest |output - float64 reference|: the comparison is only fair if all agree."""
    with torch.no_grad():
        ref = selective_scan_ref(*(inp[k].double() for k in ("u", "delta", "A", "B", "C", "D", "z")),
                                 delta_bias=inp["delta_bias"].double(), delta_softplus=True)
        out = mambapy_scan(**inp) if name == "mambapy" else selective_scan(
            inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"],
            inp["delta_bias"], delta_softplus=True, backend=name)
    return float((out.double() - ref).abs().max())


def runner(name, inp, backward):
    grads = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    leaves = {k: (v.detach().clone().requires_grad_(backward and k in grads)) for k, v in inp.items()}

    def call():
        if name == "mambapy":
            out = mambapy_scan(**leaves)
        else:
            out = selective_scan(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"],
                                 leaves["D"], leaves["z"], leaves["delta_bias"], delta_softplus=True,
                                 backend=name)
        if backward:
            out.backward(torch.ones_like(out))
            for v in leaves.values():
                v.grad = None
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["seed", "large"], choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", nargs="+", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    names = args.backends or (["reference", "cpu", "mambapy"] if dev.type == "cpu"
                              else ["reference", "triton", "mambapy"])
    print(hardware_line(dev))
    rows = []
    for size in args.sizes:
        b, d, n, L = SIZES[size]
        inp = make_inputs(b, d, n, L, dev)
        times = {}
        for name in names:
            if name != "mambapy" and resolve_backend(name, inp["u"])[0] != name:
                continue
            fwd = median_time(runner(name, inp, False), dev, repeat=args.repeat)
            fb = median_time(runner(name, inp, True), dev, repeat=args.repeat)
            times[name] = (fwd, fb, max_error(name, inp))
        ref = times.get("reference")
        for name, (fwd, fb, err) in times.items():
            rows.append([f"{size} ({b}x{d}x{n}x{L})", name, f"{fwd * 1e3:.2f}", f"{fb * 1e3:.2f}",
                         f"{ref[0] / fwd:.1f}x" if ref else "-", f"{ref[1] / fb:.1f}x" if ref else "-",
                         f"{err:.1e}"])
    print_table(["size (batch x d_inner x N x L)", "backend", "fwd ms", "fwd+bwd ms",
                 "fwd speed-up vs reference", "fwd+bwd speed-up vs reference",
                 "max |out - fp64 ref|"], rows,
                title=f"selective scan, fp32, median of {args.repeat} after 2 warm-up calls")


if __name__ == "__main__":
    main()
