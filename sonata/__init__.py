"""sonata: a tiny Mamba language model on TinyStories, with its own selective-scan
kernels and benchmarks that carry their own proof of validity.

Modules: config (dataclasses), data (corpus, tokenizer, vocabulary, token cache, batches),
kernels (selective scan backends), autograd (kernel <-> autograd glue), model
(MambaLM), trainer (the loop), checkpoint (atomic save, safe load), progress,
plots, and the command line in __main__.
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
