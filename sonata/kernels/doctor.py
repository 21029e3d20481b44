"""`python -m sonata doctor`: which backend each kernel family runs on this machine, and why.

For every kernel family (its `dispatch.Family`) and every device present (the CPU, and CUDA when
a GPU is there), `dispatch.resolve` is asked what backend `auto` runs for float32 tensors of that
device: the answer, the reason when it is not the fast path asked for (numba or Triton missing,
Triton's interpreter off, ...), what that backend is in words, and for Triton families whether
their kernels have passed on a GPU (`GPU_VERIFIED`). Above the rows: the libraries, the CPU's
vector extensions, the torch threads. Nothing is compiled or launched: importing a fused module
is the deepest check (numba and triton are imported, no kernel runs).
"""
from __future__ import annotations

import importlib

import torch

from sonata.kernels import dispatch

# (package under sonata.kernels, the name of its Family there)
FAMILY_MODULES = (("selective", "SELECTIVE"), ("layers", "LAYERS"), ("ssd", "SSD"), ("mamba3", "MAMBA3"),
                  ("gdn", "GDN"))

# (family, backend) -> what runs, in words
WHAT = {
    ("selective_scan", "cpu"): "the fused numba scan, forward and backward (selective/cpu.py)",
    ("selective_scan", "triton"): "the Triton scan (selective/triton.py)",
    ("selective_scan", "reference"): "the PyTorch loop over time (selective/reference.py)",
    ("layers", "cpu"): "fused numba conv + SiLU, RMSNorm, gated RMSNorm, cross-entropy (layers/cpu.py)",
    ("layers", "reference"): "PyTorch ops (layers/reference.py)",
    ("ssd", "cpu"): "numba: the chunked SSD, or the recurrent form where it is faster (ssd/cpu.py)",
    ("ssd", "triton"): "the Triton SSD (ssd/triton.py)",
    ("ssd", "reference"): "the chunked SSD in PyTorch ops (ssd/reference.py)",
    ("mamba3", "cpu"): "SISO on the SSD kernels (mamba3/ssd_form.py), MIMO as batched matmuls "
                       "(mamba3/chunked.py); generation's step fused in numba (mamba3/cpu_step.py)",
    ("mamba3", "reference"): "the token-by-token float64 recurrence (mamba3/reference.py)",
    ("gdn", "cpu"): "fused numba forward, backward and one-token step (gdn/cpu.py)",
    ("gdn", "reference"): "the chunked WY form in PyTorch ops (gdn/reference.py)",
}


def families() -> list[dispatch.Family]:
    """Every kernel family's description, in FAMILY_MODULES' order."""
    return [getattr(importlib.import_module(f"sonata.kernels.{pkg}"), name) for pkg, name in FAMILY_MODULES]


def devices() -> list[torch.device]:
    return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def rows(devs=None) -> list[dict]:
    """One row per (family, device): family, device, runs (the backend `auto` resolves to for
    float32 tensors there), why (the reason it is not the fast path asked for, or what chose
    it), what (that backend in words), gpu (Triton families on CUDA: verified or not)."""
    out = []
    for fam in families():
        for dev in devs or devices():
            x = torch.empty(0, device=dev)
            runs, why = dispatch.resolve(fam, "auto", x)
            asked = "triton" if dispatch.on_cuda(x) else "cpu"
            if why is None:
                why = (f"auto picks {asked} for {'CUDA' if asked == 'triton' else 'CPU'} tensors"
                       if runs == asked else f"{fam.name} has no {asked} kernels: PyTorch ops, by design")
            gpu = ""
            if runs == "triton" and dispatch.on_cuda(x):
                gpu = ("passed on a GPU: " + dispatch.GPU_VERIFIED[fam.name] if fam.name in dispatch.GPU_VERIFIED
                       else "never run on a GPU (only in Triton's CPU interpreter): run benchmarks/gpu_check.sh")
            out.append({"family": fam.name, "device": dev.type, "runs": runs, "why": why,
                        "what": WHAT.get((fam.name, runs), runs), "gpu": gpu})
    return out


def cpu_extensions() -> str:
    """The CPU's vector extensions that sonata's numba kernels can use (from /proc/cpuinfo;
    'unknown' elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return "unknown"
    keep = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return " ".join(keep) or "none of avx2, avx512, amx"


def report() -> list[str]:
    """The lines `python -m sonata doctor` prints."""
    from sonata import versions

    v = versions()
    lines = [f"sonata {v['sonata']}, torch {v['torch']} ({v['threads']} threads), numba {v['numba']}, "
             f"triton {v['triton']}, python {v['python']}",
             f"cpu: {v['cpu']}, vector extensions: {cpu_extensions()}",
             f"cuda: {v['device'] if torch.cuda.is_available() else 'none'}; Triton's interpreter "
             f"{'on' if dispatch.triton_interpreter_on() else 'off'} (TRITON_INTERPRET)"]
    for r in rows():
        line = f"{r['family']} on {r['device']}: {r['runs']} ({r['why']}): {r['what']}"
        lines.append(line + (f"; {r['gpu']}" if r["gpu"] else ""))
    return lines
