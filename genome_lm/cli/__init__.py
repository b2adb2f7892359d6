"""The `genome-lm` command line: thin commands (parse the options, call one function, print).

One module per subject registers its commands on the shared app (``base.app``); --help lists
them in the order of a study, the demo first (``base.STUDY_ORDER``). A GenomeLMError from any
command is printed as one ``error:`` line with its exit status, 1 or 128 + the signal that
stopped the work (``base._Commands``).
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from genome_lm import __version__

from .base import app, console

__all__ = ["app", "run"]


def _version(value: bool) -> None:
    if value:
        console.print(f"genome-lm {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    """genome-lm: fine-tune a long-context genome language model."""


from . import bench, check, data, demo, eval, generate, plan, score, train, variants  # noqa: E402,F401  (--help: base.STUDY_ORDER)

# How to continue a command stopped by a second Ctrl-C (the first one checkpoints and stops cleanly).
CONTINUE = {"finetune": "run the same command with --resume to continue from its last checkpoint"}


def run() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
        print(f"interrupted; {CONTINUE.get(command, 'run the same command again to continue')}", file=sys.stderr)
        sys.exit(130)
