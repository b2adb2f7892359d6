"""User-facing errors.

Anything a user can cause (a bad FASTA, a missing chromosome, an unwritable folder) raises
:class:`GenomeLMError` with a one-line message that names the file and what is wrong. The CLI
prints it as ``error: ...`` and exits with its ``exit_code`` (1; 128 + the signal's number for
work a signal stopped, as shells report it); everything else is a bug and keeps its traceback.
"""

import signal


class GenomeLMError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 1


def signal_exit_code(name: str | None) -> int | None:
    """The conventional exit status of a process that a signal stopped (``SIGINT`` -> 130,
    ``SIGTERM`` -> 143); None for anything that is not a signal's name."""
    try:
        return 128 + signal.Signals[name].value
    except KeyError:
        return None


class Stopped(GenomeLMError):
    """Work that stopped early and can be continued (``exit_code``: the signal's status)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
