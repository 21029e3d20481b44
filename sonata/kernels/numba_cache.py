"""sonata/kernels/numba_cache.py: numba's on-disk cache for sonata's kernels, keyed by all of
their sources (shared numba infrastructure, at the top of sonata/kernels).

numba keys a cached kernel by the hash of the one file that defines it. A kernel's compiled
code also holds the helpers it calls from other files (`selective/decode_cpu.step` embeds
`cpu_simd.fast_exp_f32`, the compile flags and lane width come from `cpu_simd.py`, the SSD
recurrence's kernels embed `ssd/cpu_steps.py`'s vector steps): edit such a helper and a warm
cache keeps running the old one. `install()` puts a locator in front of numba's own for the
files of this folder and its subfolders only: it caches where numba would (NUMBA_CACHE_DIR, else
`__pycache__` beside the source) but stamps every kernel with the hash of every `.py` file
there, so a change to any of them recompiles all of them on next use. Other numba code in
the process keeps numba's locators. (NUMBA_CACHE_LOCATOR_CLASSES, when set, replaces the
locator list and this with it.)
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os

from numba.core import caching

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))
_IMPL = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")   # numba >= 0.61 / older


@functools.lru_cache(maxsize=None)
def _hash(stats: tuple) -> bytes:
    h = hashlib.sha256()
    for path, _, _ in stats:
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, KERNEL_DIR).encode() + b"\0" + f.read() + b"\0")
    return h.digest()


def sources_stamp() -> bytes:
    """sha256 over the .py files of this folder and its subfolders (relative name and content,
    in name order); recomputed when a file's mtime or size changes."""
    paths = sorted(glob.glob(os.path.join(KERNEL_DIR, "**", "*.py"), recursive=True))
    return _hash(tuple((p, os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths))


class KernelSourcesLocator(caching._CacheLocator):
    """numba's own locator for the place, this folder's sources for the stamp."""

    def __init__(self, inner):
        self._inner = inner

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return sources_stamp()

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.abspath(py_file).startswith(KERNEL_DIR + os.sep):
            return None
        for other in _IMPL._locator_classes:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
        return None


def install() -> None:
    """Put KernelSourcesLocator first (once). Call before the kernels' @njit(cache=True) run:
    numba picks a function's locator when it is decorated."""
    classes = _IMPL._locator_classes
    if KernelSourcesLocator not in classes:
        classes.insert(0, KernelSourcesLocator)
