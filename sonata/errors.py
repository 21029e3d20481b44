"""User-facing errors: the command line prints them as one `error:` line, exit 2."""


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
