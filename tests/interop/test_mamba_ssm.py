"""sonata.interop.mamba_ssm, mamba_ssm's op surface on sonata's kernels: each op against its reference in
float64 (values and every gradient), the references against plain loops, decoding steps
against whole sequences, the import shim, and a Mamba block written the way mamba_ssm's
`mamba_simple.Mamba` is (this file's own code) trained and decoded through the ops."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.interop import mamba_ssm as ops

torch.manual_seed(0)


def _inputs(seed, batch, dim, N, L, b_form="batch", c_form="batch", groups=2, dtype=torch.float64, **opts):
    """Mamba-like inputs for selective_scan_fn; B and C in the asked form."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    def bc():
        return {"batch": lambda: r(batch, N, L), "grouped": lambda: r(batch, groups, N, L),
                "time-invariant": lambda: r(dim, N)}

    t = dict(u=r(batch, dim, L), delta=r(batch, dim, L, scale=0.5),
             A=(-torch.rand(dim, N, generator=g, dtype=torch.float64) * 2 - 0.1).to(dtype),
             B=bc()[b_form](), C=bc()[c_form]())
    if opts.get("D", True):
        t["D"] = r(dim)
    if opts.get("z", True):
        t["z"] = r(batch, dim, L)
    if opts.get("bias", True):
        t["delta_bias"] = r(dim, scale=0.5)
    return t


def _leaves(t):
    return {k: v.detach().clone().requires_grad_() for k, v in t.items()}


def _run(fn, t, softplus, last, dout, dlast):
    x = _leaves(t)
    res = fn(**x, delta_softplus=softplus, return_last_state=last)
    out, state = res if last else (res, None)
    loss = (out * dout).sum() + ((state * dlast).sum() if last else 0)
    grads = torch.autograd.grad(loss, list(x.values()))
    return out, state, dict(zip(x, grads))


FORMS = [("batch", "batch"), ("grouped", "grouped"), ("grouped", "batch"), ("time-invariant", "batch"),
         ("batch", "time-invariant")]


@pytest.mark.parametrize("forms", FORMS, ids=lambda f: "-".join(f))
@pytest.mark.parametrize("L,opts", [(128, {}), (300, {"D": False, "z": False, "bias": False}), (1, {})])
def test_selective_scan_fn_matches_its_reference(forms, L, opts):
    """float64, every gradient, with and without D / z / delta_bias, softplus and last state."""
    t = _inputs(1, 2, 8, 4, L, *forms, **opts)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(2, 8, L, generator=g, dtype=torch.float64)
    dlast = torch.randn(2, 8, 4, generator=g, dtype=torch.float64)
    for softplus, last in ((True, True), (False, False)):
        if not softplus:
            t["delta"] = t["delta"].abs()
        got = _run(ops.selective_scan_fn, t, softplus, last, dout, dlast)
        ref = _run(ops.selective_scan_ref, t, softplus, last, dout, dlast)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-10)
        if last:
            torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-10)
        for k in ref[2]:
            torch.testing.assert_close(got[2][k], ref[2][k], rtol=1e-9, atol=1e-9, msg=f"d{k} {forms}")


@pytest.mark.parametrize("forms", [("grouped", "time-invariant"), ("time-invariant", "batch")])
def test_reference_against_plain_loops(forms):
    """The reference's grouped and time-invariant forms against a loop over (b, d, n, t)."""
    t = _inputs(3, 2, 4, 3, 5, *forms)
    out, last = ops.selective_scan_ref(**t, delta_softplus=True, return_last_state=True)
    u, delta, A, B, C, D, z, bias = (t[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias"))
    for b in range(2):
        for d in range(4):
            h = [0.0] * 3
            for s in range(5):
                dt = math.log1p(math.exp(float(delta[b, d, s] + bias[d])))
                grp = d // 2                                        # 2 groups of 2 channels
                for n in range(3):
                    B_n = B[d, n] if forms[0] == "time-invariant" else B[b, grp, n, s]
                    h[n] = math.exp(dt * float(A[d, n])) * h[n] + dt * float(B_n * u[b, d, s])
                C_n = [C[d, n] if forms[1] == "time-invariant" else C[b, n, s] for n in range(3)]
                y = sum(h[n] * float(C_n[n]) for n in range(3)) + float(D[d] * u[b, d, s])
                zz = float(z[b, d, s])
                assert abs(float(out[b, d, s]) - y * zz / (1 + math.exp(-zz))) < 1e-12
            assert max(abs(float(last[b, d, n]) - h[n]) for n in range(3)) < 1e-12


def test_per_batch_form_is_sonatas_own_scan():
    """The per-batch form against sonata's float64 reference (an independent implementation)."""
    from sonata.kernels.selective.reference import selective_scan_ref as sonata_ref
    t = _inputs(4, 2, 6, 4, 50)
    torch.testing.assert_close(ops.selective_scan_fn(**t, delta_softplus=True),
                               sonata_ref(**t, delta_softplus=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype):
    """mamba_ssm's contract: out in u's dtype, arithmetic in float32, the state in float32."""
    t = _inputs(5, 2, 16, 8, 64, "grouped", "grouped", groups=4, dtype=dtype)
    out, last = ops.selective_scan_fn(**t, delta_softplus=True, return_last_state=True)
    ref, ref_last = ops.selective_scan_ref(**{k: v.double() for k, v in t.items()}, delta_softplus=True,
                                           return_last_state=True)
    assert out.dtype == dtype and last.dtype == torch.float32
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=tol, atol=tol)
    torch.testing.assert_close(last.double(), ref_last, rtol=1e-4, atol=1e-4)


def test_initial_state_chains_pieces():
    """initial_state (a keyword mamba_ssm lacks): two halves chained equal one pass."""
    t = _inputs(6, 2, 8, 4, 96, "grouped", "grouped")
    whole, last = ops.selective_scan_fn(**t, delta_softplus=True, return_last_state=True)
    first = {k: (v[..., :40] if v.dim() >= 3 and v.shape[-1] == 96 else v) for k, v in t.items()}
    second = {k: (v[..., 40:] if v.dim() >= 3 and v.shape[-1] == 96 else v) for k, v in t.items()}
    a, s = ops.selective_scan_fn(**first, delta_softplus=True, return_last_state=True)
    b, s2 = ops.selective_scan_fn(**second, delta_softplus=True, return_last_state=True, initial_state=s)
    torch.testing.assert_close(torch.cat([a, b], -1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s2, last, rtol=1e-12, atol=1e-12)


def test_bad_inputs_are_clear_errors():
    t = _inputs(7, 2, 8, 4, 16)
    with pytest.raises(ValueError, match="complex A is not supported"):
        ops.selective_scan_fn(**{**t, "A": t["A"].to(torch.complex128)})
    with pytest.raises(ValueError, match=r"B of shape \(2, 3, 4, 16\) fits none"):
        ops.selective_scan_fn(**{**t, "B": torch.zeros(2, 3, 4, 16, dtype=torch.float64)})
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.selective_scan_fn(**t, cu_seqlens=torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="activation must be"):
        ops.causal_conv1d_fn(t["u"], torch.zeros(8, 4, dtype=torch.float64), activation="relu")


# --------------------------------------------------------------------------- causal conv1d

def test_causal_conv1d_against_a_loop_and_in_pieces():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 30, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    out = ops.causal_conv1d_fn(x, w, bias, activation="silu")
    pre = torch.stack([bias[None, :] + sum(w[:, k] * (x[:, :, t - 3 + k] if t - 3 + k >= 0 else 0)
                                           for k in range(4)) for t in range(30)], dim=-1)
    torch.testing.assert_close(out, F.silu(pre), rtol=1e-12, atol=1e-12)
    a, state = ops.causal_conv1d_fn(x[..., :11], w, bias, return_final_states=True)
    b = ops.causal_conv1d_fn(x[..., 11:], w, bias, initial_states=state)
    torch.testing.assert_close(torch.cat([a, b], -1), pre, rtol=1e-12, atol=1e-12)
    assert torch.equal(state, x[..., 8:11])


@pytest.mark.parametrize("circular", [False, True])
def test_causal_conv1d_update_steps_equal_the_sequence(circular):
    """Step by step (one token, then a chunk of three) through the conv state, linear or as a
    circular buffer (cache_seqlens), equals the whole sequence; conv_state_indices picks rows."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    whole = ops.causal_conv1d_fn(x, w, None, activation="silu")
    state_len = 6 if circular else 3
    big = torch.zeros(4, 5, state_len, dtype=torch.float64)            # rows 3 and 1 are ours
    idx = torch.tensor([3, 1], dtype=torch.int32)
    outs, t = [], 0
    for n in (1,) * 9 + (3,):
        seqlens = torch.full((2,), t, dtype=torch.int32) if circular else None
        if circular:
            rows = big[idx.long()]
            outs.append(ops.causal_conv1d_update(x[..., t:t + n] if n > 1 else x[..., t], rows, w,
                                                 activation="silu", cache_seqlens=seqlens))
            big[idx.long()] = rows
        else:
            outs.append(ops.causal_conv1d_update(x[..., t:t + n] if n > 1 else x[..., t], big, w,
                                                 activation="silu", conv_state_indices=idx))
        t += n
    got = torch.cat([o if o.dim() == 3 else o[..., None] for o in outs], -1)
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)
    assert torch.equal(big[0], torch.zeros(5, state_len)) and torch.equal(big[2], torch.zeros(5, state_len))


def test_selective_state_update_steps_equal_the_scan():
    """One step at a time (grouped B and C, D, z, dt_bias, softplus), the state updated in place:
    the outputs and the final state of selective_scan_fn; state_batch_indices picks rows."""
    t = _inputs(10, 2, 8, 4, 20, "grouped", "grouped")
    out, last = ops.selective_scan_fn(**t, delta_softplus=True, return_last_state=True)
    big = torch.zeros(3, 8, 4, dtype=torch.float64)
    idx = torch.tensor([2, 0])
    steps = [ops.selective_state_update(big, t["u"][..., s], t["delta"][..., s], t["A"], t["B"][..., s],
                                        t["C"][..., s], t["D"], t["z"][..., s], t["delta_bias"], True,
                                        state_batch_indices=idx) for s in range(20)]
    torch.testing.assert_close(torch.stack(steps, -1), out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(big[idx], last, rtol=1e-12, atol=1e-12)
    assert torch.equal(big[1], torch.zeros(8, 4))


# --------------------------------------------------------------------------- the whole mixer

def _mixer_weights(seed, d_model=16, dim=32, N=4, R=2, K=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
    return dict(conv1d_weight=r(dim, 1, K), conv1d_bias=r(dim), x_proj_weight=r(R + 2 * N, dim),
                delta_proj_weight=r(dim, R), out_proj_weight=r(d_model, dim), out_proj_bias=r(d_model),
                A=-torch.rand(dim, N, generator=g, dtype=torch.float64).to(dtype) - 0.5, D=r(dim),
                delta_bias=r(dim) - 2.0, B_proj_bias=r(N), C_proj_bias=r(N))


def test_mamba_inner_fn_matches_its_reference():
    """The fused mixer (conv + SiLU kernel, the scan forming delta itself) against the
    references' composition in float64: the output and the gradient of every weight."""
    w = _mixer_weights(11)
    g = torch.Generator().manual_seed(12)
    xz = torch.randn(2, 64, 50, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 50, 16, generator=g, dtype=torch.float64)
    results = []
    for fn in (ops.mamba_inner_fn, ops.mamba_inner_ref):
        leaves = _leaves({"xz": xz, **w})
        out = fn(**leaves)
        results.append((out, torch.autograd.grad((out * dout).sum(), list(leaves.values()))))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-10, atol=1e-10)
    for name, a, b in zip(["xz", *w], results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"d{name}")


def test_mamba_inner_fn_with_falcon_mambas_b_c_dt_norms_matches_its_reference():
    """b_rms_weight / c_rms_weight (N,) and dt_rms_weight (dim,), the keywords transformers'
    FalconMamba passes (dropped silently by a signature without them): RMSNorm of B, C and of
    delta after delta_proj, as mamba_ssm applies them; output and every gradient in float64."""
    w = _mixer_weights(13)
    g = torch.Generator().manual_seed(14)
    norms = dict(b_rms_weight=1 + 0.2 * torch.randn(4, generator=g, dtype=torch.float64),
                 c_rms_weight=1 + 0.2 * torch.randn(4, generator=g, dtype=torch.float64),
                 dt_rms_weight=1 + 0.2 * torch.randn(32, generator=g, dtype=torch.float64))
    xz = torch.randn(2, 64, 30, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 30, 16, generator=g, dtype=torch.float64)
    results = []
    for fn in (ops.mamba_inner_fn, ops.mamba_inner_ref):
        leaves = _leaves({"xz": xz, **w, **norms})
        out = fn(**leaves, b_c_dt_rms_eps=1e-5)
        results.append((out, torch.autograd.grad((out * dout).sum(), list(leaves.values()))))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-10, atol=1e-10)
    for name, a, b in zip(["xz", *w, *norms], results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"d{name}")
    plain = ops.mamba_inner_ref(xz, **w)
    assert (plain - results[1][0]).abs().max() > 1e-3          # the norms change the result


class SimpleMamba(nn.Module):
    """A Mamba block written the way mamba_ssm's `mamba_simple.Mamba` is (in_proj to a
    channel-major xz, mamba_inner_fn in training, causal_conv1d_update + selective_state_update
    per decoded token), with the ops imported as such code imports them."""

    def __init__(self, d_model=16, d_state=4, d_conv=4, expand=2, dt_rank=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.d_inner, self.dt_rank, self.d_state = expand * d_model, dt_rank, d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(self.d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32).repeat(self.d_inner, 1)))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, h):
        from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn
        xz = (h @ self.in_proj.weight.t()).transpose(1, 2)             # (b, 2 d_inner, L)
        return mamba_inner_fn(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                              self.out_proj.weight, self.out_proj.bias, -torch.exp(self.A_log.float()), None, None,
                              self.D.float(), delta_bias=self.dt_proj.bias.float(), delta_softplus=True)

    def step(self, h, conv_state, ssm_state):
        from causal_conv1d import causal_conv1d_update
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        x, z = self.in_proj(h).chunk(2, dim=-1)                        # (b, d_inner)
        x = causal_conv1d_update(x, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, "silu")
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = dt @ self.dt_proj.weight.t()
        y = selective_state_update(ssm_state, x, dt, -torch.exp(self.A_log.float()), B, C, self.D, z=z,
                                   dt_bias=self.dt_proj.bias, dt_softplus=True)
        return self.out_proj(y)


SHIM_SCRIPT = r"""
import importlib.util, sys
sys.path.insert(0, {tests!r})
import sonata.interop.mamba_ssm, torch
print(sorted(sonata.interop.mamba_ssm.install()))
from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
from causal_conv1d import causal_conv1d_fn
assert selective_scan_fn is sonata.interop.mamba_ssm.selective_scan_fn and causal_conv1d_fn is sonata.interop.mamba_ssm.causal_conv1d_fn
assert importlib.util.find_spec("mamba_ssm") is not None
try:
    import mamba_ssm.models.mixer_seq_simple
except ImportError as e:
    print("not imitated:", type(e).__name__)
from test_mamba_ssm import SimpleMamba
m = SimpleMamba(seed=1)
h = torch.randn(2, 24, 16)
opt = torch.optim.Adam(m.parameters(), lr=1e-2)
target = torch.randn(2, 24, 16)
losses = []
for _ in range(30):
    loss = ((m(h) - target) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
print("loss", round(losses[0], 4), round(losses[-1], 4))
with torch.no_grad():
    whole = m(h)
    conv = torch.zeros(2, m.d_inner, 3); ssm = torch.zeros(2, m.d_inner, m.d_state)
    steps = torch.stack([m.step(h[:, t], conv, ssm) for t in range(24)], 1)
print("decode", float((steps - whole).abs().max()) < 1e-5)
"""


def test_mamba_simple_style_block_trains_and_decodes_through_the_install_shim(tmp_path):
    """In a fresh process without mamba_ssm or causal_conv1d: install() makes their import paths
    resolve to sonata.interop.mamba_ssm (and nothing else of them); a block written the mamba_simple way
    trains (its loss falls) and decodes token by token to the outputs of its full forward."""
    import os
    script = tmp_path / "shim.py"
    script.write_text(SHIM_SCRIPT.format(tests=os.path.dirname(__file__)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == str(sorted(ops._SHIMS)) and lines[1] == "not imitated: ModuleNotFoundError", r.stdout
    first, last = (float(v) for v in lines[2].split()[1:])
    assert last < 0.5 * first, lines[2]
    assert lines[3] == "decode True"


def test_install_leaves_a_real_package_alone(tmp_path, monkeypatch):
    """A real causal_conv1d on the path wins: install() shims only what is absent."""
    pkg = tmp_path / "causal_conv1d"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    r = subprocess.run([sys.executable, "-c", "import sonata.interop.mamba_ssm, causal_conv1d; "
                        "print(sorted(sonata.interop.mamba_ssm.install()), causal_conv1d.REAL)"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == ("['mamba_ssm.modules.mamba3', 'mamba_ssm.ops.selective_scan_interface', "
                                "'mamba_ssm.ops.triton.layernorm_gated', "
                                "'mamba_ssm.ops.triton.selective_state_update', 'mamba_ssm.ops.triton.ssd_combined'] True")

