"""The fused CPU kernels' shared numba pieces (sonata/kernels/cpu_simd.py): the polynomial exp and
softplus against float64, and the serial twins that keep numba's thread pool asleep at one thread.
"""
from __future__ import annotations

import os
import subprocess
import sys

from sonata.kernels import cpu_simd  # noqa: E402   numba is a dependency: a broken one fails here, not skips


# ----------------------------------------------------------------------------- exp, softplus

def test_polynomial_exp_and_softplus_against_float64():
    """The kernels' vectorizable float32 exp and softplus (sonata/kernels/cpu_simd.py) against numpy's
    float64 versions, compiled with the kernels' flags: exp within 1.01 ulp wherever the result
    is a normal float32 above its flush threshold (exp(-86.9)), 0 below it, inf where float32
    overflows, NaN for NaN; softplus within 3 ulp (or 2e-38 where the exp flushes), and x itself
    above 20 (torch's threshold)."""
    import numba
    import numpy as np

    @numba.njit(**cpu_simd.VEC_FLAGS)        # the kernels' flags: what runs inside them
    def apply(x, out_exp, out_sp):
        for i in range(x.size):
            out_exp[i] = cpu_simd.fast_exp_f32(x[i])
            out_sp[i] = cpu_simd.fast_softplus_f32(x[i])

    edges = [-np.inf, np.inf, -88.0, -87.0, -86.9, -86.89, 0.0, -0.0, 1e-30, 20.0, 20.001,
             88.72, 88.7228, 88.73, 89.0, 1e30, -1e30]
    x = np.concatenate([np.linspace(-100, 100, 400_001, dtype=np.float32), np.float32(edges),
                        np.float32([np.nan])])
    got_exp, got_sp = np.empty_like(x), np.empty_like(x)
    apply(x, got_exp, got_sp)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = np.exp(x64)
        normal = (x >= np.float32(-86.9)) & (ref < np.finfo(np.float32).max)
        ulp = np.spacing(ref[normal].astype(np.float32)).astype(np.float64)
    assert (np.abs(got_exp[normal] - ref[normal]) / ulp).max() <= 1.01      # 1.0022 measured
    assert np.all(got_exp[x < np.float32(-86.9)] == 0)
    assert np.all(np.isposinf(got_exp[~np.isnan(x) & (ref >= np.finfo(np.float32).max)]))
    assert np.isnan(got_exp[-1]) and np.isnan(got_sp[-1])
    finite = np.isfinite(x64)
    sp_ref = np.where(x64 > 20, x64, np.logaddexp(0.0, np.where(finite, x64, 0.0)))[finite]
    sp_ulp = np.spacing(sp_ref.astype(np.float32)).astype(np.float64)
    # 3 ulp, or the exp's flush (softplus(x) = exp(x) to float32 precision far below 0)
    assert np.all(np.abs(got_sp[finite] - sp_ref) <= 3 * sp_ulp + 2e-38)
    assert np.all(got_sp[x > 20] == x[x > 20])


ONE_THREAD_STEP = """
import torch, numba.np.ufunc.parallel as pool
torch.set_num_threads(1)
from sonata.core.config import make_config
from sonata.model.lm import build_model
for arch in ("mamba2", "mamba"):
    model = build_model(make_config({"model.arch": arch, "model.vocab_size": 50, "model.d_model": 32,
                                     "model.headdim": 16, "model.d_state": 16, "model.n_layers": 1}))
    ids = torch.randint(0, 50, (2, 40))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
from sonata.kernels.layers import cpu
cpu.cross_entropy_backward(torch.tensor(1.0), cpu.cross_entropy_forward(torch.randn(6, 50), torch.arange(6))[1],
                           torch.float32)
print("pool", pool._is_initialized)
"""


def test_one_thread_never_starts_numba_pool():
    """At one torch thread the kernels run their serial twins and never start numba's thread
    pool: a parallel call (even numba.set_num_threads alone) starts it at NUMBA_NUM_THREADS
    threads, whose idle workers then wait actively beside the work (a Mamba-2 step at one thread
    on a busy 2-core host measured 248 ms with the pool against 9.4 ms without)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", ONE_THREAD_STEP], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "pool False", r.stdout
