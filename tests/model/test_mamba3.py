"""The Mamba-3 SISO block (model.arch=mamba3): its SSD fast path against the float64 recurrence
written from the paper's equations (values, final state, every gradient) at odd sizes and with
each ablation, the one-token step and chunked state against one pass, generation."""
from __future__ import annotations

import pytest
import torch

from conftest import run_cli, tiny_overrides
from sonata.core.config import make_config
from sonata.model import MambaLM
from sonata.model.mamba3 import Mamba3Mixer, recurrence_ref, rotate, rotated_dims


def cfg3(**kw):
    o = {"model.arch": "mamba3", "model.d_model": 32, "model.d_state": 8, "model.headdim": 16,
         "model.chunk_size": 16, "model.vocab_size": 40, "model.backend": "cpu"}
    o.update({f"model.{k}": v for k, v in kw.items()})
    return make_config(o).model


def inputs(mix, L, seed, dtype=torch.float64):
    """The layer's SSM inputs for a random u, as leaves that ask for gradients."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(2, L, mix.cfg.d_model, generator=g, dtype=dtype)
    with torch.no_grad():
        got = mix.ssm_inputs(u)[1:]
    return [t.detach().clone().requires_grad_(True) for t in got]


@pytest.mark.parametrize("L", [1, 17, 63, 65])
@pytest.mark.parametrize("ablation", [{}, {"trapezoid": False}, {"rope_fraction": 0.0},
                                      {"rope_fraction": 1.0, "chunk_size": 7}])
def test_the_ssd_form_equals_the_recurrence_values_state_and_gradients(L, ablation):
    torch.manual_seed(L)
    mix = Mamba3Mixer(cfg3(**ablation)).double()
    with torch.no_grad():
        mix.in_proj.weight.mul_(3)                                        # angles and mixes far from init
    x, delta, A, lam, phi, B, C = inputs(mix, L, seed=L)
    g = torch.Generator().manual_seed(99)
    h0 = torch.randn(2, mix.cfg.nheads, mix.cfg.headdim, mix.cfg.d_state, generator=g, dtype=torch.float64)
    Bp = torch.randn(2, mix.cfg.nheads, mix.cfg.d_state, generator=g, dtype=torch.float64)
    xp = torch.randn(2, mix.cfg.nheads, mix.cfg.headdim, generator=g, dtype=torch.float64)
    theta0 = torch.randn(2, mix.cfg.nheads, mix.R // 2, generator=g, dtype=torch.float64)
    # the oracle runs in the unrotated frame: h = R(Theta_0) h~, B_prev = R(Theta_0) B~_prev
    y_ref, (h_ref, _, _) = recurrence_ref(x, delta, A, lam, phi, B, C,
                                          state=(rotate(h0, theta0[:, :, None]), rotate(Bp, theta0), xp))
    y, (hf, theta, _, _) = mix._scan(x, delta, A, lam, phi, B, C, (h0, theta0, xp, Bp))
    assert (y - y_ref).abs().max() < 1e-10 * max(1.0, float(y_ref.detach().abs().max()))
    assert torch.allclose(rotate(h_ref, -theta[:, :, None]), hf, atol=1e-10, rtol=1e-10)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    leaves = [x, delta, A, lam, phi, B, C]
    ref = torch.autograd.grad((y_ref * w).sum() + h_ref.sum(), leaves, allow_unused=True)
    got = torch.autograd.grad((y * w).sum() + rotate(hf, theta[:, :, None]).sum(), leaves, allow_unused=True)
    for name, a, b in zip("x delta A lam phi B C".split(), ref, got):
        if a is None or (name == "lam" and not mix.cfg.trapezoid):    # Euler: lam is the constant 1
            continue
        assert torch.allclose(a, b, atol=1e-9, rtol=1e-7), name


def test_float32_fast_path_is_within_float32_tolerance_of_the_float64_oracle():
    torch.manual_seed(0)
    mix = Mamba3Mixer(cfg3())
    x, delta, A, lam, phi, B, C = inputs(mix, 70, seed=3, dtype=torch.float32)
    y, _ = mix._scan(x, delta, A, lam, phi, B, C, mix.empty_state(2, x.device))
    y_ref, _ = recurrence_ref(*(t.double() for t in (x, delta, A, lam, phi, B, C)))
    assert (y.double() - y_ref).abs().max() < 2e-5 * max(1.0, float(y_ref.detach().abs().max()))


@pytest.mark.parametrize("ablation", [{}, {"trapezoid": False, "rope_fraction": 0.0}, {"bounded_angle": 4.0}])
def test_step_and_chunked_state_equal_one_pass_and_generation_its_oracle(ablation):
    torch.manual_seed(0)
    m = MambaLM(cfg3(**ablation)).double()
    idx = torch.randint(0, 40, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = m(idx)
        states = [layer.mixer.empty_state(2, idx.device, torch.float64) for layer in m.layers]
        steps = []
        for t in range(30):
            lo, states = m.step(idx[:, t], states)
            steps.append(lo)
        lo1, st = m(idx[:, :11], return_state=True)
        lo2, _ = m(idx[:, 11:], st)
    assert torch.allclose(torch.stack(steps, 1), whole, atol=1e-10, rtol=0)
    assert torch.allclose(torch.cat([lo1, lo2], 1), whole, atol=1e-10, rtol=0)
    m = m.float()
    p = idx[:, :6]
    assert torch.equal(m.generate(p, 10, temperature=0), m.generate_reference(p, 10, temperature=0))


def test_a_bounded_angle_stays_within_a_half_turn_and_the_fast_path_follows_the_oracle():
    """model.bounded_angle=g: the step's angle is pi sigmoid(g theta), within (0, pi) whatever
    the input's size (the paper's Delta theta is unbounded); the SSD form equals the float64
    recurrence with it, values and gradients; a negative g is one config error."""
    torch.manual_seed(0)
    mix = Mamba3Mixer(cfg3(bounded_angle=4.0))
    u = 50 * torch.randn(2, 40, 32, dtype=torch.float64)
    mix = mix.double()
    theta = mix.in_proj(u).split(mix.sizes, dim=-1)[-1].reshape(2, 40, mix.cfg.nheads, -1)
    phi = mix.ssm_inputs(u)[5]
    assert torch.allclose(phi, torch.pi * torch.sigmoid(4.0 * theta))
    assert phi.min() >= 0 and phi.max() <= torch.pi and (phi > 3.1).any() and (phi < 0.04).any()
    x, delta, A, lam, phi, B, C = inputs(mix, 33, seed=5)
    y, st = mix._scan(x, delta, A, lam, phi, B, C, mix.empty_state(2, x.device, torch.float64))
    y_ref, h_ref = recurrence_ref(x, delta, A, lam, phi, B, C)
    assert torch.allclose(y, y_ref, atol=1e-10)
    g1 = torch.autograd.grad(y.square().sum(), [phi, B])
    g2 = torch.autograd.grad(y_ref.square().sum(), [phi, B])
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-9)
    with pytest.raises(Exception, match="bounded_angle"):
        cfg3(bounded_angle=-1.0)


def test_rotated_dims_and_every_parameter_learns():
    assert rotated_dims(cfg3(rope_fraction=0.5)) == 4 and rotated_dims(cfg3(rope_fraction=0.3)) == 2
    assert rotated_dims(cfg3(rope_fraction=0.0)) == 0
    torch.manual_seed(0)
    m = MambaLM(cfg3())
    idx = torch.randint(0, 40, (2, 20))
    m(idx).square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_mamba3_trains_and_resumes_exactly_on_the_command_line(tmp_path):
    import json
    base = tiny_overrides(**{"model.arch": "mamba3", "model.headdim": 16, "model.d_state": 8,
                             "train.decay_steps": 6})
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli("train", "--out", str(a), "--progress", "none", *base).returncode == 0
    assert run_cli("train", "--out", str(b), "--progress", "none", *base, "train.max_steps=3").returncode == 0
    r = run_cli("train", "--resume", str(b / "checkpoint.pt"), "--progress", "none", "train.max_steps=6")
    assert r.returncode == 0, r.stderr
    la = [json.loads(x)["loss"] for x in (a / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    lb = [json.loads(x)["loss"] for x in (b / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(la) == 6 and la == lb
