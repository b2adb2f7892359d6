"""Counting what a model saves for backward, by piece (shared by test_activations.py and the
split-model worker)."""

from collections import defaultdict

import torch


def saved_by_piece(model, ids, indexer_loss="sparse"):
    """Bytes saved during one forward of ``ids`` [B, T + 1] (inputs and targets), by (layer,
    piece) with piece "attention", "mlp" or "rest" (mHC, norms, merges), and "head" (final norm,
    output layer, loss); each storage counted once, parameters left out."""
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

    weights = torch.ones(ids.shape[0], ids.shape[1] - 1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids[:, :-1], indexer_loss=indexer_loss)
        lm_loss(out.logits, ids[:, 1:], weights, global_weight=weights.sum(), indexer_losses=out.indexer_losses,
                tp_group=model.pg.tp)
    for h in hooks:
        h.remove()
    return counts
