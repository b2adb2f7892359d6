"""The "fla" KDA backend: fla-core's ``chunk_kda`` behind ``kda()``'s contract.

fla-core's kernels need a GPU (under Triton's interpreter they fail: its loops call ``.to`` on
Python ints), so on a CPU the adapter is checked against a stand-in with ``chunk_kda``'s
documented signature that computes with the reference; on a GPU the real kernels are compared
with the reference (and ``genome-lm preflight`` times them)."""

from __future__ import annotations

import pytest
import torch

from genome_lm_kernels.kda import kda, l2norm
from genome_lm_kernels.kda.reference import kda_reference

from .conftest import DEVICE, assert_rel_close, backend_of
from .test_kda import make_inputs


def test_adapter_passes_fla_what_it_documents(generator, monkeypatch):
    """q, k unnormalised with use_qk_l2norm_in_kernel, the scale, an fp32 initial state, and the
    final state asked for; o in q's dtype and the state back as fp32."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    from genome_lm_kernels.kda.fla import kda_fla

    seen = {}

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
        seen.update(scale=scale, l2=use_qk_l2norm_in_kernel, final=output_final_state, kwargs=kwargs,
                    dtypes=(q.dtype, g.dtype, beta.dtype, None if initial_state is None else initial_state.dtype))
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q.float()), l2norm(k.float())
        o, S = kda_reference(q, k, v, g, beta, scale, initial_state)
        return o.to(q.dtype), (S if output_final_state else None)

    monkeypatch.setattr(fla_kda, "chunk_kda", chunk_kda)
    x = {n: t.detach() for n, t in make_inputs(2, 70, 2, 16, 16, generator, normalised_k=False).items()}
    o, S = kda_fla(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"], use_qk_l2norm=True)
    assert seen == dict(scale=0.3, l2=True, final=True, kwargs={},
                        dtypes=(torch.float32, torch.float32, torch.float32, torch.float32))
    want_o, want_S = kda_reference(l2norm(x["q"]), l2norm(x["k"]), x["v"], x["g"], x["beta"], 0.3, x["initial_state"])
    assert_rel_close(o, want_o, torch.float32, "o")
    assert S.dtype == torch.float32
    assert_rel_close(S, want_S, torch.float32, "final state")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="fla-core's Triton kernels need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fla_matches_reference_on_gpu(dtype, generator):
    pytest.importorskip("fla.ops.kda")
    x = make_inputs(2, 300, 4, 64, 64, generator, dtype=dtype, normalised_k=False)
    o, S = kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
               use_qk_l2norm=True, backend=backend_of("fla"))
    ref = {n: t.detach().float() for n, t in x.items()}
    o_ref, S_ref = kda(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], initial_state=ref["initial_state"],
                       output_final_state=True, use_qk_l2norm=True, backend=backend_of("reference"))
    assert_rel_close(o, o_ref, torch.bfloat16, "o")
    assert_rel_close(S, S_ref, torch.bfloat16, "final state")
