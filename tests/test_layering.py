"""Imports run one way: every sonata module's imports (inside functions too), read
with `ast`, form no cycle and never climb from a lower layer to a higher one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "sonata"

# config/errors -> vocab -> sources -> token_cache -> data, kernels -> model -> memory,
# hf, autotune, distributed, evaluate -> trainer -> bench, selection -> __main__ (and the
# notebooks). A module may import from its own layer or below; every module has a layer.
LAYERS = [
    {"errors", "config", "device", "rng", "progress", "plots", "peers", "inject"},
    {"vocab"},
    {"sources"},
    {"token_cache"},
    {"data", "tasks", "quant", "decode", "kernels", "kernels.reference", "kernels.cpu",
     "kernels.triton", "kernels.autograd", "kernels.decode_cpu", "kernels.numba_cache",
     "kernels.cpu_simd", "kernels.cpu_scan", "kernels.cpu_conv", "kernels.cpu_norm", "kernels.cpu_loss"},
    {"model", "ops"},
    {"memory", "leak", "plan", "schedule", "checkpoint", "tensorboard_log", "hf", "hf_accelerate"},
    {"autotune", "distributed", "evaluate", "summary", "update", "stops"},
    {"trainer", "generate"},
    {"bench", "timing", "studies", "dynamics", "selection", "notebook"},
    {"__main__", "launch"},
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def sonata_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The sonata modules `path` imports anywhere in its body (function level too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:              # relative: from . import x / from .x import y
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [f"sonata.{mod}" if mod else "sonata"]
            else:
                targets = [node.module or ""]
            # `from sonata import kernels` / `from sonata.kernels import cpu`: submodules
            subs = [f"{targets[0]}.{a.name}" for a in node.names]
            inner = [t for t in subs if t[len("sonata."):] in known]
            targets = inner + (targets if len(inner) < len(subs) else [])
        for t in targets:
            if t == "sonata" or t.startswith("sonata."):
                mod = t[len("sonata."):] if t != "sonata" else "__init__"
                while mod and mod not in known:     # sonata.kernels.cpu.W -> kernels.cpu
                    mod = mod.rpartition(".")[0]
                if mod and mod != name:
                    found.add(mod)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = sonata_modules()
    return {name: imports_of(path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_names_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"y2"}, "y2": {"y"}}) == ["y", "y2", "y"]


def test_function_level_imports_are_read():
    src = PKG / "bench.py"
    graph = import_graph()
    assert "trainer" in graph["bench"] and src.exists()
    assert "kernels" in graph["model"] and "kernels.autograd" in graph["kernels"]


def test_every_module_has_a_layer():
    missing = sorted(set(sonata_modules()) - set(LAYER) - {"__init__"})
    assert not missing, "modules with no layer in LAYERS: " + ", ".join(f"sonata.{m}" for m in missing)
    stale = sorted(set(LAYER) - set(sonata_modules()))
    assert not stale, "LAYERS names modules that do not exist: " + ", ".join(stale)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(f"sonata.{m}" for m in cycle)


def test_imports_run_one_way():
    upward = [f"sonata.{a} (layer {LAYER[a]}) imports sonata.{b} (layer {LAYER[b]})"
              for a, deps in sorted(import_graph().items()) for b in sorted(deps)
              if a in LAYER and b in LAYER and LAYER[b] > LAYER[a]]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("module", ["trainer", "memory", "distributed", "autotune"])
def test_the_training_side_does_not_import_benchmark_timing(module):
    assert "timing" not in import_graph()[module]
    assert "bench" not in import_graph()[module]
