"""sonata.train.schedule: the learning rate over steps and over a time budget, and a budgeted run's
conversion into steps on resume (the trainer's budgeted runs: test_budget.py)."""
import math

import pytest

from sonata.core.config import make_config
from sonata.core.errors import ConfigError
from sonata.train.schedule import continue_in_steps, lr_at, lr_at_progress


def test_lr_at_progress_is_the_cosine_over_the_budget_with_warm_up_in_steps():
    t = make_config(["train.lr=1e-3", "train.min_lr_ratio=0.1", "train.warmup_steps=10"]).train
    assert lr_at_progress(50, 0.0, t) == pytest.approx(1e-3)
    assert lr_at_progress(50, 0.5, t) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at_progress(50, 1.0, t) == t.lr * t.min_lr_ratio          # the floor, exactly
    assert lr_at_progress(50, 1.7, t) == t.lr * t.min_lr_ratio          # clamped
    # warm-up in steps, never above the cosine
    assert lr_at_progress(0, 0.01, t) == pytest.approx(1e-4)
    assert lr_at_progress(4, 0.01, t) == pytest.approx(5e-4)
    assert lr_at_progress(4, 0.99, t) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.99)))
    lrs = [lr_at_progress(20, p / 100, t) for p in range(101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # the step schedule is unchanged: warm-up, cosine to the floor at max_steps, constant after
    s = make_config(["train.max_steps=110", "train.warmup_steps=10", "train.lr=1e-3"]).train
    assert lr_at(9, s) == pytest.approx(1e-3) and lr_at(60, s) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(110, s) == lr_at(500, s) == pytest.approx(1e-4)


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_a_horizon_within_the_warm_up_gives_the_floor_from_the_horizon_on(horizon):
    """A budgeted run that used its budget in its first steps resumes with decay_steps = its
    steps, which may lie within the warm-up: from the horizon on the rate is the floor (it
    was the warm-up ramp, or the full rate at step = warm-up: whether the resumed run trained
    at the floor depended on how many steps a slow host fitted in the budget)."""
    t = make_config([f"train.decay_steps={horizon}", "train.warmup_steps=2", "train.max_steps=9",
                     "train.lr=3e-3"]).train
    floor = t.lr * t.min_lr_ratio
    assert [lr_at(s, t) for s in range(horizon, horizon + 3)] == [floor] * 3
    ramp = range(min(horizon, 2))                         # before the horizon: the warm-up as ever
    assert [lr_at(s, t) for s in ramp] == pytest.approx([3e-3 * (s + 1) / 2 for s in ramp])


def test_continue_in_steps_extrapolates_an_interrupted_budget():
    t = make_config(["train.max_seconds=100", "train.max_steps=0"]).train
    state = {"config": make_config(["train.max_seconds=100", "train.max_steps=0"]).to_dict(),
             "step": 10, "train_seconds": 25.0}
    r = continue_in_steps(t, state)
    # a quarter of the budget gave 10 steps: the whole budget is 40 at that pace
    assert (r.max_seconds, r.decay_steps, r.max_steps) == (0.0, 40, 40)
    assert t.max_seconds == 100                                    # the caller's config is not changed
    capped = make_config(["train.max_seconds=100", "train.max_steps=30"])
    r = continue_in_steps(capped.train, dict(state, config=capped.to_dict()))
    assert (r.decay_steps, r.max_steps) == (40, 30)                # the budgeted run's step cap still holds
    asked = make_config(["train.max_seconds=100", "train.max_steps=55"]).train
    assert continue_in_steps(asked, state).max_steps == 55         # changed on resume: the user's value
    off = make_config(["train.max_seconds=0", "train.max_steps=0"]).train
    assert continue_in_steps(off, state).max_steps == 40           # max_seconds=0 on resume: the same
    with pytest.raises(ConfigError, match=r"^train.max_seconds cannot be changed on resume"):
        continue_in_steps(make_config(["train.max_seconds=50"]).train, state)
    steps_state = {"config": make_config().to_dict(), "step": 10, "train_seconds": 3.0}
    plain = make_config().train
    assert continue_in_steps(plain, steps_state) is plain          # a step-based run resumes as it was
    with pytest.raises(ConfigError, match=r"^train.max_seconds cannot be set on resume"):
        continue_in_steps(make_config(["train.max_seconds=50"]).train, steps_state)



def test_continue_in_steps_keeps_a_spent_budget_at_its_steps_even_when_its_time_ended_short():
    """A run that stopped by time ran its last step at budget progress 1 (the projection: time
    so far + the previous step's), but its measured time can end short of the budget when
    that last step was faster than the one before: resumed, it still trains at the floor
    with its own step count, not one extrapolated past it (seen once in a full-suite run:
    297 instead of 296 steps)."""
    cfg = make_config(["train.max_seconds=100", "train.max_steps=0"])
    short = {"config": cfg.to_dict(), "step": 296, "train_seconds": 99.6}     # 296 / 0.996 -> 297
    r = continue_in_steps(cfg.train, dict(short, budget_progress=1.0))
    assert (r.max_seconds, r.decay_steps, r.max_steps) == (0.0, 296, 296)
    r = continue_in_steps(cfg.train, dict(short, budget_progress=0.97))         # interrupted: extrapolated
    assert (r.decay_steps, r.max_steps) == (297, 297)
