"""KDA against implementations written by others: fla's naive recurrent and chunked KDA, and
transformers' glm5_next torch KDA (chunked and recurrent), each in its own subprocess.

The subprocess matters twice: transformers swaps in fla's Triton kernels when fla is importable
(they fail on CPU), so its process hides fla; and neither oracle shares state with this process.
Tensors travel through torch.save files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
import torch.nn.functional as F

from genome_lm_kernels.kda import kda

from .conftest import assert_rel_close, backend_of

B, H, K, V = 2, 3, 16, 32

# Each oracle reads a list of input dicts and writes, per case, {function name: (o, final state)}.
FLA = """
import sys, torch
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
cases = torch.load(sys.argv[1])
results = []
for x in cases:
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])  # fla applies scale (default K**-0.5), not l2norm
    r = {"naive_recurrent_kda": naive_recurrent_kda(*args, initial_state=x["s0"], output_final_state=True)}
    if x["q"].shape[1] % 64 == 0:  # naive_chunk_kda needs whole chunks
        r["naive_chunk_kda"] = naive_chunk_kda(*args, initial_state=x["s0"], output_final_state=True)
    results.append(r)
torch.save(results, sys.argv[2])
"""

TRANSFORMERS = """
import sys
sys.modules["fla"] = None  # keep glm5_next on its own torch KDA
import torch
from transformers.models.glm5_next import modeling_glm5_next as m
cases = torch.load(sys.argv[1])
results = []
for x in cases:
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    # by name: transformers 5.2x wraps these functions in hub-kernel modules without a __name__
    results.append({
        name: getattr(m, name)(*args, initial_state=x["s0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
        for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
    })
torch.save(results, sys.argv[2])
"""

LENGTHS = (1, 63, 128, 130)


def make_case(T: int, normalise_qk: bool) -> dict:
    gen = torch.Generator().manual_seed(zlib.crc32(f"kda-oracle-{T}-{normalise_qk}".encode()))
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    if normalise_qk:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return dict(
        q=q, k=k, v=torch.randn(B, T, H, V, generator=gen),
        g=-5 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen)),  # glm5_next's safe gate
        beta=torch.sigmoid(torch.randn(B, T, H, generator=gen)),
        s0=torch.randn(B, H, K, V, generator=gen),
    )


def run_oracle(code: str, cases: list[dict], tmp_path) -> list[dict]:
    inp, out = tmp_path / "cases.pt", tmp_path / "results.pt"
    torch.save(cases, inp)
    # One thread: the oracles are loops of tiny ops, which OpenMP threads slow down on 2 busy cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(inp), str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def fla_results(tmp_path_factory):
    pytest.importorskip("fla")
    cases = [make_case(T, normalise_qk=True) for T in LENGTHS]
    return cases, run_oracle(FLA, cases, tmp_path_factory.mktemp("fla"))


@pytest.fixture(scope="module")
def transformers_results(tmp_path_factory):
    pytest.importorskip("transformers")
    cases = [make_case(T, normalise_qk=False) for T in LENGTHS]
    return cases, run_oracle(TRANSFORMERS, cases, tmp_path_factory.mktemp("transformers"))


def ours(x: dict, backend: str, use_qk_l2norm: bool):
    return kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["s0"], output_final_state=True,
               use_qk_l2norm=use_qk_l2norm, backend=backend_of(backend))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("i", range(len(LENGTHS)), ids=[f"B{B}-T{T}-H{H}" for T in LENGTHS])
def test_matches_fla_naive(i, backend, fla_results):
    """fla's naive functions take q, k as given (no l2norm) and apply scale K**-0.5 themselves."""
    cases, results = fla_results
    o, S = ours(cases[i], backend, use_qk_l2norm=False)
    assert results[i], "oracle returned nothing"
    for name, (o_ref, S_ref) in results[i].items():
        assert_rel_close(o, o_ref, torch.float32, f"{name} o")
        assert_rel_close(S, S_ref, torch.float32, f"{name} final state")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("i", range(len(LENGTHS)), ids=[f"B{B}-T{T}-H{H}" for T in LENGTHS])
def test_matches_transformers_glm5_next(i, backend, transformers_results):
    """glm5_next's torch KDA with use_qk_l2norm_in_kernel=True (what its layer passes)."""
    cases, results = transformers_results
    o, S = ours(cases[i], backend, use_qk_l2norm=True)
    assert set(results[i]) == {"chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"}
    for name, (o_ref, S_ref) in results[i].items():
        assert_rel_close(o, o_ref, torch.float32, f"{name} o")
        assert_rel_close(S, S_ref, torch.float32, f"{name} final state")
