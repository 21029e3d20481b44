"""sonata/interop/shim.py: how sonata's op modules stand in for packages that are not installed
(mamba_ssm and causal_conv1d for `sonata.interop.mamba_ssm.install()`, fla for
`sonata.interop.gdn_ops.install()`), in one place.

`installed(top)` says whether a real package can be imported (a shim of ours does not count);
`register(name, attrs, source, what)` creates the module `name` (and its parents, as packages
whose submodules resolve from sys.modules) marked `__sonata_shim__`, and sets each of `attrs`
from `source`; `serve_cpu_in_transformers(tops)` adds "cpu" (and "cuda") to transformers' table
of the devices each package's ops serve (`_PACKAGE_SUPPORTED_DEVICES`, transformers 5.25 and
later), which its model modules read once, when imported. A transformers without the table, or
none, is left alone.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types


def installed(top: str) -> bool:
    """Whether a real package `top` can be imported (a shim of ours does not count)."""
    mod = sys.modules.get(top)
    if mod is not None:
        return not getattr(mod, "__sonata_shim__", False)
    return importlib.machinery.PathFinder.find_spec(top) is not None


def register(name: str, attrs, source, what: str) -> None:
    """Module `name` (and its parents) in sys.modules, holding `source`'s `attrs`; `what` goes
    into the docstring ("sonata.interop.gdn_ops shim for fla.modules (...)")."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sys.modules.get(sub) is None:
            mod = types.ModuleType(sub, f"{what} shim for {sub} (sonata's CPU ops; the real package is not installed)")
            mod.__sonata_shim__ = True
            mod.__path__ = []                # a package: its submodules resolve from sys.modules
            mod.__spec__ = importlib.machinery.ModuleSpec(sub, None, is_package=True)
            sys.modules[sub] = mod
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], mod)
    for attr in attrs:
        setattr(sys.modules[name], attr, getattr(source, attr))


def serve_cpu_in_transformers(tops: set[str]) -> None:
    """Mark the packages in `tops` as serving CPU (and CUDA) tensors in transformers' table."""
    if not tops or importlib.util.find_spec("transformers") is None:
        return
    try:
        from transformers.integrations import hub_kernels
    except Exception:            # a transformers too old for the integration: nothing to mark
        return
    table = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if isinstance(table, dict):
        for top in tops & set(table):
            table[top] = tuple(dict.fromkeys((*table[top], "cpu", "cuda")))


__all__ = ["installed", "register", "serve_cpu_in_transformers"]
