"""The peers the benchmarks compare against (sonata.lab.peers)."""
import subprocess
import sys

import pytest

SCRIPT = """
from sonata.interop import mamba_ssm as ops
ops.install()
from sonata.lab.peers import import_mambapy, mambapy_lm
import_mambapy()
from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
assert selective_scan_fn is ops.selective_scan_fn          # the shim still serves its ops
m = mambapy_lm(16, 1, 4, 64)
print("ok", sum(p.numel() for p in m.parameters()) > 0)
"""


def test_mambapy_imports_after_the_mamba_ssm_shim_in_the_same_process():
    """Issue 42 item 17: after `install()` the shim was taken for the real package, and
    mambapy's import of mamba_ssm.ops.triton.ssd_combined failed (ModuleNotFoundError)."""
    pytest.importorskip("mambapy")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok True"
