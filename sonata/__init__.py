"""sonata: a tiny Mamba language model on TinyStories, with its own selective-scan
kernels and benchmarks that carry their own proof of validity.

Modules, from the bottom layer up (tests/test_layering.py keeps the imports one way):
- errors (one-line user errors), config (every setting), device, rng, progress, plots, peers
  (the benchmarks' comparison models), inject (the tests' fault switches);
- vocab (o200k and the compact vocabulary), sources (where stories come from), token_cache,
  data (text to batches), tasks (the Mamba paper's synthetic tasks);
- kernels (the selective scan: reference, cpu (numba), triton; decode_cpu, the fused
  generation step; numba_cache; autograd, the kernel <-> autograd glue), quant (int8),
  decode (the Decoder);
- model (MambaLM: mamba, lti, attention blocks), ops (mamba_ssm's op surface on the kernels);
- memory (accounting, the guard), leak (the leak detector), plan (what a run trains with),
  schedule (the run's length), checkpoint, tensorboard_log,
  hf (transformers export and import), hf_accelerate (transformers' Mamba on sonata's kernels);
- autotune (the micro-batch), distributed (process groups), evaluate (loss and bits per byte),
  update (one optimizer update), stops (early stops), summary (summary.json);
- trainer (the loop), generate;
- bench (benchmarks with their proof), timing (the scan backends timed side by side), studies, dynamics, selection (the notebooks' studies),
  notebook (parameter ranges);
- __main__, the command line, and launch (its --nproc workers).
"""
from __future__ import annotations

__version__ = "0.1.0"


def versions() -> dict:
    """Where numbers come from: python, libraries, device and threads."""
    import platform

    import torch

    info = {"python": platform.python_version(), "sonata": __version__, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}
    for name in ("numba", "triton", "tiktoken"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "not installed"
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return info
