"""Timing the selective-scan backends side by side (benchmarks/scan.py, notebook 00).

Every figure comes with the largest deviation of that backend's output from the
float64 reference on the same inputs, so a fast but wrong kernel cannot look good.
Times are medians over repeats after warm-up, with the device synchronized.
"""
from __future__ import annotations

import statistics
import time

import torch

from sonata.core.device import sync  # noqa: F401  (re-exported: benchmarks time with it)
from sonata.kernels import resolve_backend, selective_scan, selective_scan_ref

SIZES = {  # name: (batch, d_inner, N, L)
    "seed": (8, 192, 16, 128),       # one layer of the seed model, micro-batch 8
    "seed-b32": (32, 192, 16, 128),
    "large": (8, 768, 16, 512),
    "small": (2, 64, 16, 64),
}
GRAD_INPUTS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")



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


def make_inputs(batch, d, n, L, device="cpu", dtype=torch.float32, seed=0) -> dict:
    """Mamba-like inputs: softplus(delta + bias) around 0.01-0.1, A = -(1..N)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = dict(u=r(batch, d, L), delta=r(batch, d, L) * 0.5 - 1.0,
             A=-torch.arange(1, n + 1).float().repeat(d, 1),
             B=r(batch, n, L), C=r(batch, n, L), D=torch.ones(d), z=r(batch, d, L),
             delta_bias=torch.rand(d, generator=g) * 0.5 - 3.0)
    return {k: v.to(device=device, dtype=dtype if k not in ("A", "D", "delta_bias") else torch.float32)
            for k, v in t.items()}


def _call(name, t):
    if name == "mambapy":
        from sonata.lab.peers import mambapy_scan
        return mambapy_scan(**t)
    return selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"],
                          delta_softplus=True, backend=name)


def max_error(name, inp) -> float:
    """Largest |output - float64 reference| on these inputs."""
    with torch.no_grad():
        ref = selective_scan_ref(*(inp[k].double() for k in ("u", "delta", "A", "B", "C", "D", "z")),
                                 delta_bias=inp["delta_bias"].double(), delta_softplus=True)
        return float((_call(name, inp).double() - ref).abs().max())


def runner(name, inp, backward):
    leaves = {k: v.detach().clone().requires_grad_(backward and k in GRAD_INPUTS) for k, v in inp.items()}

    def call():
        out = _call(name, leaves)
        if backward:
            out.backward(torch.ones_like(out))
            for v in leaves.values():
                v.grad = None
    return call


def default_backends(device) -> list[str]:
    return ["reference", "cpu", "mambapy"] if torch.device(device).type == "cpu" else [
        "reference", "triton", "mambapy"]


def time_backends(sizes=("seed",), backends=None, device="cpu", repeat=5, warmup=2) -> list[dict]:
    """One row per (size, backend) that runs here: fwd and fwd+bwd ms, speed-ups, error."""
    rows = []
    for size in sizes:
        b, d, n, L = SIZES[size] if isinstance(size, str) else size
        label = size if isinstance(size, str) else "custom"
        inp = make_inputs(b, d, n, L, device)
        times = {}
        for name in backends or default_backends(device):
            if name != "mambapy" and resolve_backend(name, inp["u"])[0] != name:
                continue           # not runnable here (e.g. triton without CUDA): no fake figure
            fwd = median_time(runner(name, inp, False), device, warmup, repeat)
            fb = median_time(runner(name, inp, True), device, warmup, repeat)
            times[name] = (fwd, fb, max_error(name, inp))
        ref = times.get("reference")
        for name, (fwd, fb, err) in times.items():
            rows.append({"size": f"{label} ({b}x{d}x{n}x{L})", "backend": name,
                         "fwd ms": round(fwd * 1e3, 2), "fwd+bwd ms": round(fb * 1e3, 2),
                         "fwd speed-up vs reference": round(ref[0] / fwd, 2) if ref else None,
                         "fwd+bwd speed-up vs reference": round(ref[1] / fb, 2) if ref else None,
                         "max |out - fp64 ref|": f"{err:.1e}"})
    return rows


def scan_with_grads(backend: str, inp: dict, dtype=None) -> dict:
    """Output, last state and every gradient (for d(sum of out * w)) of one backend."""
    leaves = {k: (v if dtype is None else v.to(dtype)).detach().clone().requires_grad_(True)
              for k, v in inp.items()}
    out, last = selective_scan(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"],
                               leaves["D"], leaves["z"], leaves["delta_bias"], delta_softplus=True,
                               return_last_state=True, backend=backend)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    (out * w).sum().backward()
    return {"out": out.detach(), "last_state": last.detach(),
            **{f"d{k}": leaves[k].grad for k in GRAD_INPUTS}}


def agreement(backends, inp: dict) -> list[dict]:
    """Relative RMS error of each backend's outputs and gradients against the float64 reference."""
    ref = scan_with_grads("reference", inp, torch.float64)
    rows = []
    for name in backends:
        got = scan_with_grads(name, inp)
        row = {"backend": name}
        for k, r in ref.items():
            g = got[k].double()
            row[k] = float((g - r).norm() / r.norm().clamp(min=1e-30)) if torch.isfinite(g).all() else float("nan")
        rows.append(row)
    return rows


def saved_tensor_bytes(fn, exclude=()) -> int:
    """Run fn() and count the bytes autograd saves for its backward (distinct storages;
    those of the tensors in `exclude`, e.g. parameters, not counted): (result, bytes)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values())


def saved_bytes(backends, inp: dict) -> dict:
    """Bytes saved for the backward of one scan call per backend (inputs that need grad)."""
    out = {}
    for name in backends:
        leaves = {k: v.detach().clone().requires_grad_(k in GRAD_INPUTS) for k, v in inp.items()}
        _, n = saved_tensor_bytes(lambda: _call(name, leaves))
        out[name] = n
    return out
