"""Chunked prefill gives the per-token losses of one full forward, in memory bounded by the chunk."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model import get_preset
from genome_lm.model.config import FULL, INDEXED, LINEAR, SHARED
from genome_lm.model.model import build_model
from genome_lm.model.prefill import GrowingBuffer, Prefill, chunked_logits
from tests.conftest import REPO


@pytest.fixture(scope="module")
def pg():
    with parallel_context() as groups:
        yield groups


def _model(pg, seed=0, **changes):
    # initializer_range 0.02 (the full model's): at the tiny-long preset's 0.125 one of tiny-T700's
    # 1,400 queries has its 8th and 9th pool scores 1.4e-7 apart (pools of identical bases), and
    # the chunked and the full forward, which sum in different orders, keep different pools there
    torch.manual_seed(seed)
    return build_model(get_preset("tiny").replace(initializer_range=0.02, **changes), pg, ParallelSizes(),
                       kernel_backend="torch").eval()


# index_topk 32 (8 pools) below the length so the selection matters; a shared DSA layer reuses it
SHARED_STACK = dict(num_hidden_layers=4, layer_types=(LINEAR, INDEXED, INDEXED, LINEAR),
                    indexer_types=(FULL, FULL, SHARED, FULL), mlp_layer_types=("dense", "sparse", "sparse", "sparse"))


@pytest.mark.parametrize("path,seed", [("torch", 0), ("C", 1)])
@pytest.mark.parametrize("changes,T,chunks", [
    ({"index_topk": 32}, 700, (128, 100, 700)),
    ({"index_topk": 32, **SHARED_STACK}, 333, (64, 37)),
], ids=["tiny-T700", "shared-dsa-T333"])
def test_chunked_prefill_equals_full_forward(pg, monkeypatch, changes, T, chunks, path, seed):
    """Fresh random weights and tokens, batch 2, chunk sizes that do and do not divide T or the
    64-token blocks: every chunking gives the full forward's log-probabilities, on the torch path
    and with the C kernels (selection and sparse attention; the prefill then selects in C too).

    Seeds: a chunk's indexer inputs differ from the full forward's in the last bits (matrix
    products over other row counts: queries 1.8e-7, pooled keys 2.5e-6 apart), so a query whose
    8th and 9th pool scores are as close flips. Weights from seed 0 have one under the C
    kernels' arithmetic (tiny-T700, query (0, 143): pools 4 and 29 at 0.0019246850 and
    0.0019246861), so the C case uses seed 1."""
    monkeypatch.setenv("GENOME_LM_NATIVE", "1" if path == "C" else "0")
    model = _model(pg, seed=seed, **changes)
    ids = torch.randint(4, 9, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        full = model(ids).logits.log_softmax(-1)
    for chunk in chunks:
        pieces = [logits for _, logits in chunked_logits(model, ids, chunk)]
        assert [p.shape[1] for p in pieces] == [min(chunk, T - s) for s in range(0, T, chunk)]
        streamed = torch.cat(pieces, 1).log_softmax(-1)
        assert (streamed - full).abs().max().item() < 1e-5, chunk


def test_prefill_continues_across_calls_and_reports_its_cache(pg):
    """Two calls of 50 tokens equal one of 100 (no total_tokens hint: caches grow by doubling);
    the carried DSA cache holds kv_lora_rank + index_head_dim / kpool values per token."""
    cfg = get_preset("tiny").replace(index_topk=16)
    model = _model(pg, index_topk=16)
    ids = torch.randint(4, 9, (1, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
    prefill = Prefill(model)
    out = torch.cat([prefill(ids[:, :50]), prefill(ids[:, 50:])], 1)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    assert prefill.position == 100
    dsa = [c for c in prefill.caches if hasattr(c, "latent")]
    assert len(dsa) == 1 and dsa[0].latent.view().shape == (1, 100, cfg.kv_lora_rank)
    assert dsa[0].pooled.view().shape == (1, 100 // cfg.index_kpool, cfg.index_head_dim)


def test_growing_buffer():
    buf = GrowingBuffer()
    parts = [torch.randn(2, n, 3) for n in (1, 4, 7, 2)]
    for p in parts:
        buf.append(p)
    torch.testing.assert_close(buf.view(), torch.cat(parts, 1), rtol=0, atol=0)
    assert buf.data.shape[1] >= 14


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from genome_lm.engine import quiet_megatron_import
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model
    from genome_lm.model.prefill import Prefill
    torch.set_num_threads(1)

    def peak():
        # the resident high-water mark since the last reset (ru_maxrss would keep the process's
        # lifetime peak, which start-up can set above everything measured here)
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return hwm

    def chunked(model, T, chunk):
        ids = torch.randint(4, 9, (1, T))
        prefill = Prefill(model, total_tokens=T)
        for s in range(0, T, chunk):
            prefill(ids[:, s:s + chunk])
        return prefill.cache_bytes

    with quiet_megatron_import(), parallel_context() as pg:
        model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch").eval()
        peak()
        chunked(model, 512, 256)
        base = peak()
        chunked(model, 2048, 256)
        short = peak()
        cache = chunked(model, 16384, 256)
        long = peak()
        with torch.no_grad():
            model(torch.randint(4, 9, (1, 16384)))
        full = peak()
    print(json.dumps({"base": base, "short": short, "long": long, "full": full, "cache": cache}))
""")


@pytest.mark.slow
def test_chunked_memory_does_not_grow_with_the_window():
    """Peak resident memory (a fresh process): a 16k window in chunks of 256 needs no more than
    a 2k window, apart from the carried DSA keys (2.3 MiB); one full forward of the same 16k
    window does need more, which shows the measurement can see the difference."""
    # glibc raises its mmap threshold as large blocks are freed, after which freed memory stays in a
    # fragmented heap and the peak RSS drifts by tens of MiB between runs; a fixed threshold keeps
    # large tensors in mmap-ed blocks that are returned when freed, so the RSS tracks live memory
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, cwd=REPO,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    grown = m["long"] - m["short"]
    assert m["cache"] < 3 * mib
    assert grown <= m["cache"] + 4 * mib, m
    assert m["full"] - m["long"] > 8 * (max(grown, 0) + 4 * mib), m
    np.testing.assert_array_less(0, m["cache"])
