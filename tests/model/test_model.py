"""The model in one process: kernel backends agree, the indexer is trained only by its own loss."""

import pytest
import torch
import torch.nn.functional as F

from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.errors import GenomeLMError
from genome_lm.model import get_preset
from genome_lm.model.model import build_model


@pytest.fixture
def pg():
    with parallel_context() as groups:
        yield groups


def _tiny(pg, backend="torch", **changes):
    torch.manual_seed(0)
    return build_model(get_preset("tiny").replace(**changes), pg, ParallelSizes(), kernel_backend=backend)


def _loss(model, ids, **kw):
    out = model(ids, **kw)
    lm = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return lm, out


def test_reference_and_torch_kernels_give_the_same_model(pg):
    """The whole stack with the token-loop KDA and dense-masked DSA references against the fast
    torch paths, same weights: logits and every gradient. T = 150 is not a multiple of the KDA
    chunk or of the k-pool, and exceeds index_topk so the selection matters."""
    fast = _tiny(pg, "torch", index_topk=32)
    slow = _tiny(pg, "reference", index_topk=32)
    slow.load_state_dict(fast.state_dict())
    ids = torch.randint(4, 9, (2, 150), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (fast, slow):
        lm, out = _loss(model, ids, indexer_loss="sparse")
        (lm + sum(out.indexer_losses)).backward()
        losses.append((lm.item(), out.logits.detach()))
    assert abs(losses[0][0] - losses[1][0]) < 1e-5
    torch.testing.assert_close(losses[0][1], losses[1][1], rtol=1e-4, atol=1e-5)
    for (name, a), (_, b) in zip(fast.named_parameters(), slow.named_parameters()):
        if a.grad is None:
            assert b.grad is None, name
            continue
        scale = b.grad.abs().max().clamp_min(1e-6)
        assert (a.grad - b.grad).abs().max() / scale < 1e-3, name


def test_indexer_is_trained_only_by_the_indexer_loss(pg):
    model = _tiny(pg, index_topk=16)
    ids = torch.randint(4, 9, (1, 100))
    lm, out = _loss(model, ids, indexer_loss="dense")
    assert len(out.indexer_losses) == 1 and torch.isfinite(out.indexer_losses[0])
    lm.backward()
    indexer = {n for n, _ in model.named_parameters() if ".indexer." in n}
    assert indexer
    for name, p in model.named_parameters():
        if name in indexer:
            assert p.grad is None or not p.grad.any(), f"LM loss reached {name}"
    model.zero_grad(set_to_none=True)
    _, out = _loss(model, ids, indexer_loss="sparse")
    out.indexer_losses[0].backward()
    for name, p in model.named_parameters():
        touched = p.grad is not None and bool(p.grad.any())
        if name in indexer and not name.endswith("compress_ape"):
            assert touched, f"indexer loss did not reach {name}"
        if name not in indexer:
            assert not touched, f"indexer loss reached {name}"


def test_logits_are_causal(pg):
    """Changing a later token never changes an earlier logit (KDA conv, recurrence, DSA selection)."""
    model = _tiny(pg, index_topk=16).eval()
    ids = torch.randint(4, 9, (1, 200), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 120:] = 4 + (changed[0, 120:] - 3) % 5
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    # not bit-equal: a different token mix changes GEMM shapes inside the MoE, hence rounding
    assert (a[:, :120] - b[:, :120]).abs().max() < 1e-5
    assert (a[:, 120:] - b[:, 120:]).abs().amax(-1).min() > 1e-3


def test_the_swiglu_limit_clamps(pg):
    """The same weights with a limit the activations exceed give other logits (megatron-core's
    GLU clamps through ``activation_func_clamp_value``); the values themselves are checked
    against transformers in test_parity.py."""
    ids = torch.randint(4, 9, (1, 80), generator=torch.Generator().manual_seed(2))
    free = _tiny(pg)
    clamped = _tiny(pg, swiglu_limit=0.05)
    clamped.load_state_dict(free.state_dict())
    with torch.no_grad():
        assert not torch.allclose(free(ids).logits, clamped(ids).logits, atol=1e-4)
        assert torch.equal(free(ids).logits, _same(pg, free, swiglu_limit=1e4)(ids).logits)


def _same(pg, model, **changes):
    other = _tiny(pg, **changes)
    other.load_state_dict(model.state_dict())
    return other


def test_pipeline_split_follows_megatron_and_refuses_bad_splits():
    """megatron-core's split of the layers into stages, checked for every stage: uneven splits
    and a stage that would start on a DSA layer reusing the previous layer's selection are
    one-line errors."""
    from genome_lm.model.common import BuildOptions, megatron_config
    from genome_lm.model.config import FULL, INDEXED, LINEAR, SHARED
    from genome_lm.model.model import pipeline_split

    def split(cfg, pp):
        return pipeline_split(cfg, megatron_config(cfg, ParallelSizes(pp=pp), BuildOptions()))

    tiny = get_preset("tiny")
    assert split(tiny, 1) == [(0, 4)]
    assert split(tiny, 2) == [(0, 2), (2, 2)]
    assert split(tiny, 4) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    with pytest.raises(GenomeLMError, match="pipeline parallel 3 cannot split the 4 layers"):
        split(tiny, 3)
    shared = tiny.replace(layer_types=(LINEAR, INDEXED, INDEXED, LINEAR), indexer_types=(FULL, FULL, SHARED, FULL))
    assert split(shared, 1) == [(0, 4)]
    with pytest.raises(GenomeLMError, match="stage 1 would start at layer 2, a DSA layer that reuses"):
        split(shared, 2)
