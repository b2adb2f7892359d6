"""`genome-lm check-logprobs`: training forward vs chunked prefill and transformers' glm5_next."""

import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from tests.model.hf_oracle import make_checkpoint

ROW = re.compile(r"(\w+) T=([\d,]+): mean \|d logprob\| (\S+), max (\S+)")


@pytest.mark.slow
def test_prefill_and_transformers_agree_with_the_training_forward(tmp_path):
    """A random glm5_next checkpoint made by transformers: genome-lm's training forward, its chunked
    prefill (chunks of 64 over 150 and 333 tokens) and transformers' own forward give the same
    log-probabilities within 1e-4 in fp32 (a subprocess: transformers must not see fla here)."""
    ckpt = make_checkpoint(tmp_path / "hf", seed=3)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"COLUMNS": "150", "TORCHDYNAMO_DISABLE": "1"}
    result = subprocess.run([sys.executable, "-m", "genome_lm", "check-logprobs", "--model", str(ckpt),
                             "--lengths", "150,333", "--chunk", "64"], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = {(p, int(t.replace(",", ""))): (float(mean), float(mx)) for p, t, mean, mx in ROW.findall(result.stdout)}
    assert set(rows) == {(p, t) for p in ("prefill", "transformers") for t in (150, 333)}, result.stdout
    assert all(0 <= mean <= mx <= 1e-4 for mean, mx in rows.values()), rows
    assert "vllm" in result.stdout and "not run" in result.stdout


def test_a_wrong_inference_path_fails(monkeypatch):
    """Halving the attention scale in the prefill path only: the check reports it and exits 1."""
    import genome_lm.model.prefill as prefill

    original = prefill.absorbed_sparse_attention

    def wrong(*args, scale, **kw):
        return original(*args, scale=scale * 0.5, **kw)

    monkeypatch.setattr(prefill, "absorbed_sparse_attention", wrong)
    result = CliRunner().invoke(app, ["check-logprobs", "--model", "preset:tiny", "--lengths", "300",
                                      "--chunk", "128", "--paths", "prefill"])
    assert result.exit_code == 1, result.output
    assert "differ" in result.output and "prefill T=300" in result.output
