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
