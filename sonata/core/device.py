"""Device, precision and synchronization: which device a run uses, whether a
precision mode can run there (and whether this CPU multiplies bf16 natively), the
autocast context for it, and `sync` (wait for the device, so a clock read after it
measures work done, not work queued)."""
from __future__ import annotations

import contextlib
import functools

import torch

from sonata.core.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available")
    return torch.device(name)


def sync(device) -> None:
    """Wait until the device has finished its queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@functools.lru_cache(maxsize=None)
def cpu_bf16_native(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 matrix instructions (x86 AVX-512 BF16 or AMX-BF16, from the
    kernel's CPU flags): there bf16 autocast makes the matrix multiplies of a small model
    faster; elsewhere PyTorch emulates bf16 and it is slower than fp32. False where the
    flags cannot be read (not Linux)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast_for(precision: str, device: torch.device):
    if precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_precision(precision: str, device: torch.device) -> None:
    """A clear error where a mode cannot run, never a silent switch."""
    if precision in ("fp16", "bf16"):
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"train.precision=bf16 cannot run on {torch.cuda.get_device_name(device)}")
        try:
            with torch.autocast(device.type, dtype=dtype):
                torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
        except (RuntimeError, AssertionError) as e:
            raise ConfigError(f"train.precision={precision} cannot run on {device.type}: "
                              f"{str(e).splitlines()[0]}") from None
