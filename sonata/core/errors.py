"""User-facing errors: the command line prints them as one `error:` line, exit 2.

Errors carry their facts as fields, so no caller parses or edits message text:
`reasons` (the message is the reasons joined by '; ', the first one says what
happened), `step` (the last completed optimizer step, when the error stops a
run), `rank` (the process the error is about, data parallel) and `agreed` (every
rank raises it at the same point: rank 0 prints it, the others stay silent).
`writable_dir` turns an unusable output or cache folder into one before work starts.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


class SonataError(Exception):
    """A user mistake or an environment problem, explained in one line."""

    def __init__(self, *reasons: str, step: int | None = None, rank: int | None = None,
                 agreed: bool = False):
        self.reasons = [str(r) for r in reasons if r]
        self.step, self.rank, self.agreed = step, rank, agreed
        super().__init__("; ".join(self.reasons))

    @property
    def headline(self) -> str:
        """The first reason: what happened, without the advice."""
        return self.reasons[0] if self.reasons else ""


class ConfigError(SonataError, ValueError):
    """Unknown config key or bad value."""


class DataError(SonataError):
    """Missing, unreadable or empty corpus; unreachable data source."""


class CheckpointError(SonataError):
    """Missing, truncated, corrupt or unsafe checkpoint."""


class TrainingDiverged(SonataError):
    """The loss became NaN or infinite."""


class TrainingInterrupted(SonataError):
    """Stopped by a signal; an emergency checkpoint was written."""

    def __init__(self, *reasons: str, signum: int = 2, **fields):
        super().__init__(*reasons, **fields)
        self.signum = signum


class WriteError(SonataError):
    """A run's file could not be written (disk full, I/O error, read-only folder).
    Fields: `path`, `what` (checkpoint, metrics row, summary...), `bytes` (what it
    needed) and `reason` (the system's words)."""

    def __init__(self, path, what: str, nbytes: int, reason: str, *advice: str, **fields):
        self.path, self.what, self.bytes, self.reason = str(path), what, int(nbytes), reason
        super().__init__(f"could not write the {what} to {self.path} ({self.bytes:,} bytes): {reason}",
                         *advice, **fields)


class WorkerLost(SonataError):
    """Data parallel: another process of the run died or stopped answering; this one
    saved the last completed step (`checkpoint`, None when it could not)."""

    def __init__(self, detail: str, *advice: str, checkpoint=None, **fields):
        self.detail, self.checkpoint = detail, None if checkpoint is None else str(checkpoint)
        saved = (f"the last completed step ({fields.get('step')}) is in {self.checkpoint}; resume with "
                 f"--resume {self.checkpoint}" if self.checkpoint else "no checkpoint written")
        super().__init__(f"lost contact with another process of the run (it failed or stopped; its own "
                         f"message says why): {detail}", saved, *advice, **fields)


def writable_dir(path, what: str):
    """`path` created if needed and proven writable (a file is created and removed), or a
    SonataError naming `what` and the reason: no permission, a path under a file, a
    read-only filesystem, /proc. Called before any work that would write there."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".sonata-write-check-", dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise SonataError(f"{what} {p} cannot be created or written: "
                          f"{e.strerror or type(e).__name__}") from None
    return p
