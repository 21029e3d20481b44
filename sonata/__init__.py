"""sonata: a tiny Mamba language model on TinyStories, with its own selective-scan
kernels and benchmarks that carry their own proof of validity.

Packages by job, from the bottom layer up (tests/test_layering.py keeps the imports one way):
core (config, errors, device, rng, progress, inject, checkpoint); kernels (the Mamba-1 scan and
the Mamba-2 SSD, each fast path beside its reference); data (vocabulary, sources, token cache,
batches, tasks) and model (the LM, one file per block family, decode, quant); train (the loop and
what it asks) and interop (transformers, mamba_ssm's ops); lab (the notebooks' studies); and the
entry points __main__ and launch.
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
