"""What the training progress bar shows (rendered into a recording console, not a terminal)."""

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from genome_lm import progress


@pytest.fixture
def screen(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress, "Console", lambda **kw: Console(file=out, force_terminal=True, width=150,
                                                                    color_system=None, **kw))
    return out


def test_step_bar_shows_step_loss_rate_and_time_left(screen):
    bar = progress.StepProgress(True, start=3, total=10)
    bar.update(SimpleNamespace(step=4, lm_loss=2.345678, tokens_per_s=12_345.0))
    bar.note("checkpoint saved: runs/x/step-000004")
    bar.close()
    text = screen.getvalue()
    assert "step 4/10" in text
    assert "loss 2.3457" in text
    assert "12.3 k tok/s" in text
    assert "checkpoint saved: runs/x/step-000004" in text
    assert ":" in text.split("tok/s")[-1]  # rich's time-remaining column, h:mm:ss or -:--:--


def test_disabled_bar_prints_nothing(screen):
    bar = progress.StepProgress(False, start=0, total=5)
    bar.update(SimpleNamespace(step=1, lm_loss=1.0, tokens_per_s=10.0))
    bar.close()
    assert screen.getvalue() == ""


@pytest.fixture
def log_file(monkeypatch):
    """stderr as a file (nohup, CI): not a terminal."""
    out = io.StringIO()
    monkeypatch.setattr(progress, "Console", lambda **kw: Console(file=out, force_terminal=False, width=150,
                                                                    color_system=None, **kw))
    return out


def test_without_a_terminal_training_prints_plain_lines_at_an_interval(log_file, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv("GENOME_LM_PROGRESS_SECONDS", "30")
    bar = progress.StepProgress(True, start=0, total=10)
    for step in range(1, 11):
        clock[0] += 7.0  # a step every 7 s: a line every 30 s, and one at the end
        bar.update(SimpleNamespace(step=step, lm_loss=3.0 - step / 10, tokens_per_s=4_000.0 + step))
    bar.close()
    lines = log_file.getvalue().splitlines()
    assert lines == ["train: step 5/10, loss 2.5000, tok/s 4,005, about 35s left",
                     "train: step 10/10, loss 2.0000, tok/s 4,010"], lines


def test_without_a_terminal_work_in_bases_prints_rate_and_time_left(log_file, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv("GENOME_LM_PROGRESS_SECONDS", "10")
    with progress.progress_bar() as bar:
        task = bar.add_task("eval model", total=1_000_000, unit="bp")
        for _ in range(4):
            clock[0] += 6.0
            bar.advance(task, 200_000)
    lines = log_file.getvalue().splitlines()
    assert lines[0] == "eval model: 400.0 kbp of 1.0 Mbp (40%), 33.3 kbp/s, about 18s left"
    assert lines[-1].startswith("eval model: 800.0 kbp of 1.0 Mbp (80%)")
    assert len(lines) == 2  # every 10 s (at 12 s and 24 s); the exit prints nothing new


def test_step_bar_shows_tflops_and_mfu_when_the_step_has_them(screen):
    bar = progress.StepProgress(True, start=0, total=2)
    bar.update(SimpleNamespace(step=1, lm_loss=2.0, tokens_per_s=1_000.0, tflops_per_gpu=0.0123, mfu=0.0456))
    bar.close()
    assert "0.0123 TFLOP/s/GPU, MFU 4.6%" in screen.getvalue()


def test_plain_lines_carry_tflops_and_mfu(log_file, monkeypatch):
    monkeypatch.setenv("GENOME_LM_PROGRESS_SECONDS", "30")
    bar = progress.StepProgress(True, start=0, total=1)
    bar.update(SimpleNamespace(step=1, lm_loss=2.0, tokens_per_s=1_000.0, tflops_per_gpu=1.5, mfu=0.25))
    bar.close()
    assert log_file.getvalue().splitlines() == ["train: step 1/1, loss 2.0000, tok/s 1,000, TFLOP/s/GPU 1.5, MFU 25.0%"]


def test_a_note_prints_whole_at_80_columns(monkeypatch):
    """Piped, at 80 columns: a note (the backend line, a checkpoint's path) is one line."""
    out = io.StringIO()
    monkeypatch.setattr(progress, "Console", lambda **kw: Console(file=out, width=80, color_system=None, **kw))
    bar = progress.StepProgress(True, start=0, total=5)
    note = "backend: cpu (gloo process groups, local specs, allgather MoE dispatcher, cpu-adamw optimizer, kernels)"
    bar.note(note)
    bar.close()
    assert note in out.getvalue().splitlines()
