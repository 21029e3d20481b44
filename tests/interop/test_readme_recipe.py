"""README's interop recipe runs as printed: the Granite-4.0-H-shaped hybrid (GraniteMoeHybrid,
random weights saved locally, nothing downloaded) through `sonata.interop.mamba_ssm.install()`.
Its `accelerate` line must print the same ids. The snippet runs in a fresh process (install() must come before transformers imports the
model's module) in a temporary folder; mamba_ssm is not installed here, so transformers warns
for each op it runs on its own PyTorch path. The shim's run must have no such warning, and the
same snippet without its install() line must have them (so the check can fail)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"
FALLBACK = "is falling back to its reference PyTorch implementation"
INSTALL = "mamba_ssm.install()"


def recipe() -> str:
    """The README's python block that builds the GraniteMoeHybrid model."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    found = [b for b in blocks if "GraniteMoeHybridConfig" in b]
    assert len(found) == 1, f"README has {len(found)} python blocks with GraniteMoeHybridConfig (expected 1)"
    return found[0]


def _printed(stdout: str) -> dict:
    """{label: [ids]} of the recipe's printed lines ("generated [[...]]", "accelerated [[...]]")."""
    return {ln.split(" ", 1)[0]: [int(v) for v in re.findall(r"\d+", ln.split(" ", 1)[1])]
            for ln in stdout.splitlines() if ln.startswith(("generated ", "accelerated "))}


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=env)


def test_readme_granite_recipe_runs_on_sonatas_ops_and_without_install_on_transformers_path(tmp_path):
    code = recipe()
    assert code.count(INSTALL) == 1
    (tmp_path / "shim").mkdir()
    (tmp_path / "plain").mkdir()
    shim = _run(code, tmp_path / "shim")
    assert shim.returncode == 0, shim.stderr[-4000:]
    assert FALLBACK not in shim.stderr, shim.stderr[-4000:]
    ids = _printed(shim.stdout)
    assert len(ids["generated"]) == 16 + 8, shim.stdout      # the prompt and 8 new tokens, printed
    assert ids["accelerated"] == ids["generated"], shim.stdout   # accelerate's loop: the same ids
    assert (tmp_path / "shim" / "granite-4.0-h-tiny" / "config.json").exists()

    plain = _run(code.replace(INSTALL, "pass"), tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-4000:]
    for op in ("mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_update"):
        assert re.search(rf"`{op}` {FALLBACK}", plain.stderr), (op, plain.stderr[-4000:])
    assert _printed(plain.stdout) == ids                     # same greedy ids
