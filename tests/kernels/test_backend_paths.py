"""The backend object decides what every op runs: for each of ``reference``, ``torch`` with the C
kernels, ``torch`` without them and ``triton`` (under Triton's interpreter here), KDA, the DSA
ops (selection, sparse attention, indexer loss) and mHC (Sinkhorn, collapse, merge) run that
backend's implementation and no other (each implementation is wrapped to record that it ran)."""

from __future__ import annotations

import importlib

import pytest
import torch

from genome_lm_kernels import dsa, mhc, resolve_backend
from genome_lm_kernels.kda import kda

M = {name: importlib.import_module(f"genome_lm_kernels.{name}") for name in (
    "kda.reference", "kda.chunked", "kda.native", "kda.triton", "dsa.reference", "dsa.indexer",
    "dsa.sparse_attention", "dsa.loss", "dsa.triton", "mhc.reference", "mhc.recompute", "mhc.native")}

# (module, attribute) -> the label recorded when it runs
SPIES = {
    ("kda.reference", "kda_reference"): "kda:reference", ("kda.chunked", "kda_chunked"): "kda:torch",
    ("kda.native", "kda_native"): "kda:C", ("kda.triton", "kda_triton"): "kda:triton",
    ("dsa.reference", "select_tokens"): "select:reference", ("dsa.indexer", "native_select"): "select:C",
    ("dsa.indexer", "torch_scores"): "select:torch", ("dsa.triton", "pool_scores_chunk"): "select:triton",
    ("dsa.reference", "sparse_attention"): "attention:reference", ("dsa.triton",
                                                                   "sparse_attention"): "attention:triton",
    ("dsa.reference", "indexer_loss"): "loss:reference",
    ("mhc.reference", "sinkhorn"): "sinkhorn:reference", ("mhc.native", "sinkhorn_c"): "sinkhorn:C",
    ("mhc.recompute", "steps"): "sinkhorn:torch",
}

EXPECTED = {
    "reference": {"kda:reference", "select:reference", "attention:reference", "loss:reference",
                  "sinkhorn:reference", "mhc-products:torch ops"},
    "torch-C": {"kda:C", "select:C", "attention:C", "loss:C", "sinkhorn:C", "mhc-products:C"},
    "torch": {"kda:torch", "select:torch", "attention:torch", "loss:torch", "sinkhorn:torch", "mhc-products:torch ops"},
    "triton": {"kda:triton", "select:triton", "attention:triton", "loss:torch", "sinkhorn:torch",
               "mhc-products:torch ops"},
}


def _backend(name: str):
    if name == "torch-C":
        return resolve_backend("torch", "cpu", native=True)
    if name == "torch":
        return resolve_backend("torch", "cpu", native=False)
    return resolve_backend(name, "cpu")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_op_runs_what_the_backend_says(name, monkeypatch, generator):
    ran: set[str] = set()
    for (module, attr), label in SPIES.items():
        original = getattr(M[module], attr)
        monkeypatch.setattr(M[module], attr, lambda *a, _f=original, _l=label, **k: ran.add(_l) or _f(*a, **k))
    sparse = M["dsa.sparse_attention"].SparseAttention
    monkeypatch.setattr(sparse, "apply", lambda *a, _f=sparse.apply: ran.add(
        "attention:C" if a[-1] else "attention:torch") or _f(*a))
    for cls, label in (("NativeDenseIndexerLoss", "loss:C"), ("IndexerLoss", "loss:torch")):
        fn = getattr(M["dsa.loss"], cls)
        monkeypatch.setattr(fn, "apply", lambda *a, _f=fn.apply, _l=label: ran.add(_l) or _f(*a))
    for cls in ("Collapse", "Merge"):
        fn = getattr(M["mhc.native"], cls)
        monkeypatch.setattr(fn, "apply", lambda *a, _f=fn.apply: ran.add("mhc-products:C") or _f(*a))
    for fn in ("collapse", "merge"):
        original = getattr(M["mhc.reference"], fn)
        monkeypatch.setattr(M["mhc.reference"], fn,
                            lambda *a, _f=original: ran.add("mhc-products:torch ops") or _f(*a))

    backend = _backend(name)
    r = lambda *s: torch.randn(*s, generator=generator)  # noqa: E731
    B, T, H, D = 1, 64, 2, 16
    kda(r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), -torch.rand(B, T, H, D, generator=generator),
        torch.rand(B, T, H, generator=generator), backend=backend)
    q_idx, k_idx, w = r(B, T, H, D), r(B, T, D), r(B, T, H)
    idx, _ = dsa.select_tokens(q_idx, k_idx, w, kpool=4, topk=16, backend=backend)
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
    dsa.sparse_attention(q, k, v, idx, scale=0.25, backend=backend)
    dsa.indexer_loss(q_idx, k_idx, w, q, k, kpool=4, scale=0.25, backend=backend)  # triton: the torch loss
    streams, pre = r(T, B, 4, D), torch.rand(T, B, 4, generator=generator)
    comb = mhc.sinkhorn(r(T, B, 4, 4), 3, 1e-6, backend=backend)
    mhc.merge(pre, comb, mhc.collapse(pre, streams, backend=backend), streams, backend=backend)
    assert ran == EXPECTED[name]
