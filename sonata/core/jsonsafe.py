"""JSON that is always JSON: every record sonata writes or prints (summary.json, metrics.jsonl,
the command line's --json output) goes through `finite_json`, which writes a NaN or infinite
float (a loss that diverged, say) as null. Python's json writes them as `NaN` / `Infinity`,
which are not JSON and which strict readers (jq, JSON.parse, pandas' default) refuse."""
from __future__ import annotations

import json
import math

import numpy as np


def finite(value):
    """`value` with every float that is NaN or infinite replaced by None (JSON's null), through
    dicts, lists and tuples; numpy scalars become Python numbers. A new object: nothing is
    changed in place."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def finite_json(value, indent: int | None = None) -> str:
    """json.dumps of `finite(value)`: valid JSON whatever the figures."""
    return json.dumps(finite(value), indent=indent, allow_nan=False)


__all__ = ["finite", "finite_json"]
