"""Typed errors: the CLI turns any ParatrainError into one line and exit code 2.

Anything else that escapes is a bug in paratrain (or torch) and keeps its traceback.
"""


class ParatrainError(Exception):
    """A problem the user can fix: bad config, missing data, a run dir in the way."""


class ConfigError(ParatrainError, ValueError):
    """A configuration key has a value that cannot work."""


def check_choice(key: str, value: object, allowed: "tuple | list") -> None:
    """A choice key holds one of its values, else one ConfigError line that lists them."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(str, allowed))}")


class DataError(ParatrainError):
    """A data source is missing, empty, or too small for the requested batch."""


class RunDirError(ParatrainError):
    """The run directory already holds another run."""


class TrainingError(ParatrainError):
    """A worker process failed; the message names the rank and the cause."""


class CheckpointError(ParatrainError):
    """A snapshot cannot be written, found or loaded (named path, and why)."""


class Interrupted(KeyboardInterrupt):
    """The job was stopped by a signal (Ctrl-C, SIGTERM, SIGUSR1; to the launcher or to any
    worker), normally after every rank finished its step and a snapshot was committed; the CLI
    says where it stopped and exits with 128 + the signal number (130, 143, 138)."""

    def __init__(self, signum: int = 2):
        super().__init__(signum)
        self.signum = signum
