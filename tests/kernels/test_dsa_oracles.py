"""DSA selection vs transformers' Glm5NextTextIndexer on the same weights.

transformers' glm5_next swaps in fla's Triton KDA kernels when fla is importable, and those
fail on CPU; the oracle therefore runs in a subprocess with fla hidden, so this test process
(which may import fla for the KDA tests) is left alone.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from genome_lm_kernels import dsa
from genome_lm_kernels.dsa import reference

from .conftest import backend_of
from .test_dsa import assert_same_selection

pytest.importorskip("transformers")

ORACLE = textwrap.dedent(
    """
    import sys
    sys.modules["fla"] = None  # keep transformers on its torch KDA path
    import torch
    import torch.nn.functional as F
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    out, T, kpool, topk, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    torch.manual_seed(seed)
    cfg = Glm5NextTextConfig(hidden_size=32, q_lora_rank=16, index_n_heads=4, index_head_dim=16,
                             index_topk=topk, index_kpool=kpool, index_kpool_always_select_tail=True)
    m = Glm5NextTextIndexer(cfg, layer_idx=3).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    x = torch.randn(2, T, 32)
    q_resid = torch.randn(2, T, 16)
    with torch.no_grad():
        idx = m(x, q_resid, torch.ones(2, T, dtype=torch.bool), None)
        inputs = dict(
            q_idx=m.wq_b(q_resid).view(2, T, 4, 16),
            k_idx=m.k_norm(m.wk(x)),
            w_idx=m.weights_proj(x) * 4**-0.5,
            gate=F.linear(x, m.index_kpool_compress_gate),
            ape=m.index_kpool_compress_ape.detach().clone(),
            scale=m.softmax_scale,
        )
    torch.save(dict(idx=idx.long(), **inputs), out)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("T,kpool,topk", [(257, 4, 32), (257, 16, 64), (65, 4, 2048), (130, 16, 32)],
                         ids=lambda v: str(v))
def test_selection_matches_transformers(tmp_path, T, kpool, topk):
    out = tmp_path / "oracle.pt"
    subprocess.run([sys.executable, "-c", ORACLE, str(out), str(T), str(kpool), str(topk), str(T + kpool)],
                   check=True, timeout=120)
    o = torch.load(out)
    hf_idx = o["idx"]
    assert hf_idx.shape == (2, T, topk + kpool - 1)
    args = (o["q_idx"], o["k_idx"], o["w_idx"], o["gate"], o["ape"])
    kp = reference.pool_keys(o["k_idx"], o["gate"], o["ape"], kpool)
    scores = reference.index_scores(o["q_idx"], kp, o["w_idx"], kpool, o["scale"])
    for backend in ("torch", "reference"):
        idx, valid = dsa.select_tokens(*args, kpool=kpool, topk=topk, scale=o["scale"], backend=backend_of(backend),
                                       chunk=64)
        assert_same_selection(idx, hf_idx, scores, kpool=kpool, topk=topk, sorted_pools=False)
        assert torch.equal(valid, idx >= 0)
