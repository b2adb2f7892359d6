"""Progress bars for long work: rate in bases (or bytes) per second and time left, on stderr."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


class _Rate(ProgressColumn):
    """Average rate since the bar started: work arrives in large steps, so rich's windowed
    estimate would swing wildly."""

    def render(self, task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        unit = task.fields.get("unit", "bp")
        if not elapsed or not task.completed:
            return Text("--", style="progress.data.speed")
        return Text(_si(task.completed / elapsed, unit) + "/s", style="progress.data.speed")


class _Amount(ProgressColumn):
    def render(self, task) -> Text:
        unit = task.fields.get("unit", "bp")
        return Text(f"{_si(task.completed, unit)} / {_si(task.total or 0, unit)}", style="progress.download")


def progress_bar(quiet: bool = False) -> Progress:
    """A rich Progress; ``add_task(..., unit="bp")`` sets the unit shown."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        _Amount(),
        _Rate(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=quiet,
        transient=False,
    )


class StepProgress:
    """Training progress on stderr: steps done, loss, tokens/s and time left; notes print above it."""

    def __init__(self, enabled: bool, start: int, total: int):
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} tok/s"), TimeRemainingColumn(),
            console=Console(stderr=True), disable=not enabled, transient=False)
        self.task = self.progress.add_task("train", total=total, completed=start, loss="--", rate="--")
        if enabled:
            self.progress.start()

    def update(self, metrics) -> None:
        self.progress.update(self.task, completed=metrics.step, loss=f"{metrics.lm_loss:.4f}",
                             rate=_si(metrics.tokens_per_s, "").strip())

    def note(self, text: str) -> None:
        if self.enabled:
            self.progress.console.print(text, highlight=False)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
