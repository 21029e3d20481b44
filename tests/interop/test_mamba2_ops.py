"""sonata.interop.mamba2_ops, mamba_ssm's Mamba-2 op surface on sonata's kernels: each op against its
reference in float64 (values, final states and every gradient) on odd sizes, packed
sequences (seq_idx, cu_seqlens) against the sequences apart, decoding steps against the
whole scan, the references against plain loops, and the import shim's Mamba-2 paths."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import sonata.kernels.ssd.cpu as ssd_cpu_mod
import sonata.kernels.ssd.step as ssd_step_mod
from sonata.interop import mamba2_ops as m2
from sonata.interop import mamba_ssm as ops

F64 = torch.float64


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Preallocated kernel outputs start as NaN: an element a kernel does not write fails."""
    monkeypatch.setattr(ssd_cpu_mod, "POISON", True)
    monkeypatch.setattr(ssd_step_mod, "POISON", True)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _scan_inputs(seed, b=2, L=37, h=6, p=5, g=3, n=7, dtype=F64, D2=False):
    g_ = _gen(seed)

    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g_, dtype=F64)).to(dtype)
    return dict(x=r(b, L, h, p), dt=r(b, L, h, scale=0.7), A=(-torch.rand(h, generator=g_, dtype=F64) - 0.2).to(dtype),
                B=r(b, L, g, n), C=r(b, L, g, n), D=r(h, p) if D2 else r(h), z=r(b, L, h, p),
                dt_bias=r(h, scale=0.5), initial_states=r(b, h, p, n))


def _grads(fn, t, out_seed=9, **kw):
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in t.items()}
    out, final = fn(**leaves, return_final_states=True, **kw)
    g = _gen(out_seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum() + \
        (final * torch.randn(final.shape, generator=g, dtype=final.dtype)).sum()
    names = [k for k, v in leaves.items() if v.requires_grad]
    return out, final, dict(zip(names, torch.autograd.grad(loss, [leaves[k] for k in names])))


def _close(a, b, tol, msg=""):
    assert not torch.isnan(a).any(), msg
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=msg)


@pytest.mark.parametrize("L,chunk,D2,limit", [(37, 16, False, (0.0, math.inf)), (1, 64, True, (0.0, math.inf)),
                                               (130, 32, False, (0.05, 2.0))])
def test_chunk_scan_combined_matches_its_reference(L, chunk, D2, limit):
    """float64: out, final state and every gradient (x, dt, A, B, C, D, z, dt_bias, initial
    state), with seq_idx marking three packed sequences, softplus and dt_limit."""
    t = _scan_inputs(1, L=L, D2=D2)
    cuts = sorted({0, L // 3, (2 * L) // 3})
    t["seq_idx"] = torch.tensor([[sum(i >= c for c in cuts[1:]) for i in range(L)], [0] * L], dtype=torch.int32)
    got = _grads(m2.mamba_chunk_scan_combined, t, chunk_size=chunk, dt_softplus=True, dt_limit=limit)
    ref = _grads(m2.mamba_chunk_scan_combined_ref, t, chunk_size=chunk, dt_softplus=True, dt_limit=limit)
    _close(got[0], ref[0], 1e-10, "out")
    _close(got[1], ref[1], 1e-10, "final state")
    for k in ref[2]:
        _close(got[2][k], ref[2][k], 1e-9, f"d{k}")


def test_chunk_scan_reference_against_a_plain_loop():
    """The reference against the recurrence written out, one head and one position at a time."""
    t = _scan_inputs(2, b=1, L=9, h=4, p=2, g=2, n=3)
    out = m2.mamba_chunk_scan_combined_ref(**{k: v for k, v in t.items() if k != "initial_states"}, chunk_size=4,
                                           dt_softplus=True)
    x, dt, A, B, C, D, z, bias = (t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"))
    for hh in range(4):
        S = torch.zeros(2, 3, dtype=F64)
        grp = hh // 2
        for s in range(9):
            d = math.log1p(math.exp(float(dt[0, s, hh] + bias[hh])))
            S = math.exp(d * float(A[hh])) * S + d * torch.outer(x[0, s, hh], B[0, s, grp])
            y = (S @ C[0, s, grp] + D[hh] * x[0, s, hh]) * F.silu(z[0, s, hh])
            assert torch.allclose(out[0, s, hh], y, atol=1e-12)


def test_packed_row_equals_the_sequences_apart_and_cu_seqlens_gives_each_final_state():
    """One row of three packed sequences (seq_idx) gives each sequence's outputs as if alone
    (the initial state reaches only the first); return_varlen_states with cu_seqlens gives
    each sequence's own final state."""
    t = _scan_inputs(3, b=1, L=50)
    bounds = [0, 13, 31, 50]
    seq_idx = torch.tensor([[i for i in range(3) for _ in range(bounds[i + 1] - bounds[i])]], dtype=torch.int32)
    kw = dict(chunk_size=16, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)
    out, final, varlen = m2.mamba_chunk_scan_combined(
        t["x"], t["dt"], t["A"], t["B"], t["C"], z=t["z"], initial_states=t["initial_states"], seq_idx=seq_idx,
        cu_seqlens=torch.tensor(bounds), return_final_states=True, return_varlen_states=True, **kw)
    assert varlen.shape == (3, 6, 5, 7)
    for i, (s, e) in enumerate(zip(bounds, bounds[1:])):
        alone, last = m2.mamba_chunk_scan_combined(
            t["x"][:, s:e], t["dt"][:, s:e], t["A"], t["B"][:, s:e], t["C"][:, s:e], z=t["z"][:, s:e],
            initial_states=t["initial_states"] if i == 0 else None, return_final_states=True, **kw)
        _close(out[:, s:e], alone, 1e-10, f"sequence {i}")
        _close(varlen[i:i + 1], last, 1e-10, f"state {i}")
    _close(final, varlen[-1:], 1e-10, "the row's final state is the last sequence's")
    only_varlen = m2.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], seq_idx=seq_idx,
                                               cu_seqlens=torch.tensor(bounds), return_varlen_states=True, **kw)
    assert len(only_varlen) == 2 and only_varlen[1].shape == (3, 6, 5, 7)
    with pytest.raises(ValueError, match="batch must be 1"):
        m2.mamba_chunk_scan_combined(*(_scan_inputs(4)[k] for k in ("x", "dt", "A", "B", "C")), 16,
                                     cu_seqlens=torch.tensor([0, 37]), return_varlen_states=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_low_precision_out_in_x_dtype_final_state_in_C_dtype(dtype, tol):
    """mamba_ssm's contract: out in x's dtype, the final state in C's dtype (or state_dtype)."""
    t = _scan_inputs(5, dtype=dtype)
    out, final = m2.mamba_chunk_scan_combined(**t, chunk_size=16, dt_softplus=True, return_final_states=True)
    ref, ref_final = m2.mamba_chunk_scan_combined_ref(**{k: v.double() for k, v in t.items()}, chunk_size=16,
                                                      dt_softplus=True, return_final_states=True)
    assert out.dtype == dtype and final.dtype == dtype
    _close(out.double(), ref, tol * max(1.0, float(ref.abs().max())))
    _close(final.double(), ref_final, tol * max(1.0, float(ref_final.abs().max())))
    _, f32 = m2.mamba_chunk_scan_combined(**t, chunk_size=16, return_final_states=True, state_dtype=torch.float32)
    assert f32.dtype == torch.float32


# --------------------------------------------------------------------------- the whole mixer

def _mixer(seed, b=2, L=29, h=4, p=6, g=2, n=5, K=4, d_nonssm=0, out_dim=11):
    g_ = _gen(seed)

    def r(*s, scale=0.5):
        return scale * torch.randn(*s, generator=g_, dtype=F64)
    dim, conv_dim = h * p, h * p + 2 * g * n
    return dict(zxbcdt=r(b, L, 2 * d_nonssm + 2 * dim + 2 * g * n + h, scale=1.0), conv1d_weight=r(conv_dim, K),
                conv1d_bias=r(conv_dim), dt_bias=r(h), A=-torch.rand(h, generator=g_, dtype=F64) - 0.3, D=r(h),
                rmsnorm_weight=1 + r(dim), outproj_weight=r(out_dim, dim + d_nonssm), outproj_bias=r(out_dim),
                initial_states=r(b, h, p, n)), dict(headdim=p, ngroups=g)


@pytest.mark.parametrize("case", ["gated-norm", "norm-before-gate", "no-norm", "swiglu-part", "seq_idx"])
def test_split_conv1d_scan_combined_matches_its_reference(case):
    """conv + SSD + gated grouped RMSNorm + out_proj against the references' composition in
    float64: the output, the final state and the gradient of every input and weight."""
    t, kw = _mixer(6, d_nonssm=3 if case == "swiglu-part" else 0)
    kw["norm_before_gate"] = case == "norm-before-gate"
    if case == "no-norm":
        t.pop("rmsnorm_weight")
    if case == "seq_idx":
        t["seq_idx"] = torch.tensor([[0] * 10 + [1] * 19, [0] * 29], dtype=torch.int32)
        t.pop("initial_states")
    fns = (m2.mamba_split_conv1d_scan_combined, m2.mamba_split_conv1d_scan_ref)
    got, ref = (_grads(lambda **a: fn(chunk_size=8, dt_limit=(0.0, math.inf), **a, **kw), t) for fn in fns)
    _close(got[0], ref[0], 1e-10, "out")
    _close(got[1], ref[1], 1e-10, "final state")
    for k in ref[2]:
        _close(got[2][k], ref[2][k], 1e-9, f"d{k}")


def test_split_conv1d_equals_the_mixer_written_out():
    """The reference against the Mamba-2 mixer in plain torch ops, the way transformers writes
    its PyTorch path: split, conv1d + SiLU, the scan, norm(y * silu(z)) per group, out_proj."""
    t, kw = _mixer(7)
    t.pop("initial_states")
    out = m2.mamba_split_conv1d_scan_ref(**t, chunk_size=8, norm_before_gate=False, **kw)
    h, p, g, n = 4, 6, 2, 5
    z, xBC, dt = t["zxbcdt"].split([h * p, h * p + 2 * g * n, h], dim=-1)
    xBC = F.silu(F.conv1d(xBC.transpose(1, 2), t["conv1d_weight"][:, None], t["conv1d_bias"], padding=3,
                          groups=xBC.shape[-1])[..., :29]).transpose(1, 2)
    x, B, C = xBC.split([h * p, g * n, g * n], dim=-1)
    y = m2.mamba_chunk_scan_combined_ref(x.reshape(2, 29, h, p), dt, t["A"], B.reshape(2, 29, g, n),
                                         C.reshape(2, 29, g, n), 8, D=t["D"], dt_bias=t["dt_bias"],
                                         dt_softplus=True).reshape(2, 29, h * p)
    v = (y * F.silu(z)).reshape(2, 29, g, -1)
    v = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).reshape(2, 29, -1) * t["rmsnorm_weight"]
    _close(out, F.linear(v, t["outproj_weight"], t["outproj_bias"]), 1e-12)


def test_causal_conv_with_seq_idx_lets_no_tap_cross_a_boundary():
    g = _gen(8)
    x = torch.randn(2, 5, 20, generator=g, dtype=F64)
    w = torch.randn(5, 4, generator=g, dtype=F64)
    bias = torch.randn(5, generator=g, dtype=F64)
    seq_idx = torch.tensor([[0] * 7 + [1] * 2 + [2] * 11, [3] * 20], dtype=torch.int32)
    out = ops.causal_conv1d_fn(x, w, bias, seq_idx=seq_idx, activation="silu")
    for row, cuts in ((0, [0, 7, 9, 20]), (1, [0, 20])):
        apart = torch.cat([ops.causal_conv1d_fn(x[row:row + 1, :, s:e], w, bias, activation="silu")
                           for s, e in zip(cuts, cuts[1:])], dim=-1)
        _close(out[row:row + 1], apart, 1e-12)
    with pytest.raises(ValueError, match="seq_idx without initial_states"):
        ops.causal_conv1d_fn(x, w, bias, seq_idx=seq_idx, initial_states=torch.zeros(2, 5, 3, dtype=F64))


# --------------------------------------------------------------------------- one decoding step

def _step_inputs(seed, b=3, h=6, p=4, g=2, n=5, tied=True, dtype=torch.float32):
    g_ = _gen(seed)

    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g_, dtype=F64)).to(dtype)
    A_h = (-torch.rand(h, generator=g_, dtype=F64) - 0.2).to(dtype)
    dt_h, bias_h, D_h = r(b, h, scale=0.5), r(h, scale=0.5), r(h)
    if tied:                                  # transformers' call: stride-0 expansions of per-head numbers
        A = A_h[:, None, None].expand(h, p, n)
        dt, bias, D = dt_h[..., None].expand(b, h, p), bias_h[:, None].expand(h, p), D_h[:, None].expand(h, p)
    else:
        A = (-torch.rand(h, p, n, generator=g_, dtype=F64) - 0.2).to(dtype)
        dt, bias, D = r(b, h, p, scale=0.5), r(h, p, scale=0.5), r(h, p)
    return dict(state=r(b, h, p, n), x=r(b, h, p), dt=dt, A=A, B=r(b, g, n), C=r(b, g, n), D=D, z=r(b, h, p),
                dt_bias=bias)


@pytest.mark.parametrize("tied", [True, False], ids=["per-head", "per-element"])
def test_per_head_selective_state_update_matches_its_reference(tied):
    """Both through mamba_ssm's name (the form the issue found refused): the fused step for
    per-head A / dt (stride-0 or equal values), the reference for per-element ones; the state
    updated in place; state_batch_indices picks rows of a larger state."""
    t = _step_inputs(10, tied=tied)
    ref_state = t["state"].double().clone()
    ref = m2.selective_state_update_heads_ref(ref_state, *(t[k].double() for k in ("x", "dt", "A", "B", "C", "D")),
                                              z=t["z"].double(), dt_bias=t["dt_bias"].double(), dt_softplus=True)
    with torch.no_grad():
        out = ops.selective_state_update(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], z=t["z"],
                                         dt_bias=t["dt_bias"], dt_softplus=True)
    _close(out.double(), ref, 1e-5)
    _close(t["state"].double(), ref_state, 1e-5)
    big = torch.zeros(5, *t["state"].shape[1:])
    idx = torch.tensor([4, 0, 2])
    t2 = _step_inputs(10, tied=tied)
    out2 = ops.selective_state_update(big, t2["x"], t2["dt"], t2["A"], t2["B"], t2["C"], t2["D"], z=t2["z"],
                                      dt_bias=t2["dt_bias"], dt_softplus=True, state_batch_indices=idx)
    zero = m2.selective_state_update_heads_ref(torch.zeros_like(t2["state"]), t2["x"], t2["dt"], t2["A"], t2["B"],
                                               t2["C"], t2["D"], t2["z"], t2["dt_bias"], True)
    _close(out2, zero, 1e-6)
    assert torch.equal(big[1], torch.zeros_like(big[1])) and torch.equal(big[3], torch.zeros_like(big[3]))


def test_per_head_steps_equal_the_chunked_scan_and_take_the_fused_step(monkeypatch):
    """Token by token through selective_state_update (transformers' decoding call: stride-0
    A, dt, dt_bias and D, under no_grad with parameters that require grad) equals the scan's
    outputs and final state; every step is sonata's fused numba step."""
    t = _scan_inputs(11, b=2, L=20, dtype=torch.float32)
    A = torch.nn.Parameter(t["A"])
    D = torch.nn.Parameter(t["D"])
    bias = torch.nn.Parameter(t["dt_bias"])
    calls = []
    kernel = ssd_step_mod._step_kernel
    monkeypatch.setattr(ssd_step_mod, "_step_kernel", lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        whole, final = m2.mamba_chunk_scan_combined(t["x"], t["dt"], A, t["B"], t["C"], 8, D=D, z=t["z"],
                                                    dt_bias=bias, dt_softplus=True, return_final_states=True)
        h, p, n = 6, 5, 7
        state = torch.zeros(2, h, p, n)
        steps = [ops.selective_state_update(state, t["x"][:, s], t["dt"][:, s, :, None].expand(-1, -1, p),
                                            A[:, None, None].expand(h, p, n), t["B"][:, s], t["C"][:, s],
                                            D[:, None].expand(h, p), z=t["z"][:, s],
                                            dt_bias=bias[:, None].expand(h, p), dt_softplus=True)
                 for s in range(20)]
    _close(torch.stack(steps, 1), whole, 1e-5)
    _close(state, final, 1e-5)
    assert len(calls) == 20


def test_mamba1_form_still_served_and_bad_shapes_are_clear_errors():
    state = torch.zeros(2, 8, 4)
    out = ops.selective_state_update(state, torch.ones(2, 8), torch.ones(2, 8), -torch.ones(8, 4),
                                     torch.ones(2, 4), torch.ones(2, 4))
    assert out.shape == (2, 8)
    t = _step_inputs(12)
    with pytest.raises(ValueError, match=r"A must be \(6, 4, 5\)"):
        ops.selective_state_update(t["state"], t["x"], t["dt"], t["A"][:, :2], t["B"], t["C"])
    with pytest.raises(ValueError, match="heads a multiple of g"):
        ops.selective_state_update(t["state"], t["x"], t["dt"], t["A"], torch.zeros(3, 4, 5), torch.zeros(3, 4, 5))


# --------------------------------------------------------------------------- gated norms

@pytest.mark.parametrize("group_size", [None, 6])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_rmsnorm_fn_matches_its_reference_and_a_loop(group_size, norm_before_gate):
    g = _gen(13)
    x = torch.randn(3, 5, 24, generator=g, dtype=F64)
    z = torch.randn(3, 5, 24, generator=g, dtype=F64)
    w = 1 + 0.3 * torch.randn(24, generator=g, dtype=F64)
    dout = torch.randn(3, 5, 24, generator=g, dtype=F64)
    res = []
    for fn in (ops.rmsnorm_fn, ops.rms_norm_ref):
        leaves = [v.clone().requires_grad_() for v in (x, z, w)]
        out = fn(leaves[0], leaves[2], None, z=leaves[1], eps=1e-5, group_size=group_size,
                 norm_before_gate=norm_before_gate)
        res.append((out, torch.autograd.grad((out * dout).sum(), leaves)))
    _close(res[0][0], res[1][0], 1e-12)
    for a, b in zip(res[0][1], res[1][1]):
        _close(a, b, 1e-10)
    gs = group_size or 24
    v = x if norm_before_gate else x * F.silu(z)
    for i in range(3):
        for j in range(5):
            for k in range(0, 24, gs):
                seg = v[i, j, k:k + gs]
                want = seg / torch.sqrt((seg ** 2).mean() + 1e-5) * w[k:k + gs]
                want = want * F.silu(z[i, j, k:k + gs]) if norm_before_gate else want
                assert torch.allclose(res[1][0][i, j, k:k + gs], want, atol=1e-12)


def test_norm_modules_and_layernorm_form():
    g = _gen(14)
    x, z = torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g)
    norm = ops.RMSNorm(12, eps=1e-5, group_size=4, norm_before_gate=False)
    _close(norm(x, z), ops.rms_norm_ref(x, norm.weight, None, z, 1e-5, 4, False), 1e-6)
    ln = ops.LayerNorm(12, eps=1e-5, group_size=6)
    v = x.reshape(4, 2, 6)
    want = ((v - v.mean(-1, keepdim=True)) / torch.sqrt(v.var(-1, unbiased=False, keepdim=True) + 1e-5)).reshape(4, 12)
    _close(ln(x, z), want * F.silu(z), 1e-5)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"] and norm.bias is None


# --------------------------------------------------------------------------- the import shim

SHIM = r"""
import sonata.interop.mamba_ssm as ops
print(sorted(ops.install()))
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
from mamba_ssm.ops.triton.selective_state_update import selective_state_update
from mamba_ssm.ops.triton.layernorm_gated import RMSNorm, rmsnorm_fn
import mamba_ssm, transformers.utils.import_utils as iu
assert mamba_chunk_scan_combined is ops.mamba_chunk_scan_combined and rmsnorm_fn is ops.rmsnorm_fn
# the way transformers 5 resolves each op (resolve_internal_import on the top-level package)
for path in ("ops.triton.ssd_combined.mamba_chunk_scan_combined", "ops.triton.ssd_combined.mamba_split_conv1d_scan_combined",
             "ops.triton.selective_state_update.selective_state_update"):
    assert iu.resolve_internal_import(mamba_ssm, path) is getattr(ops, path.rsplit(".", 1)[1]), path
print("ok")
"""


def test_install_serves_the_mamba2_module_paths_transformers_imports():
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-c", SHIM], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    names, ok = r.stdout.strip().splitlines()
    assert "mamba_ssm.ops.triton.ssd_combined" in names and "mamba_ssm.ops.triton.layernorm_gated" in names
    assert ok == "ok"
