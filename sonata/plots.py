"""Matplotlib figures for the notebooks (the notebooks only call these)."""
from __future__ import annotations

import matplotlib

if matplotlib.get_backend().lower() == "agg" or not matplotlib.get_backend():
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def loss_curve(history: list[dict], title: str = "training loss"):
    """Per-step training loss (light), its moving average, and validation loss (dots)."""
    steps = [r["step"] for r in history]
    loss = [r["loss"] for r in history]
    k = max(1, len(loss) // 50)
    smooth = [sum(loss[max(0, i - k + 1): i + 1]) / len(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=1, label="train loss (per step)")
    ax.plot(steps, smooth, color="tab:blue", lw=2, label=f"train loss ({k}-step mean)")
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
