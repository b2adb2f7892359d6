"""An interrupted `genome-lm eval` resumes: windows already scored are read back, not scored
again, and the report equals an uninterrupted run's; changed inputs never reuse old scores."""

import json

import numpy as np
import pytest
import torch

import genome_lm.eval.score as score_module
from genome_lm.eval.cache import WindowCache, score_key
from genome_lm.eval.evaluate import EvalRequest, evaluate
from genome_lm.eval.schema import EvalReport


class _Counting:
    """Wraps token_nll: counts the windows it scores; raises KeyboardInterrupt on call ``stop``."""

    def __init__(self, stop=None):
        self.calls, self.stop, self.real = 0, stop, score_module.token_nll

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.stop:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


def _request(demo_run, out, chunk=256):
    return EvalRequest(model=str(demo_run / "run"), out=out, chrom="22", chunk=chunk, max_windows=4, resamples=50,
                       tracking=False)


def _eval(demo_run, out, monkeypatch, stop=None, chunk=256):
    counting = _Counting(stop)
    monkeypatch.setattr(score_module, "token_nll", counting)
    notes = []
    try:
        report = evaluate(_request(demo_run, out, chunk), progress=False, on_note=notes.append)
    finally:
        monkeypatch.setattr(score_module, "token_nll", counting.real)
    return report, counting.calls, notes


@pytest.mark.slow
def test_interrupted_eval_scores_only_the_missing_windows(demo_run, tmp_path, monkeypatch):
    whole, calls, _ = _eval(demo_run, tmp_path / "whole", monkeypatch)
    assert calls == 4
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        _eval(demo_run, out, monkeypatch, stop=3)  # killed while scoring the third window
    assert not (out / "eval.json").exists()
    (folder,) = (out / ".scores").iterdir()
    assert len(list(folder.glob("window-*.npy"))) == 2 and not list(folder.glob(".*tmp"))
    resumed, calls, notes = _eval(demo_run, out, monkeypatch)
    assert calls == 2
    assert any("2 of 4 windows already scored" in n for n in notes)
    assert resumed.results == whole.results  # to the last bit
    assert resumed.data == whole.data
    assert EvalReport.from_json(json.loads((out / "eval.json").read_text())).results == whole.results
    # a damaged file is scored again, the rest read back
    victim = sorted(folder.glob("window-*.npy"))[1]
    victim.write_bytes(victim.read_bytes()[:100])
    again, calls, _ = _eval(demo_run, out, monkeypatch)
    assert calls == 1 and again.results == whole.results


@pytest.mark.slow
def test_changed_settings_or_weights_never_reuse_scores(demo_run, tmp_path, monkeypatch):
    out = tmp_path / "eval"
    _eval(demo_run, out, monkeypatch)
    _, calls, notes = _eval(demo_run, out, monkeypatch, chunk=128)  # another prefill chunk: other numerics
    assert calls == 4 and not notes
    assert len(list((out / ".scores").iterdir())) == 2

    from genome_lm.engine.parallel import parallel_context
    from genome_lm.eval.models import load_model

    with parallel_context() as pg:
        lm = load_model(demo_run / "run", pg)
    key = score_key(lm.model, lm.token_map, demo_run / "dataset", "eval", 256)
    assert key == score_key(lm.model, lm.token_map, demo_run / "dataset", "eval", 256)
    assert key != score_key(lm.model, lm.token_map, demo_run / "dataset", "train", 256)
    with torch.no_grad():
        p = next(lm.model.parameters())
        p.view(-1)[0] += 1e-3  # one weight of one tensor
    assert key != score_key(lm.model, lm.token_map, demo_run / "dataset", "eval", 256)


def test_window_file_round_trip(tmp_path):
    cache = WindowCache(tmp_path / "c")
    rng = np.random.default_rng(0)
    exact = rng.random(257).astype(np.float32).astype(np.float64)  # float32 values, as the scorer makes them
    exact[5] = np.nan
    cache.store(3, exact)
    assert np.load(tmp_path / "c" / "window-0000003.npy").dtype == np.float32
    np.testing.assert_array_equal(cache.load(3, 257), exact)
    wide = rng.random(100)  # not float32-exact: kept as float64
    cache.store(4, wide)
    np.testing.assert_array_equal(cache.load(4, 100), wide)
    assert cache.load(4, 99) is None  # another window length: not this window's scores
    assert cache.load(5, 10) is None and not cache.has(5)


def test_a_damaged_file_is_missing_for_whoever_asks_with_its_length(tmp_path):
    """``has(window, length)`` loads the file: a damaged one (truncated, or another length) is not
    there, and is removed, so a later plain ``has`` agrees (issue 54, defect 2)."""
    cache = WindowCache(tmp_path)
    cache.store(3, np.arange(10, dtype=np.float64))
    cache.store(4, np.arange(10, dtype=np.float64))
    assert cache.has(3) and cache.has(3, 10) and not cache.has(4, 11) and not cache.has(4)
    path = tmp_path / "window-0000003.npy"
    path.write_bytes(path.read_bytes()[:60])
    assert cache.has(3) and not cache.has(3, 10) and not cache.has(3) and not path.exists()
