"""The SSD (Mamba-2) CPU fast path (sonata.kernels.ssd.cpu) against the float64 recurrence:
every output, the final state and every gradient, at odd sizes, with and without each option;
packed sequences against the same sequences run apart; a long sequence in pieces against the
whole; two runs bit-identical."""
import math

import pytest
import torch

from sonata.kernels.ssd.cpu import ssd_cpu
from sonata.kernels.ssd.reference import ssd_recurrent_ref


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(seed, b, L, h, p, g, n, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)   # noqa: E731
    return dict(x=r(b, L, h, p), dt=r(b, L, h) - 1.0, A=-torch.rand(h, generator=gen, dtype=torch.float64).to(dtype) * 4,
                B=r(b, L, g, n), C=r(b, L, g, n), D=r(h, p), Dh=r(h), z=r(b, L, h, p), dt_bias=r(h) * 0.5,
                S0=r(b, h, p, n))


CASES = [  # L, chunk, heads, headdim, groups, N, options
    (1, 16, 2, 4, 1, 4, {"D": "h", "softplus": True}),
    (63, 16, 4, 8, 2, 16, {"D": "hp", "z": True, "softplus": True, "init": True}),
    (65, 64, 4, 16, 1, 8, {"softplus": True, "limit": (0.01, 2.0), "seq_idx": True}),
    (300, 256, 2, 64, 2, 16, {"z": True, "init": True, "softplus": True, "seq_idx": True, "D": "h"}),
    (300, 32, 4, 4, 4, 32, {"limit": (0.0, 0.5)}),
]


@pytest.mark.parametrize("L,chunk,h,p,g,n,opt", CASES)
def test_every_output_state_and_gradient_match_the_float64_recurrence(L, chunk, h, p, g, n, opt):
    t = _inputs(L * 7 + chunk, 2, L, h, p, g, n)
    seq = None
    if opt.get("seq_idx"):
        seq = torch.zeros(2, L, dtype=torch.int32)
        seq[:, L // 3:] = 1
        seq[1, 2 * L // 3:] = 2
    names = ["x", "dt", "A", "B", "C"] + (["D"] if opt.get("D") == "hp" else ["Dh"] if opt.get("D") else []) \
        + (["z"] if opt.get("z") else []) + (["dt_bias"] if opt.get("softplus") else []) + (["S0"] if opt.get("init") else [])

    def run(fn, dtype):
        leaf = {k: t[k].to(dtype).requires_grad_() for k in names}
        y, s = fn(leaf["x"], leaf["dt"], leaf["A"], leaf["B"], leaf["C"], chunk,
                  D=leaf.get("D", leaf.get("Dh")), z=leaf.get("z"), dt_bias=leaf.get("dt_bias"),
                  initial_states=leaf.get("S0"), seq_idx=seq, dt_softplus=bool(opt.get("softplus")),
                  dt_limit=opt.get("limit", (0.0, math.inf)), return_final_states=True)
        gen = torch.Generator().manual_seed(5)
        wy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        ws = torch.randn(s.shape, generator=gen, dtype=torch.float64)
        loss = (y.double() * wy).sum() + (s.double() * ws).sum()
        return [y, s, *torch.autograd.grad(loss, [leaf[k] for k in names])]

    ref = run(ssd_recurrent_ref, torch.float64)
    for fast_dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        fast = run(ssd_cpu, fast_dtype)
        for what, a, b in zip(["out", "final state"] + [f"d{k}" for k in names], fast, ref):
            assert torch.isfinite(a).all(), what
            assert _rel(a, b) < tol, (fast_dtype, what, _rel(a, b))


def test_packed_sequences_equal_the_sequences_run_apart():
    t = _inputs(3, 1, 120, 4, 8, 2, 16)
    cuts = [0, 37, 90, 120]
    seq = torch.zeros(1, 120, dtype=torch.int32)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        seq[:, a:b] = i
    kw = dict(D=t["Dh"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True)
    packed = ssd_cpu(t["x"], t["dt"], t["A"], t["B"], t["C"], 32, seq_idx=seq, **kw)
    for a, b in zip(cuts, cuts[1:]):
        sl = slice(a, b)
        apart = ssd_cpu(t["x"][:, sl], t["dt"][:, sl], t["A"], t["B"][:, sl], t["C"][:, sl], 32,
                        D=t["Dh"], z=t["z"][:, sl], dt_bias=t["dt_bias"], dt_softplus=True)
        assert _rel(packed[:, sl], apart) < 1e-6


def test_a_long_sequence_in_pieces_equals_the_whole_and_runs_are_bit_identical():
    t = _inputs(4, 2, 500, 2, 16, 1, 16)
    whole, s_whole = ssd_cpu(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, dt_bias=t["dt_bias"],
                             dt_softplus=True, return_final_states=True)
    again, _ = ssd_cpu(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, dt_bias=t["dt_bias"],
                       dt_softplus=True, return_final_states=True)
    assert torch.equal(whole, again)
    state, outs = None, []
    for a in range(0, 500, 137):
        sl = slice(a, min(a + 137, 500))
        y, state = ssd_cpu(t["x"][:, sl], t["dt"][:, sl], t["A"], t["B"][:, sl], t["C"][:, sl], 64,
                           dt_bias=t["dt_bias"], dt_softplus=True, initial_states=state,
                           return_final_states=True)
        outs.append(y)
    assert _rel(torch.cat(outs, 1), whole) < 1e-5 and _rel(state, s_whole) < 1e-5
