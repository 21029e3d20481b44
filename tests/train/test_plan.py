"""Profiles and the batch plan (sonata.core.config profiles, sonata.train.plan): presets, overrides,
the cap, a fixed micro-batch."""

import pytest

from conftest import tiny_overrides
from sonata.core.config import PRESETS, ProfileConfig, make_config, resolve_profile
from sonata.core.errors import ConfigError
from sonata.train.plan import plan_batch
from sonata.train.trainer import Trainer

GiB = 2**30


# ---------------------------------------------------------------- profiles
def test_presets_and_overrides():
    cpu = resolve_profile(ProfileConfig(), "cpu", available_bytes=20 * GiB)
    assert cpu.name == "cpu" and cpu.memory_budget_mb == 10 * 1024 and cpu.precision == "fp32"
    lap = resolve_profile(ProfileConfig(name="laptop-8gb"), "cpu", 20 * GiB)
    assert (lap.max_micro_batch, lap.effective_batch, lap.memory_budget_mb) == (8, 16, 7 * 1024)
    assert resolve_profile(ProfileConfig(), "cuda", 0, device_total_bytes=8 * GiB).name == "laptop-8gb"
    h = resolve_profile(ProfileConfig(), "cuda", 0, device_total_bytes=141 * GiB)
    assert h.name == "h200" and h.memory_budget_mb == PRESETS["h200"]["memory_budget_mb"]
    small = resolve_profile(ProfileConfig(name="h200"), "cuda", 0, device_total_bytes=16 * GiB)
    assert small.memory_budget_mb == int(16 * GiB * 0.95) // 2**20      # never above the device
    o = resolve_profile(ProfileConfig(name="laptop-8gb", memory_budget_mb=100, max_micro_batch=4,
                                      candidates="4, 1,2"), "cpu", 20 * GiB)
    assert (o.memory_budget_mb, o.max_micro_batch, o.candidates) == (100, 4, (1, 2, 4))
    assert o.budget_source == "profile.memory_budget_mb"


@pytest.mark.parametrize("override, words", [
    ("profile.name=tpu", "profile.name must be"),
    ("profile.candidates=1,x", "profile.candidates"),
    ("profile.memory_budget_mb=-5", "profile.memory_budget_mb"),
    ("debug.leak=sometimes", "debug.leak must be"),
    ("profile.nmae=cpu", "unknown config key 'profile.nmae'"),
])
def test_bad_profile_values_are_config_errors(override, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        make_config([override])


def test_batch_plan_respects_the_cap_and_the_override():
    p = resolve_profile(ProfileConfig(name="laptop-8gb"), "cpu", 20 * GiB)
    t = make_config([]).train
    plan = plan_batch(t, p)
    assert (plan.micro_batch, plan.accumulation, plan.effective_batch) == (8, 2, 16)   # 8 x 2
    assert plan.precision == "fp16" and plan.world_size == 1        # the profile's precision
    t = make_config(["train.micro_batch=16"]).train
    with pytest.raises(ConfigError, match="above profile laptop-8gb's cap of 8.*fixed_micro_batch"):
        plan_batch(t, p)
    t = make_config(["train.micro_batch=3"]).train           # 3 does not divide the profile's 16
    with pytest.raises(ConfigError, match=r"effective_batch \(16\) must be a multiple"):
        plan_batch(t, resolve_profile(ProfileConfig(), "cpu", 20 * GiB))
    t = make_config(["train.fixed_micro_batch=32"]).train
    plan = plan_batch(t, p)
    assert (plan.micro_batch, plan.effective_batch) == (32, 32)
    assert "cap" in plan.how and "not a multiple" in plan.how
    t = make_config(["train.fixed_micro_batch=4"]).train
    assert (plan_batch(t, p).micro_batch, plan_batch(t, p).accumulation) == (4, 4)


def test_fixed_micro_batch_warns_and_skips_the_cap():
    cfg = make_config(tiny_overrides(**{"train.micro_batch": 0, "train.effective_batch": 4,
                                        "train.fixed_micro_batch": 8, "profile.max_micro_batch": 2,
                                        "train.max_steps": 2}))
    with pytest.warns(UserWarning, match="fixed by train.fixed_micro_batch=8"):
        tr = Trainer(cfg, None, progress="none")
    assert (tr.plan.micro_batch, tr.plan.effective_batch) == (8, 8)
    assert (cfg.train.micro_batch, cfg.train.effective_batch) == (0, 4)      # what was asked
    s = tr.run()
    assert s["micro_batch"] == 8 and s["tokens"] == 2 * 8 * 32
    assert s["plan"] == tr.plan.to_dict()


# ---------------------------------------------------------------- precision
def test_fast_precision_is_bf16_only_on_a_cpu_that_multiplies_bf16(tmp_path, monkeypatch):
    import sonata.train.plan as plan_mod
    from sonata.core.device import cpu_bf16_native
    zen4 = tmp_path / "zen4"
    zen4.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
    sapphire = tmp_path / "spr"
    sapphire.write_text("flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n")
    zen3 = tmp_path / "zen3"
    zen3.write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    assert cpu_bf16_native(str(zen4)) and cpu_bf16_native(str(sapphire))
    assert not cpu_bf16_native(str(zen3)) and not cpu_bf16_native(str(tmp_path / "absent"))
    cpu = resolve_profile(ProfileConfig(), "cpu", 20 * GiB)
    laptop = resolve_profile(ProfileConfig(), "cuda", 0, device_total_bytes=8 * GiB)
    for native, on_cpu in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(plan_mod, "cpu_bf16_native", lambda native=native: native)
        assert plan_mod.resolve_precision("fast", cpu) == on_cpu
        assert plan_mod.resolve_precision("fast", laptop) == "fp16"          # a GPU keeps its profile's
        assert plan_mod.resolve_precision("auto", cpu) == "fp32" and plan_mod.resolve_precision("bf16", laptop) == "bf16"
        t = make_config({"train.precision": "fast"}).train
        assert plan_batch(t, cpu).precision == on_cpu
