"""User-facing errors.

Anything a user can cause (a bad FASTA, a missing chromosome, an unwritable folder) raises
:class:`GenomeLMError` with a one-line message that names the file and what is wrong. The CLI
prints it as ``error: ...`` and exits with status 1; everything else is a bug and keeps its
traceback.
"""


class GenomeLMError(Exception):
    """A problem with the user's input or environment, explained in one line."""
