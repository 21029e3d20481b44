"""numba's disk cache of sonata's kernels cannot go stale: it is keyed by every kernel source
(sonata.kernels.numba_cache), so editing a helper in one file reaches the cached kernels of
another. The check runs on a copy of the package in a temporary folder."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# One fused decoding step of a small model from zero states: only selective/decode_cpu.step runs
# (it embeds cpu_simd.fast_exp_f32, a helper of another file).
STEP = r"""
import sys
# the copy, not the checkout: an editable install's import hook would find the checkout first
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
sys.path[:0] = [{copy_root!r}, {tests!r}]
import torch
from models import _sonata
from sonata.model.decode import Decoder
import sonata.kernels.selective.decode_cpu as k
assert k.__file__.startswith({copy!r}), k.__file__
dec = Decoder(_sonata(seed=3), 2, fused=True)
logits = dec.step(torch.tensor([5, 7]))
print(repr(float(logits.double().abs().sum())))
"""


# The SSD recurrence's forward (its kernel, ssd/cpu_recurrent.py, embeds ssd/cpu_steps.py's
# vector steps: d_state 16 is a whole number of vectors on AVX2 and AVX-512).
SSD = r"""
import sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
sys.path[:0] = [{copy_root!r}, {tests!r}]
import torch
torch.set_num_threads(1)
import sonata.kernels.ssd.cpu_recurrent as k
assert k.__file__.startswith({copy!r}), k.__file__
g = torch.Generator().manual_seed(0)
x, dt = torch.randn(1, 20, 2, 4, generator=g), torch.rand(1, 20, 2, generator=g)
B, C = torch.randn(1, 20, 1, 16, generator=g), torch.randn(1, 20, 1, 16, generator=g)
y = k.ssd_cpu_recurrent(x, dt, -torch.ones(2), B, C)
print(repr(float(y.double().abs().sum())))
"""


def _step(copy: pathlib.Path, env: dict, template: str = STEP) -> str:
    script = template.format(tests=str(ROOT / "tests"), copy=str(copy), copy_root=str(copy.parent))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def test_an_edited_helper_of_another_file_reaches_a_cached_kernel(tmp_path):
    """A helper in the kernels' folder (cpu_simd.py), then one in its ssd/ subfolder."""
    copy = tmp_path / "pkg"
    shutil.copytree(ROOT / "sonata", copy / "sonata", ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    env = {**os.environ, "PYTHONPATH": str(copy), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    env.pop("SONATA_CPU_LANES", None)               # with it the kernels skip the disk cache
    first = _step(copy / "sonata", env)
    assert list((tmp_path / "numba").rglob("decode_cpu.step-*.nbi")), "the step kernel was not cached"
    assert _step(copy / "sonata", env) == first      # warm cache, same sources: the same figures
    # edit a helper in cpu_simd.py that decode_cpu.step embeds: exp's last polynomial coefficient
    cpu = copy / "sonata" / "kernels" / "cpu_simd.py"
    text = cpu.read_text()
    assert text.count("_F(5.0000001201e-1)") == 1
    cpu.write_text(text.replace("_F(5.0000001201e-1)", "_F(4.0e-1)"))
    edited = _step(copy / "sonata", env)
    assert edited != first, "the cached step kept the old exp"
    # and in a subfolder: ssd/cpu_steps.py's forward step, which ssd/cpu_recurrent.py's kernel embeds
    ssd_first = _step(copy / "sonata", env, SSD)
    assert list((tmp_path / "numba").rglob("cpu_recurrent._forward*.nbi")), "the SSD kernel was not cached"
    assert _step(copy / "sonata", env, SSD) == ssd_first
    steps = copy / "sonata" / "kernels" / "ssd" / "cpu_steps.py"
    text = steps.read_text()
    old = "s = V.fma(av, V.load(S_, off), builder.fmul(xb, bv))"
    assert text.count(old) == 1
    steps.write_text(text.replace(old, "s = V.fma(av, V.load(S_, off), builder.fmul(xb, builder.fmul(bv, bv)))"))
    assert _step(copy / "sonata", env, SSD) != ssd_first, "the cached SSD kernel kept the old step"
