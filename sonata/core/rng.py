"""Random state: seeding, and capturing/restoring every generator a run draws from
(python, numpy, torch CPU and CUDA), so a resumed or re-run stretch of training
draws exactly the same numbers."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every generator's state, as tensors and plain values (loadable with weights_only)."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)),
                       "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                       "gauss": float(np_state[4])}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
