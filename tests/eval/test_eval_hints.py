"""Small things a newcomer meets in ``genome-lm eval``: the default folder, and a hint before long work."""

from types import SimpleNamespace

import pytest

from genome_lm.cli.eval import folder_name
from genome_lm.eval.evaluate import MANY_WINDOWS, _note_size


@pytest.mark.parametrize("typed", ["22", "chr22", "NC_000022.11", "Chr22"])
def test_every_spelling_of_a_chromosome_gets_the_same_folder(typed):
    """The demo evaluates into RUN/eval-chr22: `eval --chrom 22` must find its scores there."""
    assert folder_name(typed) == "chr22"


@pytest.mark.parametrize("typed", ["scaffold_7", "chr2:1,800,001-2,333,275", "drill"])
def test_other_names_and_regions_stay_as_typed(typed):
    assert folder_name(typed) == typed


def _selection(n, length=32768):
    windows = [SimpleNamespace(length=length) for _ in range(n)]
    return SimpleNamespace(windows=list(range(n)), split=SimpleNamespace(windows=windows))


def test_a_long_evaluation_says_how_to_do_less():
    notes = []
    jobs = [("model", "model", None), ("baseline", "baseline", None)]
    _note_size(SimpleNamespace(max_windows=None), _selection(55), jobs, notes.append)
    (note,) = notes
    assert "all 55 windows (1.8 Mbp) 2 times (model, baseline)" in note and "--max-windows N" in note
    _note_size(SimpleNamespace(max_windows=None), _selection(MANY_WINDOWS), jobs, notes.append)
    _note_size(SimpleNamespace(max_windows=55), _selection(55), jobs, notes.append)
    assert len(notes) == 1  # a few windows, or a count the user chose: nothing to say
