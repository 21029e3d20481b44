"""mamba_ssm's Mamba3 module on sonata's kernels (sonata.interop.mamba3_module): built from
mamba_ssm's arguments with its parameter names and shapes, SISO and MIMO; its outputs are the
token-by-token float64 oracle's; its inference cache (prompt, then one step per token through
forward(inference_params=) and step()) continues the full forward; bad arguments are one
ValueError each; `from mamba_ssm.modules.mamba3 import Mamba3` resolves after install()."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sonata.interop.mamba3_module import Mamba3

MAMBA_SSM_NAMES = {"in_proj.weight", "dt_bias", "B_bias", "C_bias", "B_norm.weight", "C_norm.weight", "D",
                   "out_proj.weight"}


def build(seed=0, **kw):
    torch.manual_seed(seed)
    m = Mamba3(d_model=32, d_state=16, headdim=16, chunk_size=16, layer_idx=0, dtype=torch.float64, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name != "in_proj.weight" and name != "out_proj.weight":
                p.add_(0.2 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("kw", [{}, dict(is_mimo=True, mimo_rank=4), dict(is_mimo=True, mimo_rank=2,
                                is_outproj_norm=True, rope_fraction=1.0), dict(is_outproj_norm=True, ngroups=2)])
def test_mamba_ssm_arguments_build_its_parameters_and_the_oracle_s_outputs(kw):
    m = build(**kw)
    names = {n for n, _ in m.named_parameters()}
    extra = {"mimo_x", "mimo_z", "mimo_o"} if kw.get("is_mimo") else set()
    extra |= {"norm.weight"} if kw.get("is_outproj_norm") else set()
    assert names == MAMBA_SSM_NAMES | extra
    R = kw.get("mimo_rank", 4) if kw.get("is_mimo") else 1
    assert m.B_bias.shape == (4, R, 16) and m.nheads == 4 and m.num_rope_angles == (8 if kw.get("rope_fraction") else 4)
    u = torch.randn(2, 37, 32, dtype=torch.float64)
    out = m(u)
    m.cfg.backend = "reference"                                      # the token-by-token scan
    assert torch.allclose(out, m(u), atol=1e-10)


@pytest.mark.parametrize("kw", [{}, dict(is_mimo=True, mimo_rank=2)])
def test_the_inference_cache_continues_the_forward(kw):
    m = build(1, **kw)
    u = torch.randn(3, 20, 32, dtype=torch.float64)
    whole = m(u)
    params = SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    first = m(u[:, :12], inference_params=params)
    assert torch.allclose(first, whole[:, :12], atol=1e-10)
    angle, ssm, k, v = params.key_value_memory_dict[0]
    assert angle.dtype == ssm.dtype == torch.float32 and k.shape == (3, m.mimo_rank, 4, 16) and v.shape == (3, 4, 16)
    assert float(angle.min()) >= 0 and float(angle.max()) < 2 * torch.pi
    outs = []
    for t in range(12, 20):
        params.seqlen_offset = t
        outs.append(m(u[:, t:t + 1], inference_params=params))
    # the cached angle and state are float32, as in mamba_ssm: float32's tolerance
    assert torch.allclose(torch.cat(outs, 1), whole[:, 12:], atol=1e-5)
    cache = m.allocate_inference_cache(3, 20)
    for t in range(20):
        y, *_ = m.step(u[:, t], *cache)
    assert torch.allclose(y, whole[:, -1], atol=1e-5)


def test_arguments_mamba_ssm_refuses_or_sonata_lacks_are_one_error_each():
    for kw, msg in ((dict(rope_fraction=0.3), "rope_fraction must be 0.5 or 1.0"),
                    (dict(headdim=24), "headdim 24 must divide d_inner"),
                    (dict(ngroups=3), "ngroups 3 must divide the 4 heads"),
                    (dict(is_mimo=True, mimo_rank=0), "mimo_rank must be at least 1")):
        with pytest.raises(ValueError, match=msg):
            Mamba3(**{"d_model": 32, "d_state": 16, "headdim": 16, **kw})
    m = build()
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.randn(1, 4, 32, dtype=torch.float64), cu_seqlens=torch.tensor([0, 2, 4]))


def test_the_import_path_resolves_after_install(tmp_path):
    code = ("import sonata.interop.mamba_ssm as s; s.install(); from mamba_ssm.modules.mamba3 import Mamba3; "
            "import torch; m = Mamba3(d_model=32, d_state=16, headdim=16, is_mimo=True, mimo_rank=2); "
            "print(m(torch.randn(1, 5, 32)).shape, Mamba3 is s.Mamba3)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "torch.Size([1, 5, 32]) True"
