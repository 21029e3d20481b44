"""The Mamba-3 block (model.arch=mamba3), both forms: the paper form's scan against the float64
recurrence written from the paper's equations in the unrotated frame (values, final state, every
gradient) at odd sizes and with each ablation; the released form (SISO, MIMO, the output norm)
forward against its one-token step chain and the kernel's float64 oracle; chunked state against
one pass, generation, the config checks. The released kernels themselves:
tests/kernels/test_mamba3_kernels.py."""
from __future__ import annotations

import pytest
import torch

from conftest import run_cli, tiny_overrides
from sonata.core.config import make_config
from sonata.core.errors import ConfigError
from sonata.model import MambaLM, families
from sonata.model.mamba3 import Mamba3Mixer, heavy_tail, recurrence_ref, rotate, rotated_dims


def cfg3(**kw):
    o = {"model.arch": "mamba3", "model.d_model": 32, "model.d_state": 8, "model.headdim": 16,
         "model.chunk_size": 16, "model.vocab_size": 40, "model.backend": "cpu"}
    o.update({f"model.{k}": v for k, v in kw.items()})
    return make_config(o).model


def paper(**kw):
    return cfg3(mamba3_form="paper", **kw)


def inputs(mix, L, seed, dtype=torch.float64):
    """The scan's inputs (x, dt, A, trap, angle, q, k) for a random u, as leaves that ask for
    gradients (trap None under Euler)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(2, L, mix.cfg.d_model, generator=g, dtype=dtype)
    with torch.no_grad():
        got = mix.ssm_inputs(u)[1:]
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in got]


@pytest.mark.parametrize("L", [1, 17, 63, 65])
@pytest.mark.parametrize("ablation", [{}, {"trapezoid": False}, {"rope_fraction": 0.0},
                                      {"rope_fraction": 1.0, "chunk_size": 7}])
def test_the_paper_form_equals_its_recurrence_values_state_and_gradients(L, ablation):
    """The paper form on the kernel (its angle negated: k and q turn by -Theta) against the
    update written in the unrotated frame, h = R(-Theta) S."""
    torch.manual_seed(L)
    mix = Mamba3Mixer(paper(**ablation)).double()
    with torch.no_grad():
        mix.in_proj.weight.mul_(3)                                        # angles and mixes far from init
    x, dt, A, trap, angle, q, k = inputs(mix, L, seed=L)
    g = torch.Generator().manual_seed(99)
    c = mix.cfg
    h0 = torch.randn(2, c.nheads, c.headdim, c.d_state, generator=g, dtype=torch.float64)
    kp = torch.randn(2, 1, c.nheads, c.d_state, generator=g, dtype=torch.float64)
    xp = torch.randn(2, c.nheads, c.headdim, generator=g, dtype=torch.float64)
    theta0 = torch.randn(2, c.nheads, mix.R // 2, generator=g, dtype=torch.float64)
    lam = trap if trap is not None else torch.ones_like(dt)
    # the oracle's frame: h = R(-Theta_0) S~, B_prev = R(-Theta_0) k~_prev (Theta: the kernel's angle)
    y_ref, (h_ref, _, _) = recurrence_ref(x, dt, A, lam, -angle, k[:, :, 0], q[:, :, 0], D=mix.D,
                                          state=(rotate(h0, -theta0[:, :, None]), rotate(kp[:, 0], -theta0), xp))
    y, (theta, hf, _, _) = mix.scan(x, dt, A, trap, angle, q, k, (theta0, h0, kp, xp))
    y = y[:, :, 0]
    assert (y - y_ref).abs().max() < 1e-10 * max(1.0, float(y_ref.detach().abs().max()))
    assert torch.allclose(rotate(h_ref, theta[:, :, None]), hf, atol=1e-10, rtol=1e-10)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    leaves = [t for t in (x, dt, A, trap, angle, q, k) if t is not None]
    ref = torch.autograd.grad((y_ref * w).sum() + h_ref.sum(), leaves, allow_unused=True)
    got = torch.autograd.grad((y * w).sum() + rotate(hf, -theta[:, :, None]).sum(), leaves, allow_unused=True)
    for a, b in zip(ref, got):
        if a is not None:
            assert torch.allclose(a, b, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("form", [dict(mamba3_form="paper"), {}, dict(mimo_rank=4)])
def test_float32_fast_path_is_within_float32_tolerance_of_the_float64_oracle(form):
    torch.manual_seed(0)
    mix = Mamba3Mixer(cfg3(**form))
    x, dt, A, trap, angle, q, k = inputs(mix, 70, seed=3, dtype=torch.float32)
    y, _ = mix.scan(x, dt, A, trap, angle, q, k)
    mix.cfg.backend = "reference"
    y_ref, _ = mix.scan(*(t.double() for t in (x, dt, A, trap, angle, q, k)))
    assert (y.double() - y_ref).abs().max() < 2e-5 * max(1.0, float(y_ref.detach().abs().max()))


@pytest.mark.parametrize("form", [dict(mimo_rank=1), dict(mimo_rank=2, outproj_norm=True), dict(mimo_rank=4),
                                  dict(outproj_norm=True, trapezoid=False, rope_fraction=1.0),
                                  dict(mimo_rank=2, bounded_angle=4.0, ngroups=2)])
def test_the_released_layer_equals_its_step_chain_and_the_float64_oracle(form):
    """The released layer (SISO on the SSD kernel, MIMO in chunks) against its one-token step
    chain and against the same layer on the reference backend (the token-by-token scan),
    outputs, final state and every parameter's gradient."""
    torch.manual_seed(1)
    mix = Mamba3Mixer(cfg3(**form)).double()
    with torch.no_grad():
        mix.in_proj.weight.mul_(3)
        for p in (mix.B_bias, mix.C_bias, mix.D, *(getattr(mix, n) for n in ("mimo_x", "mimo_z", "mimo_o")
                                                    if hasattr(mix, n))):
            p.add_(0.3 * torch.randn_like(p))
    u = torch.randn(2, 41, 32, dtype=torch.float64)
    out, st = mix(u, return_state=True)
    chain = mix.empty_state(2, u.device, torch.float64)
    steps = torch.stack([mix.step(u[:, t], chain)[0] for t in range(41)], 1)
    assert torch.allclose(steps, out, atol=1e-10)
    for a, b in zip(st, chain):
        assert torch.allclose(a, b, atol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), list(mix.parameters()))
    mix.cfg.backend = "reference"
    out_ref = mix(u)
    assert torch.allclose(out, out_ref, atol=1e-10)
    ref = torch.autograd.grad(out_ref.square().sum(), list(mix.parameters()))
    for (name, _), a, b in zip(mix.named_parameters(), grads, ref):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-8), name


def test_the_released_inputs_follow_mamba_ssm():
    """A = -max(heavy_tail(a), a_min), the angle pi tanh(theta) dt shared by the heads (one theta
    per pair), trap = sigmoid, the parameters and their shapes are mamba_ssm's Mamba3's."""
    a = torch.tensor([-3.0, -0.5, 0.0, 0.5, 2.0])
    assert torch.allclose(heavy_tail(a), torch.tensor([0.25, 1 / 1.5, 1.0, 1.5, 3.0]))
    torch.manual_seed(0)
    mix = Mamba3Mixer(cfg3(mimo_rank=2, outproj_norm=True)).double()
    u = torch.randn(2, 5, 32, dtype=torch.float64)
    z, x, dt, A, trap, angle, q, k = mix.ssm_inputs(u)
    parts = mix.in_proj(u).split(mix.sizes, dim=-1)
    assert mix.sizes == [64, 64, 16, 16, 4, 4, 4, 2]              # z x B C (R g n) dt A trap angles (n/4)
    assert torch.allclose(A, (-heavy_tail(parts[5])).clamp(max=-1e-4))
    assert torch.allclose(trap, torch.sigmoid(parts[6]))
    assert torch.allclose(angle, torch.pi * torch.tanh(parts[7])[:, :, None] * dt[..., None])
    assert q.shape == (2, 5, 2, 4, 8) and angle.shape == (2, 5, 4, 2)
    shapes = {n: tuple(p.shape) for n, p in mix.named_parameters()}
    assert shapes == {"in_proj.weight": (sum(mix.sizes), 32), "dt_bias": (4,), "D": (4,), "B_bias": (4, 2, 8),
                      "C_bias": (4, 2, 8), "B_norm.weight": (8,), "C_norm.weight": (8,), "mimo_x": (4, 2, 16),
                      "mimo_z": (4, 2, 16), "mimo_o": (4, 2, 16), "norm.weight": (64,), "out_proj.weight": (32, 64)}


def test_a_config_saved_before_the_released_form_loads_as_the_paper_form():
    from sonata.core.config import Config
    old = make_config({"model.arch": "mamba3"}).to_dict()
    assert old["model"].pop("mamba3_form") == "released"
    assert Config.from_dict(old).model.mamba3_form == "paper"
    new = make_config({"model.arch": "mamba3"}).to_dict()
    assert Config.from_dict(new).model.mamba3_form == "released"


def test_the_forms_options_are_checked_in_one_line_each():
    for kw, msg in ((dict(mamba3_form="paper", mimo_rank=2), "mimo_rank=2 is an option of mamba_ssm's released"),
                    (dict(mamba3_form="paper", outproj_norm=True), "outproj_norm=True is an option"),
                    (dict(mamba3_form="mamba4"), "mamba3_form must be released or paper"),
                    (dict(mimo_rank=0), "mimo_rank must be at least 1"),
                    (dict(rope_fraction=0.1), "rotates no pair")):
        with pytest.raises(ConfigError, match=msg):
            families.validate(make_config({"model.arch": "mamba3", "model.d_state": 8,
                                           **{f"model.{k}": v for k, v in kw.items()}}))


@pytest.mark.parametrize("ablation", [dict(mamba3_form="paper"), dict(mamba3_form="paper", trapezoid=False,
                                      rope_fraction=0.0), dict(mamba3_form="paper", bounded_angle=4.0), {},
                                      dict(mimo_rank=2, outproj_norm=True)])
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
    mix = Mamba3Mixer(paper(bounded_angle=4.0))
    u = 50 * torch.randn(2, 40, 32, dtype=torch.float64)
    mix = mix.double()
    theta = mix.in_proj(u).split(mix.sizes, dim=-1)[-1].reshape(2, 40, mix.cfg.nheads, -1)
    phi = -mix.ssm_inputs(u)[5]
    assert torch.allclose(phi, torch.pi * torch.sigmoid(4.0 * theta))
    assert phi.min() >= 0 and phi.max() <= torch.pi and (phi > 3.1).any() and (phi < 0.04).any()
    x, dt, A, trap, angle, q, k = inputs(mix, 33, seed=5)
    y, st = mix.scan(x, dt, A, trap, angle, q, k)
    y_ref, h_ref = recurrence_ref(x, dt, A, trap, -angle, k[:, :, 0], q[:, :, 0], D=mix.D)
    assert torch.allclose(y[:, :, 0], y_ref, atol=1e-10)
    g1 = torch.autograd.grad(y.square().sum(), [angle, k])
    g2 = torch.autograd.grad(y_ref.square().sum(), [angle, k])
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-9)
    with pytest.raises(Exception, match="bounded_angle"):
        cfg3(bounded_angle=-1.0)


def test_rotated_dims_and_every_parameter_learns():
    assert rotated_dims(cfg3(rope_fraction=0.5)) == 4 and rotated_dims(cfg3(rope_fraction=0.3)) == 2
    assert rotated_dims(cfg3(rope_fraction=0.0)) == 0
    for form in (paper(), cfg3(), cfg3(mimo_rank=2, outproj_norm=True)):
        every_parameter_learns(form)


def every_parameter_learns(cfg):
    torch.manual_seed(0)
    m = MambaLM(cfg)
    idx = torch.randint(0, 40, (2, 20))
    m(idx).square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_mamba3_trains_and_resumes_exactly_on_the_command_line(tmp_path):
    import json
    base = tiny_overrides(**{"model.arch": "mamba3", "model.headdim": 16, "model.d_state": 8,
                             "model.mimo_rank": 2, "train.decay_steps": 6})
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli("train", "--out", str(a), "--progress", "none", *base).returncode == 0
    assert run_cli("train", "--out", str(b), "--progress", "none", *base, "train.max_steps=3").returncode == 0
    r = run_cli("train", "--resume", str(b / "checkpoint.pt"), "--progress", "none", "train.max_steps=6")
    assert r.returncode == 0, r.stderr
    la = [json.loads(x)["loss"] for x in (a / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    lb = [json.loads(x)["loss"] for x in (b / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(la) == 6 and la == lb


@pytest.mark.parametrize("form", [dict(mimo_rank=1), dict(mimo_rank=4), dict(mimo_rank=2, outproj_norm=True, ngroups=2),
                                  dict(outproj_norm=True, trapezoid=False), dict(bounded_angle=3.0, rope_fraction=1.0)])
def test_the_fused_cpu_step_equals_the_torch_step(form):
    """The released form's one-token step as one numba pass (sonata.kernels.mamba3.cpu_step)
    against the torch ops it replaces: outputs and every part of the state, float64 to 1e-12,
    float32 within float32's tolerance, over 20 tokens."""
    from sonata.kernels.mamba3.cpu_step import can_fuse
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
        torch.manual_seed(0)
        m = Mamba3Mixer(cfg3(**form)).to(dtype)
        with torch.no_grad():
            m.in_proj.weight.mul_(3)
            for name, p in m.named_parameters():
                if name != "in_proj.weight":
                    p.add_(0.2 * torch.randn_like(p))
        u = torch.randn(3, 20, 32, dtype=dtype)
        fused, torch_ops = m.empty_state(3, "cpu", dtype), m.empty_state(3, "cpu", dtype)
        with torch.no_grad():
            assert can_fuse(fused, m.in_proj(u[:, 0]))
        for t in range(20):
            a = m.step(u[:, t], fused)[0]
            m.cfg.backend = "reference"
            b = m.step(u[:, t], torch_ops)[0]
            m.cfg.backend = "cpu"
            assert torch.allclose(a, b, atol=tol, rtol=tol), t
        for a, b in zip(fused, torch_ops):
            assert torch.allclose(a.double(), b.double(), atol=tol, rtol=tol)
