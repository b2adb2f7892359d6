"""The planner's saved bytes per token, piece by piece, against what the real tiny model saves
for backward (saved-tensor hooks during one forward, each storage counted once, parameters
left out)."""

from collections import defaultdict

import pytest
import torch

from genome_lm.model import PRESETS
from genome_lm.plan import activations as act
from genome_lm.plan.memory_model import layer_bytes

T = 1024


def saved_by_piece(model, dtype):
    """Bytes saved during one forward, by (layer, piece): attention, mlp, rest (mHC, norms,
    merges); plus "head" (final norm, output layer, loss)."""
    from genome_lm.train.loss import lm_loss

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen, counts = ["head"], set(), defaultdict(int)
    hooks = []
    for i, layer in enumerate(model.layers):
        for name, piece in (("attention", layer.self_attention), ("mlp", layer.mlp)):
            hooks.append(piece.register_forward_pre_hook(lambda m, a, k=(i, name): where.append(k)))
            hooks.append(piece.register_forward_hook(lambda m, a, o: where.pop() and None))
        hooks.append(layer.register_forward_pre_hook(lambda m, a, k=(i, "rest"): where.append(k)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: where.pop() and None))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            counts[where[-1]] += t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)
    ids = torch.randint(4, 8, (1, T + 1))
    weights = torch.ones(1, T)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids[:, :-1], indexer_loss="sparse")
        lm_loss(out.logits, ids[:, 1:], weights, global_weight=weights.sum(), indexer_losses=out.indexer_losses)
    for h in hooks:
        h.remove()
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_bytes_per_piece_match_the_model(pg, dtype):
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import build_model

    cfg = PRESETS["tiny"]
    model = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch", dtype=dtype)
    counts = saved_by_piece(model, dtype)
    planned = layer_bytes(cfg, act.Shard(a=dtype.itemsize))
    for i, layer in enumerate(planned):
        for piece, want in (("attention", layer.attention), ("mlp", layer.mlp_saved), ("rest", layer.rest)):
            got = counts[(i, piece)] / T
            assert got == pytest.approx(want, rel=0.03), f"layer {i} {layer.kind}/{layer.mlp} {piece}"
    head = counts["head"] / T
    assert head == pytest.approx(act.saved_head(cfg, act.Shard(a=dtype.itemsize)), rel=0.05)
