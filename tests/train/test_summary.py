"""summary.json (sonata.train.summary.write_summary) is valid JSON whatever the run's figures: a
loss that became NaN or infinite is written as null, not as the `NaN` / `Infinity` that Python's
json module emits and strict readers (jq, JavaScript's JSON.parse, json.loads(parse_constant=...))
refuse. The summary dict the trainer returns keeps its floats."""
import json
import math
import numpy as np
import pytest
import torch

from sonata.train import summary as summary_mod


def _strict(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as RFC 8259 does."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


FIGURES = {
    "steps": 3, "tokens": 384, "stopped_by": "steps", "backend": "cpu",
    "val_loss": math.nan, "val_bpb": math.inf, "tok_per_s_sustained": None, "grad_norm": -math.inf,
    "wall_s": 1.25, "debug_leak": False,
    "plan": {"lr": 3e-3, "history": [1.0, math.nan, 2.5, math.inf], "nested": {"x": -math.inf}},
    "pair": (math.nan, 1), "torch_loss": torch.tensor(math.nan).item(),
}
NUMPY = {"np_loss": np.float32("nan"), "np_ok": np.float64(0.5), "np_steps": np.int64(7)}


def test_finite_json_writes_non_finite_floats_as_null():
    got = _strict(summary_mod.finite_json({**FIGURES, **NUMPY}, indent=2))
    assert got["val_loss"] is None and got["val_bpb"] is None and got["grad_norm"] is None
    assert got["plan"] == {"lr": 3e-3, "history": [1.0, None, 2.5, None], "nested": {"x": None}}
    assert got["np_loss"] is None and got["np_ok"] == 0.5 and got["np_steps"] == 7
    assert got["pair"] == [None, 1] and got["torch_loss"] is None
    assert {k: got[k] for k in ("steps", "tokens", "stopped_by", "backend", "wall_s", "debug_leak",
                                "tok_per_s_sustained")} == \
        {"steps": 3, "tokens": 384, "stopped_by": "steps", "backend": "cpu", "wall_s": 1.25, "debug_leak": False,
         "tok_per_s_sustained": None}
    assert math.isnan(FIGURES["val_loss"]) and math.isnan(FIGURES["plan"]["history"][1])   # not changed in place
    assert summary_mod.finite_json({"a": 1.5}) == json.dumps({"a": 1.5})      # finite figures: json's own text


def test_write_summary_of_a_run_whose_loss_is_nan_is_valid_json(tmp_path):
    """The issue's case (a run whose loss became NaN, e.g. model.embed_std=1e300): summary.json held
    `NaN`. write_summary's own path to the file is what is tested."""
    returned = summary_mod.write_summary(dict(FIGURES), tmp_path)
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text and text.endswith("}\n")
    written = _strict(text)
    assert written["val_loss"] is None and written["val_bpb"] is None and written["steps"] == 3
    assert math.isnan(returned["val_loss"]) and returned["val_bpb"] == math.inf
    assert summary_mod.write_summary({"steps": 1}, None) == {"steps": 1}     # no folder: nothing written


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_each_non_finite_value_alone(value):
    assert _strict(summary_mod.finite_json({"val_loss": value, "rows": [value]})) == {"val_loss": None,
                                                                                     "rows": [None]}
