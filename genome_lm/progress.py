"""Progress for long work, on stderr: rate in bases (or bytes) per second and time left.

On a terminal, rich's bars. Anywhere else (nohup, CI, a log file) a bar would show nothing until
the end, so a plain line is printed instead every ``GENOME_LM_PROGRESS_SECONDS`` (default 30)
and when the work ends: what is done, the rate and the time left.
"""

from __future__ import annotations

import os
import time

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


def _interval() -> float:
    return float(os.environ.get("GENOME_LM_PROGRESS_SECONDS", 30))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _terminal(console: Console) -> bool:
    return console.is_terminal


class PlainProgress:
    """``Progress``'s calls that genome-lm uses (add_task, advance, update, console), printing one
    plain line per task every ``interval`` seconds and at its end, for output that is not a
    terminal."""

    def __init__(self, console: Console, interval: float | None = None):
        self.console = console
        self.interval = _interval() if interval is None else interval
        self.tasks: dict[int, dict] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for task_id in self.tasks:
            self._line(task_id, force=True)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.__exit__()

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields) -> int:
        task_id = len(self.tasks)
        now = time.monotonic()
        self.tasks[task_id] = {"description": description, "total": total, "completed": completed,
                               "start": now, "start_completed": completed, "last": now, "fields": fields,
                               "printed": None}
        return task_id

    def advance(self, task_id: int, amount: float) -> None:
        self.update(task_id, completed=self.tasks[task_id]["completed"] + amount)

    def update(self, task_id: int, *, completed: float | None = None, total: float | None = None, **fields) -> None:
        task = self.tasks[task_id]
        if completed is not None:
            task["completed"] = completed
        if total is not None:
            task["total"] = total
        task["fields"].update(fields)
        self._line(task_id)

    def _line(self, task_id: int, force: bool = False) -> None:
        task = self.tasks[task_id]
        now = time.monotonic()
        done_all = task["total"] is not None and task["completed"] >= task["total"]
        if not (force or done_all or now - task["last"] >= self.interval):
            return
        if task["printed"] == task["completed"]:  # nothing new since the last line
            return
        task["last"], task["printed"] = now, task["completed"]
        self.console.print(self.describe(task, now), highlight=False, soft_wrap=True)

    @staticmethod
    def describe(task: dict, now: float) -> str:
        unit = task["fields"].get("unit", "bp")
        done, total = task["completed"], task["total"]
        elapsed = now - task["start"]
        rate = (done - task["start_completed"]) / elapsed if elapsed > 0 else 0.0
        extra = [f"{k.replace('_per_', '/').replace('_', ' ')} {v}" for k, v in task["fields"].items() if k != "unit"]
        if unit == "steps":  # training: step n/N, its figures, time left
            parts = [f"{task['description']}: step {int(done)}/{int(total)}" if total else
                     f"{task['description']}: step {int(done)}", *extra]
        else:
            parts = [f"{task['description']}: {_si(done, unit)}" + (f" of {_si(total, unit)} ({done / total:.0%})"
                                                                     if total else "")]
            if rate > 0:
                parts.append(f"{_si(rate, unit)}/s")
            parts += extra
        if rate > 0 and total and done < total:
            parts.append(f"about {_duration((total - done) / rate)} left")
        return ", ".join(parts)


def progress_bar(quiet: bool = False) -> Progress | PlainProgress:
    """A rich Progress on a terminal, ``PlainProgress`` elsewhere; ``add_task(..., unit="bp")``
    sets the unit shown."""
    console = Console(stderr=True)
    if not quiet and not _terminal(console):
        return PlainProgress(console)
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        _Amount(),
        _Rate(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
        transient=False,
    )


class StepProgress:
    """Training progress on stderr: steps done, loss, tokens/s and time left; notes print above it
    (plain lines at a steady interval when stderr is not a terminal)."""

    def __init__(self, enabled: bool, start: int, total: int):
        self.enabled = enabled
        console = Console(stderr=True)
        self.plain = enabled and not _terminal(console)
        if self.plain:
            self.progress = PlainProgress(console)
            self.task = self.progress.add_task("train", total=total, completed=start, unit="steps")
            return
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("{task.fields[mfu]}"), TimeRemainingColumn(),
            console=console, disable=not enabled, transient=False)
        self.task = self.progress.add_task("train", total=total, completed=start, loss="--", rate="--", mfu="")
        if enabled:
            self.progress.start()

    def update(self, metrics) -> None:
        """``metrics``: a ``StepMetrics`` (step, lm_loss, tokens_per_s; TFLOP/s and MFU when it has them)."""
        tflops, mfu = getattr(metrics, "tflops_per_gpu", None), getattr(metrics, "mfu", None)
        if self.plain:
            extra = {} if mfu is None else {"TFLOP/s_per_GPU": f"{tflops:.3g}", "MFU": f"{mfu:.1%}"}
            self.progress.update(self.task, completed=metrics.step, loss=f"{metrics.lm_loss:.4f}",
                                 tok_per_s=f"{metrics.tokens_per_s:,.0f}", **extra)
            return
        self.progress.update(self.task, completed=metrics.step, loss=f"{metrics.lm_loss:.4f}",
                             rate=_si(metrics.tokens_per_s, "").strip(),
                             mfu="" if mfu is None else f"{tflops:.3g} TFLOP/s/GPU, MFU {mfu:.1%}")

    def note(self, text: str) -> None:
        if self.enabled:  # whole, never hard-wrapped: notes name paths and commands
            self.progress.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
