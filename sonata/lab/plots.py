"""Matplotlib figures for the notebooks (the notebooks only call these)."""
from __future__ import annotations

import io
import time

import matplotlib

if matplotlib.get_backend().lower() == "agg" or not matplotlib.get_backend():
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sonata.core.progress import in_jupyter_kernel  # noqa: E402


def _draw_loss(ax, history: list[dict], title: str) -> None:
    steps = [r["step"] for r in history]
    loss = [r["loss"] for r in history]
    k = max(1, len(loss) // 50)
    smooth = [sum(loss[max(0, i - k + 1): i + 1]) / len(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
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


class LiveLossCurve:
    """The loss curve of a run in progress, for `Trainer.run(on_step=live)`.

    In a Jupyter kernel the figure is one display output, shown below the progress
    line and redrawn in place (a PNG) at most every `every_s` seconds; `close(history)`
    draws the final curve into it. A notebook saved by papermill or nbclient therefore
    keeps one static figure and no widget state. Outside Jupyter (`live=False`) nothing
    is shown while training; `close` returns the final figure."""

    def __init__(self, title: str = "training loss", every_s: float = 3.0, live: bool | None = None):
        self.title, self.every_s = title, every_s
        self.live = in_jupyter_kernel() if live is None else live
        self.fig, self.ax = plt.subplots(figsize=(7, 3.5))
        if self.live:
            plt.close(self.fig)    # shown through the display handle only, not again at the cell's end
        self.draws, self._last, self._handle = 0, float("-inf"), None

    def __call__(self, trainer, row: dict) -> None:
        if self.live and time.perf_counter() - self._last >= self.every_s:
            self.draw(trainer.history + [row])

    def draw(self, history: list[dict]) -> None:
        self.ax.clear()
        _draw_loss(self.ax, history, self.title)
        self.fig.tight_layout()
        self.draws, self._last = self.draws + 1, time.perf_counter()
        if self.live:
            from IPython.display import Image, display
            buf = io.BytesIO()
            self.fig.savefig(buf, format="png", dpi=80)
            if self._handle is None:
                self._handle = display(Image(buf.getvalue()), display_id=True)
            else:
                self._handle.update(Image(buf.getvalue()))

    def close(self, history: list[dict]):
        self.draw(history)
        return self.fig


class Table:
    """A list of dicts shown as an HTML table in Jupyter and as text elsewhere."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.cols = list(dict.fromkeys(k for r in rows for k in r))

    def _cells(self):
        return [[("-" if r.get(c) is None else str(r.get(c))) for c in self.cols] for r in self.rows]

    def __repr__(self) -> str:
        cells = self._cells()
        w = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(self.cols)]
        lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(self.cols))]
        lines += ["  ".join(v.ljust(w[i]) for i, v in enumerate(row)) for row in cells]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>"
                       for row in self._cells())
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def table(rows: list[dict]) -> Table:
    return Table(rows)


def dynamics_curves(runs, title: str = ""):
    """Loss and max exp(delta*A) per step for each run (notebook 05)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for r in runs:
        label = r.variant + (f" (diverged at {r.diverged_at})" if r.diverged else "")
        a1.plot(r.steps, r.loss, label=label)
        a2.plot(r.steps, r.max_decay, label=r.variant)
    a1.set_xlabel("optimizer step")
    a1.set_ylabel("training loss (nats / token)")
    a1.set_title(f"loss, {title}")
    a2.axhline(1.0, color="k", lw=1, ls="--")
    a2.set_yscale("log")
    a2.set_xlabel("optimizer step")
    a2.set_ylabel("max exp(delta * A)")
    a2.set_title("largest decay (above 1: expanding)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    return fig


def scan_times(rows: list[dict], title: str = "selective scan"):
    """Grouped bars of forward and forward+backward ms per backend (log scale)."""
    names = [r["backend"] for r in rows]
    fwd = [r["fwd ms"] for r in rows]
    fb = [r["fwd+bwd ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], fwd, width=0.4, label="forward")
    ax.bar([x + 0.2 for x in xs], fb, width=0.4, label="forward + backward")
    ax.set_xticks(list(xs), [f"{n}\n{r['size'].split(' ')[0]}" for n, r in zip(names, rows)])
    ax.set_yscale("log")
    ax.set_ylabel("milliseconds (log scale)")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    return fig


def autotune_curve(result: dict, title: str = "micro-batch autotuning"):
    """Tokens/s (line) and peak memory (bars) per candidate micro-batch; the cap and
    the budget as dashed lines, the choice circled (notebook 02)."""
    rows = [c for c in result["table"]]
    mbs = [c["micro_batch"] for c in rows]
    xs = list(range(len(mbs)))
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    mem = ax.twinx()
    peaks = [(c["peak_mem_bytes"] or 0) / 2**20 for c in rows]
    mem.bar(xs, peaks, color=["tab:gray" if c["fits"] else "tab:red" for c in rows], alpha=0.3,
            width=0.6, label="peak memory (MiB)")
    mem.set_ylabel("peak memory (MiB)")
    if result.get("budget_bytes") and result["budget_bytes"] / 2**20 < 1.5 * max(peaks + [1]):
        mem.axhline(result["budget_bytes"] / 2**20, color="tab:red", ls=":", lw=1, label="budget")
    measured = [(x, c["tok_per_s"]) for x, c in zip(xs, rows) if c["tok_per_s"]]
    ax.plot(*zip(*measured), "o-", color="tab:blue", label="tokens/s")
    ax.set_zorder(mem.get_zorder() + 1)
    ax.patch.set_visible(False)
    cap = result["profile"]["max_micro_batch"]
    inside = [x for x, m in zip(xs, mbs) if m <= cap]
    if inside and len(inside) < len(xs):
        ax.axvline(inside[-1] + 0.5, color="k", ls="--", lw=1)
        ax.text(inside[-1] + 0.55, ax.get_ylim()[1] * 0.97, f"cap {cap}", va="top", fontsize=9)
    if result.get("micro_batch"):
        x = mbs.index(result["micro_batch"])
        ax.plot([x], [rows[x]["tok_per_s"]], "o", ms=14, mfc="none", mec="tab:green", mew=2,
                label="chosen")
    ax.set_xticks(xs, [str(m) for m in mbs])
    ax.set_xlabel("micro-batch (sequences)")
    ax.set_ylabel("training tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = mem.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def memory_curves(series: dict, budget_bytes: int | None = None, title: str = "memory after each step"):
    """Memory (MiB) after each optimizer step for each named run (notebook 03)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, values in series.items():
        ax.plot(range(1, len(values) + 1), [v / 2**20 for v in values], "o-", ms=3, label=name)
    if budget_bytes:
        ax.axhline(budget_bytes / 2**20, color="tab:red", ls="--", lw=1, label="memory budget")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MiB (resident set on CPU, allocated on CUDA)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def bpb_against_time(curves: dict, title: str = "validation bits per byte"):
    """Validation bits per byte against training seconds, one line per named run
    (notebook 07); `curves[name]` is a list of (seconds, bpb)."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, points in curves.items():
        if points:
            ax.plot(*zip(*points), "o-", ms=3, label=name)
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation bits per byte")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def loss_by_position(positions: dict, title: str = "validation loss by position in the window"):
    """Validation loss (nats per token) against the token's position in its window, one
    line per named run (notebook 07); `positions[name]` is the loss at positions 0, 1, ...
    (a moving average over 8 positions, so the curve is readable)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, losses in positions.items():
        if len(losses):
            k = min(8, len(losses))
            smooth = np.convolve(np.asarray(losses, dtype=float), np.ones(k) / k, mode="valid")
            ax.plot(np.arange(len(smooth)) + (k - 1) / 2, smooth, lw=1.5, label=name)
    ax.set_xscale("symlog", linthresh=8)
    ax.set_xlabel("position in the window (tokens of context before the prediction)")
    ax.set_ylabel("validation loss, nats per token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def _accuracy_axes(fig, ax, xlabel: str, ylabel: str, title: str):
    """The accuracy figures' finish (notebooks 08 and 10): log2 x axis, accuracy 0-1, grid, legend."""
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def accuracy_by_length(curves: dict, chance: float, train_length: int | None = None,
                       title: str = "accuracy by test length"):
    """Accuracy against test length (log2 axis), one line per named model (notebook 08);
    `curves[name]` is a list of (length, accuracy); chance and the training length marked."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, points in curves.items():
        points = [(L, a) for L, a in points if a is not None]
        if points:
            ax.plot(*zip(*points), "o-", ms=4, label=name)
    ax.axhline(chance, color="k", ls=":", lw=1, label=f"chance ({chance:.3f})")
    if train_length:
        ax.axvline(train_length, color="tab:gray", ls="--", lw=1, label=f"training length {train_length:,}")
    return _accuracy_axes(fig, ax, "test sequence length (log2)", "accuracy", title)


def delta_heatmaps(panels: dict, tokens: list[str], title: str = "delta per position"):
    """log10 of the step size delta per channel (rows) and position (columns), one panel per
    (model, layer) in `panels` ({label: (channels, L) array}); `tokens` label the positions."""
    import numpy as np
    n = len(panels)
    fig, axes = plt.subplots(n, 1, figsize=(10, 1.9 * n + 0.6), squeeze=False)
    vals = [np.log10(np.maximum(np.asarray(v, dtype=np.float64), 1e-30)) for v in panels.values()]
    lo = min(float(np.percentile(v, 1)) for v in vals)
    hi = max(float(v.max()) for v in vals)
    for ax, (label, _), v in zip(axes[:, 0], panels.items(), vals):
        im = ax.imshow(v, aspect="auto", cmap="viridis", vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_ylabel(label, fontsize=8)
        ax.set_xticks(range(len(tokens)), tokens, fontsize=6)
        ax.set_yticks([])
    axes[0, 0].set_title(title)
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="log10 delta", fraction=0.03)
    return fig


def ssd_blocks(M, chunk: int, title: str = "one head's SSD matrix M (log10 |M|)"):
    """Notebook 09: the lower-triangular matrix of one SSD head with the chunk grid drawn: the
    diagonal blocks are what the chunked form computes as small quadratic forms, the blocks
    below them (rank <= N) what it passes through the chunks' states."""
    m = M.detach().double().abs().numpy()
    with np.errstate(divide="ignore"):
        logm = np.where(m > 0, np.log10(np.maximum(m, 1e-300)), np.nan)
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    im = ax.imshow(logm, cmap="viridis", interpolation="nearest")
    L = m.shape[0]
    for k in range(chunk, L, chunk):
        ax.axhline(k - 0.5, color="w", lw=0.8)
        ax.axvline(k - 0.5, color="w", lw=0.8)
    ax.set_xlabel("input position j")
    ax.set_ylabel("output position i")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="log10 |M[i, j]| (blank: 0)")
    fig.tight_layout()
    return fig


def form_times(rows: list[dict], title: str = "SSD forward time against sequence length"):
    """Notebook 09: milliseconds of each form against L (log-log); missing points skipped."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for key in [k for k in rows[0] if k.endswith(" ms")]:
        pts = [(r["L"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=key[:-3])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("milliseconds (log scale)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def recall_by_state(rows: list[dict], title: str = "MQAR accuracy against state size N"):
    """MQAR accuracy against the state size N (log2 axis), one line per model (notebook 10);
    `rows` are sonata.lab.recall.recall_runs' (N '-' for attention: a horizontal line)."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    models = list(dict.fromkeys(r["model"] for r in rows))
    flat = 0                                             # lines without N: attention, then its ablation
    for name in models:
        pts = sorted((r["N"], r["accuracy"]) for r in rows if r["model"] == name and r["N"] != "-")
        if pts:
            ax.plot(*zip(*pts), "o-", ms=5, label=name)
        for r in rows:
            if r["model"] == name and r["N"] == "-":
                ax.axhline(r["accuracy"], color="k" if flat == 0 else "0.55", ls="--" if flat == 0 else ":",
                           lw=1, label=f"{name} (no N)")
                flat += 1
    return _accuracy_axes(fig, ax, "state size N (log2)", "accuracy at the trained length", title)
