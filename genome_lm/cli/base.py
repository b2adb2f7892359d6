"""What every command shares: the typer app, the console, the one error handler, size options
and the table printer. Commands live in the sibling modules, one per subject."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup, TyperOption

from genome_lm.errors import GenomeLMError
from genome_lm.units import parse_size, parse_sizes

console = Console()


def fail(exc: GenomeLMError | str, code: int = 1) -> None:
    """Print ``error: <one line>`` on stderr and exit with ``code``."""
    Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


class _Commands(TyperGroup):
    """The app's command group: a GenomeLMError from any command (or subcommand) becomes the
    one-line ``error: ...`` and exit status 1; every other exception keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except GenomeLMError as exc:
            fail(exc)


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
