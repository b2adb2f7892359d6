"""What every command shares: the typer app, the console, the one error handler, size options
and the table printer. Commands live in the sibling modules, one per subject."""

from __future__ import annotations

from typing import IO

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup, TyperOption

from genome_lm.errors import GenomeLMError
from genome_lm.units import parse_size, parse_sizes

from .narrow import FitTables, WholeLines


def make_console(width: int | None = None, file: IO[str] | None = None) -> Console:
    """A console as every command's (``console``): tables fit the width without cutting a word,
    lines of text print whole (``narrow``). ``width`` and ``file``: fixed ones, as for a test;
    by default the terminal's width (COLUMNS, 80 through a pipe) and stdout at each print, so
    typer's CliRunner, which swaps sys.stdout, gets the output."""
    made = WholeLines(width=width, file=file)
    made.push_render_hook(FitTables())
    return made


console = make_console()


def fail(exc: GenomeLMError | str, code: int = 1) -> None:
    """Print ``error: <one line>`` on stderr and exit with ``code``."""
    # the message as plain text: a variant key like 1:100:A>T is neither markup nor an emoji code
    Console(stderr=True).print(Text.assemble(("error:", "bold red"), " ", str(exc)), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


class _Commands(TyperGroup):
    """The app's command group: a GenomeLMError from any command (or subcommand) becomes the
    one-line ``error: ...`` and its exit status (1, or 130 for work Ctrl-C stopped); every other
    exception keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except GenomeLMError as exc:
            fail(exc, exc.exit_code)

    def list_commands(self, ctx):
        """--help lists the commands in the order of a study (the demo first), not in the order
        their modules happen to be imported; a command not named in STUDY_ORDER comes last."""
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: STUDY_ORDER.index(n) if n in STUDY_ORDER else len(STUDY_ORDER))


STUDY_ORDER = ["demo", "prepare", "finetune", "eval", "score", "plot-tracks", "compare-tracks", "generate", "export",
               "variants", "probe", "folds", "plan", "demo-genome", "recall", "check-logprobs", "parity", "preflight",
               "bench"]


def _flags_without_type() -> None:
    """typer (0.29) prints a flag's type as "<bool>" beside it in --help (``--version <bool>``);
    a flag takes no value, so show none."""
    shown = TyperOption.display_type_rich

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich


_flags_without_type()

app = typer.Typer(
    cls=_Commands,
    help="Fine-tune a long-context genome language model: prepare data, train, evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # docstrings are reflowed into paragraphs (a blank line separates them), so --help never
    # breaks a sentence where the source line did
    rich_markup_mode="markdown",
)
bench_app = typer.Typer(help="Benchmarks that compare against a baseline in the same run and print the ratio.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def size(text: str | None, option: str | None = None) -> int | None:
    """A size option (``512k``) in bases; a bad one is a bad parameter naming ``option``."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def sizes(text: str, option: str | None = None) -> list[int]:
    """A comma-separated list of sizes (``1k,4k``)."""
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if value != value else (f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}")
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def print_rows(title: str, rows: list[dict], columns: dict[str, str]) -> None:
    """A table of ``rows``: ``columns`` maps a row key to its heading; the keys that are the same
    in every row and not a column are settings, shown once below the table."""
    settings = {k: v for k, v in rows[0].items()
                if k not in columns and v not in (None, False) and all(r.get(k) == v for r in rows)}
    table = Table(title=title, caption=", ".join(f"{k}={v}" for k, v in settings.items()))
    for heading in columns.values():
        table.add_column(heading, justify="left" if heading in ("path", "mode", "note") else "right")
    for row in rows:
        table.add_row(*(cell(row.get(key, "")) for key in columns))
    console.print(table)
