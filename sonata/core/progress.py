"""The one progress helper.

Modes (argument, else $SONATA_PROGRESS, else `auto`):
- `display`: one text line updated in place with IPython's display ids. Live in
  JupyterLab, and under papermill/nbclient the saved notebook keeps the final,
  readable line (a widget would be saved frozen, as an unreadable model id).
- `widget`: tqdm's notebook widget, for those who want it interactively.
- `bar`: tqdm's terminal bar (a terminal on a TTY).
- `lines`: a plain line every ~10% and at the end (logs, CI, pipes).
- `none`: silent.
`auto` is `display` inside a Jupyter kernel, `bar` on a TTY, `lines` elsewhere.
"""
from __future__ import annotations

import os
import sys
import time

from sonata.core.errors import ConfigError

MODES = ("auto", "display", "widget", "bar", "lines", "none")
DISPLAY_EVERY_S = 0.25   # the display line is redrawn at most this often (and at the end)


def in_jupyter_kernel() -> bool:
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    shell = ip.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def resolve_mode(mode: str | None = None) -> str:
    """The mode to use; an unknown one (argument or $SONATA_PROGRESS) is a `ConfigError`
    (a `ValueError` too) naming where it came from and the modes there are."""
    where = "progress mode" if mode else "SONATA_PROGRESS"
    mode = mode or os.environ.get("SONATA_PROGRESS") or "auto"
    if mode not in MODES:
        raise ConfigError(f"{where} must be one of {' | '.join(MODES)}, not {mode!r}")
    if mode != "auto":
        return mode
    if in_jupyter_kernel():
        return "display"
    return "bar" if sys.stderr.isatty() else "lines"


def _fmt(postfix: dict) -> str:
    parts = []
    for k, v in postfix.items():
        parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return "  ".join(parts)


class Progress:
    """progress = Progress(total, "train"); progress.update(1, loss=3.2); progress.close()"""

    def __init__(self, total: int, desc: str = "", mode: str | None = None):
        self.total, self.desc, self.mode = max(int(total), 0), desc, resolve_mode(mode)
        self.n, self.postfix, self.t0 = 0, {}, time.perf_counter()
        self._next_line, self._printed = 0, -1
        self._bar = self._handle = None
        self._shown, self._next_show = 0, 0.0
        if self.mode in ("bar", "widget"):
            if self.mode == "widget":
                from tqdm.notebook import tqdm
            else:
                from tqdm import tqdm
            self._bar = tqdm(total=self.total, desc=desc, leave=True)
        elif self.mode == "display":
            from IPython.display import display
            # raw text/plain: a str object would be shown as its repr, in quotes
            self._handle = display({"text/plain": self._text()}, raw=True, display_id=True)

    def _text(self) -> str:
        elapsed = time.perf_counter() - self.t0
        pct = 100.0 * self.n / self.total if self.total else 100.0
        head = f"{self.desc}: {self.n}/{self.total} ({pct:3.0f}%) {elapsed:6.1f}s"
        tail = _fmt(self.postfix)
        return f"{head}  {tail}" if tail else head

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        self.postfix.update(postfix)
        if self._bar is not None:
            self._bar.set_postfix_str(_fmt(postfix), refresh=False)
            self._bar.update(n)
        elif self.mode == "display":
            now = time.perf_counter()
            if now >= self._next_show or self.n >= self.total:
                self._show(now)
        elif self.mode == "lines" and (self.n >= self._next_line or self.n >= self.total):
            self._print_line()

    def _print_line(self) -> None:
        print(self._text(), flush=True)
        self._printed = self.n
        self._next_line = self.n + max(1, self.total // 10)

    def _show(self, now: float) -> None:
        """Redraw the display line; at most every DISPLAY_EVERY_S seconds (each update is
        a message the front end must handle, and the kernel queues what it has not read)."""
        self._handle.update({"text/plain": self._text()}, raw=True)
        self._shown, self._next_show = self.n, now + DISPLAY_EVERY_S

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "display" and self._shown != self.n:
            self._show(time.perf_counter())
        elif self.mode == "lines" and self._printed != self.n:
            self._print_line()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
