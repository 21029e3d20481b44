"""Imports run one way: every sonata module's imports (inside functions too), read
with `ast`, form no cycle and never climb from a lower layer to a higher one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "sonata"

# The packages by job, lowest first: a module may import from a lower package, or from its
# own package at its own layer or below; packages on one line never import each other (data
# and model; train and interop). Inside each package its modules' layers, lowest first.
PACKAGES = [
    ["core"],
    ["kernels"],
    ["data", "model"],
    ["train", "interop"],
    ["lab"],
    ["entry"],                          # __main__ and launch: sonata/'s only top-level modules
]
INSIDE = {
    "core": [{"errors", "inject", "rng", "jsonsafe"}, {"config", "device", "progress", "checkpoint"}],
    # dispatch (the backend policy) at the bottom; one folder per family (selective, layers,
    # ssd), each family's __init__ (its entry points) above its files; the re-exports, then
    # the SSD (its packed form calls the re-exported gated norm)
    "kernels": [{"dispatch", "numba_cache", "cpu_arrays", "selective.autograd"},
                {"cpu_simd", "selective.reference", "layers.reference", "ssd.reference", "gdn.reference",
                 "mamba3.reference"},
                {"selective.cpu_kernels", "selective.decode_cpu", "selective.triton", "layers.cpu_conv",
                 "layers.cpu_norm", "layers.cpu_loss", "ssd.triton_fwd", "ssd.cpu_fused", "ssd.step",
                 "ssd.cpu_steps", "ssd.cpu_recurrent", "gdn.cpu", "mamba3.chunked", "mamba3.cpu_step"},
                {"selective.cpu", "layers.cpu", "ssd.cpu", "ssd.triton_bwd"}, {"layers.ops", "selective.ops", "gdn.ops"},
                {"ssd.triton", "selective", "layers"}, {"__init__"}, {"ssd", "gdn"}, {"mamba3.ssd_form"}, {"mamba3"}, {"doctor"}],
    "data": [{"vocab"}, {"sources"}, {"token_cache"}, {"batches", "tasks"}],
    "model": [{"quant", "norm", "gpt2"}, {"block"}, {"mamba", "mamba2", "mamba3", "attention", "gdn"}, {"families"},
              {"decode"}, {"lm"}],
    "train": [{"memory", "leak", "plan", "schedule", "tensorboard_log", "record"},
              {"autotune", "distributed", "evaluate", "summary", "update", "stops"}, {"trainer"}],
    "interop": [{"mamba3_module", "shim"}, {"hf", "hf_hybrid", "mamba2_ops", "mamba_ssm", "gdn_ops"}, {"hf_accelerate"}],
    "lab": [{"plots", "peers"}, {"timing", "generate"},
            {"bench", "throughput", "race", "dynamics", "selection", "ssd"}, {"speed", "recall"}, {"table5b"}, {"notebook"}],
    "entry": [{"launch"}, {"__main__"}],
}
ENTRY_POINTS = {"__main__", "launch"}
PACKAGE_LAYER = {p: i for i, line in enumerate(PACKAGES) for p in line}


def package_of(mod: str) -> str:
    return "entry" if mod in ENTRY_POINTS else mod.split(".")[0]


def inner_of(mod: str) -> str:
    if mod in ENTRY_POINTS:
        return mod
    return mod.partition(".")[2] or "__init__"


def layer_of(mod: str) -> tuple[int, int] | None:
    """(package layer, layer inside the package), or None for a module with no layer. A
    package's __init__ (its re-exports) stands above its modules, except where INSIDE places it
    (the kernels' dispatcher)."""
    pkg, inner = package_of(mod), inner_of(mod)
    if pkg not in INSIDE:
        return None
    for i, layer in enumerate(INSIDE[pkg]):
        if inner in layer:
            return PACKAGE_LAYER[pkg], i
    if inner == "__init__":
        return PACKAGE_LAYER[pkg], len(INSIDE[pkg])
    return None


LAYER = {}                              # filled from the modules that exist


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
    graph = import_graph()
    assert "train.trainer" in graph["lab.bench"]
    assert "kernels" in graph["model.mamba"] and "kernels.selective.autograd" in graph["kernels.selective"]
    assert "kernels" in graph["kernels.ssd"]                 # ssd_packed's function-level import


def test_sonata_top_level_holds_only_the_entry_points():
    top = sorted(p.stem for p in PKG.glob("*.py"))
    assert top == ["__init__", "__main__", "launch"], top
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()) == \
        sorted(INSIDE.keys() - {"entry"})


def test_every_module_has_a_layer():
    missing = sorted(m for m in sonata_modules() if m != "__init__" and layer_of(m) is None)
    assert not missing, "modules with no layer: " + ", ".join(f"sonata.{m}" for m in missing)
    named = {m if p == "entry" else f"{p}.{m}" if m != "__init__" else p
             for p, layers in INSIDE.items() for layer in layers for m in layer}
    stale = sorted(n for n in named if n not in sonata_modules())
    assert not stale, "INSIDE names modules that do not exist: " + ", ".join(stale)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(f"sonata.{m}" for m in cycle)


def upward_imports(graph) -> list[str]:
    bad = []
    for a, deps in sorted(graph.items()):
        la = layer_of(a)
        for b in sorted(deps):
            lb = layer_of(b)
            if la is None or lb is None or b == "__init__":
                continue
            same_pkg = package_of(a) == package_of(b)
            if (same_pkg and lb[1] > la[1]) or (not same_pkg and lb[0] >= la[0]):
                bad.append(f"sonata.{a} {la} imports sonata.{b} {lb}")
    return bad


def test_the_layer_check_names_an_upward_import():
    assert upward_imports({"core.config": {"train.trainer"}})
    assert upward_imports({"data.vocab": {"model.lm"}})                   # siblings: no
    assert upward_imports({"train.plan": {"train.trainer"}})              # inside: upward
    assert not upward_imports({"train.trainer": {"train.plan", "core.config", "model.lm"}})


def test_imports_run_one_way():
    upward = upward_imports(import_graph())
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("module", ["train.trainer", "train.memory", "train.distributed", "train.autotune"])
def test_the_training_side_does_not_import_the_lab(module):
    assert not {m for m in import_graph()[module] if m.startswith("lab.")}


def private_imports() -> list[str]:
    """'module imports name from sonata.x' for every name starting with `_` (dunders excepted)
    that a sonata module imports from a sonata module, anywhere in its body."""
    bad = []
    for name, path in sonata_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = node.module or ""
            if not (node.level or source == "sonata" or source.startswith("sonata.")):
                continue
            for a in node.names:
                if a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__")):
                    bad.append(f"sonata.{name} imports {a.name} from {'.' * node.level}{source}")
    return bad


def test_no_private_name_is_imported_across_modules():
    """A name another module needs is public (no underscore, a docstring line): a module's
    `_names` are its own to change."""
    bad = private_imports()
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)
