"""User-facing errors (the command line prints them as one `error:` line, exit 2), and
the check that turns an unusable output or cache folder into one before work starts."""
import os
import tempfile
from pathlib import Path


class SonataError(Exception):
    """A user mistake or an environment problem, explained in one line."""


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

    def __init__(self, message: str, signum: int = 2):
        super().__init__(message)
        self.signum = signum


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
