"""Each memory technique gives the loss and gradients of the plain model."""

import pytest
import torch

from genome_lm.config import MemoryConfig
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model import get_preset
from genome_lm.model.model import build_model
from genome_lm.train.loss import lm_loss
from genome_lm.train.memory import apply_memory, offload_saved_tensors


@pytest.fixture(scope="module")
def pg():
    with parallel_context() as groups:
        yield groups


def _step(model, ids, weights, offload=False):
    model.zero_grad(set_to_none=True)
    with offload_saved_tensors(offload, pinned=True):
        out = model(ids[:, :-1], indexer_loss="sparse")
        parts = lm_loss(out.logits, ids[:, 1:], weights, global_weight=weights.sum(),
                        indexer_losses=out.indexer_losses)
        parts.total.backward()
    return parts.total.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


SETTINGS = {
    "recompute-full": dict(recompute="full"),
    "recompute-full-nested": dict(recompute="full", recompute_nested=True),
    "recompute-attention": dict(recompute="selective", recompute_modules=["attention"]),
    "recompute-mlp-moe": dict(recompute="selective", recompute_modules=["mlp", "moe"]),
    "moe-chunks-3": dict(moe_chunks=3),
    "dsa-query-chunk-7": dict(dsa_query_chunk=7),
    "offload": dict(offload_activations=True),
    "all": dict(recompute="full", recompute_nested=True, moe_chunks=4, dsa_query_chunk=64, offload_activations=True),
    "moe-chunk-recompute": dict(moe_chunks=3, moe_chunk_recompute=True),
    "recompute-moe-moe-chunk-recompute": dict(recompute="selective", recompute_modules=["moe"], moe_chunks=3,
                                              moe_chunk_recompute=True),
    "recompute-full-moe-chunk-recompute": dict(recompute="full", moe_chunks=4, moe_chunk_recompute=True),
    "all-moe-chunk-recompute": dict(recompute="full", recompute_nested=True, moe_chunks=4, moe_chunk_recompute=True,
                                    dsa_query_chunk=64, offload_activations=True),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_same_loss_and_gradients(pg, name):
    settings = SETTINGS[name]
    cfg = get_preset("tiny").replace(index_topk=32)
    torch.manual_seed(0)
    plain = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch")
    other = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch")
    other.load_state_dict(plain.state_dict())
    memory = MemoryConfig(**{k: v for k, v in settings.items() if k != "offload_activations"})
    apply_memory(other, memory)
    assert set(dict(other.named_parameters())) == set(dict(plain.named_parameters()))  # names unchanged
    if memory.dsa_query_chunk:
        chunks = {layer.self_attention.query_chunk for layer in other.layers if not layer.is_kda}
        assert chunks == {memory.dsa_query_chunk}
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, 9, (2, 201), generator=g)
    weights = torch.rand(2, 200, generator=g)
    loss_a, grads_a = _step(plain, ids, weights)
    loss_b, grads_b = _step(other, ids, weights, offload=settings.get("offload_activations", False))
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_a)
    assert grads_a.keys() == grads_b.keys()
    for key, ga in grads_a.items():
        err = (ga - grads_b[key]).abs().max() / ga.abs().max().clamp_min(1e-8)
        assert err < 1e-4, (key, err.item())


def _tensors_with_history(model):
    """(path, tensor) for tensors with autograd history that modules (or plain objects they hold,
    such as megatron-core's token dispatcher) keep as attributes after a step."""
    found = []
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            holders = [(key, value)] + ([(f"{key}.{k}", v) for k, v in vars(value).items()]
                                        if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type))
                                        else [])
            found += [(f"{name}.{k}", v) for k, v in holders if torch.is_tensor(v) and v.grad_fn is not None]
    return found


def test_full_recompute_keeps_no_graph_after_the_step(pg):
    """A module attribute with autograd history kept after a recomputed layer's backward holds
    the recomputed graph (about one layer of activations per layer): none may remain."""
    model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch")
    apply_memory(model, MemoryConfig(recompute="full"))
    ids = torch.randint(4, 9, (1, 129))
    _step(model, ids, torch.ones(1, 128))
    assert _tensors_with_history(model) == []


@pytest.mark.parametrize("chunk", [1, 37, 200, 500])
def test_chunked_loss_equals_the_whole_loss(pg, chunk):
    """The output layer and cross-entropy in blocks of ``chunk`` positions (logits recomputed in
    backward) give the loss and every gradient of the loss over all positions at once."""
    from genome_lm.train.loss import chunked_lm_loss

    torch.manual_seed(0)
    model = build_model(get_preset("tiny").replace(index_topk=32), pg, ParallelSizes(), kernel_backend="torch")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 9, (2, 201), generator=g)
    labels = ids[:, 1:].masked_fill(torch.rand(2, 200, generator=g) < 0.1, -100)
    weights = torch.rand(2, 200, generator=g) * (labels >= 0)
    total = weights.sum()

    def run(chunked):
        model.zero_grad(set_to_none=True)
        h, indexer_losses = model.hidden(ids[:, :-1], "sparse")
        if chunked:
            parts = chunked_lm_loss(model.output_layer, h, labels, weights, global_weight=total, chunk=chunk,
                                    indexer_losses=indexer_losses, indexer_coeff=0.3)
        else:
            logits = model.output_layer(h)[0].transpose(0, 1)
            parts = lm_loss(logits, labels, weights, global_weight=total, indexer_losses=indexer_losses,
                            indexer_coeff=0.3)
        parts.total.backward()
        return parts, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (whole, grads_a), (chunked, grads_b) = run(False), run(True)
    assert chunked.lm.item() == pytest.approx(whole.lm.item(), rel=1e-6)
    assert chunked.lm_sum.item() == pytest.approx(whole.lm_sum.item(), rel=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for key, ga in grads_a.items():
        err = (ga - grads_b[key]).abs().max() / ga.abs().max().clamp_min(1e-8)
        assert err < 1e-5, (key, err.item())


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "reselect"])
@pytest.mark.parametrize("name", ["recompute-full", "recompute-full-nested", "recompute-attention", "all"])
def test_recompute_keeps_the_dsa_selection(pg, monkeypatch, name, keep):
    """With ``dsa_keep_selection`` a recomputed DSA layer replays its forward's token selection:
    the indexer selects once per layer and step (without it, once per forward of the layer), and
    loss and gradients stay those of the plain model. Two DSA layers, so that a replay handing one
    layer the other's selection would show."""
    from genome_lm_kernels import dsa as dsa_ops

    cfg = get_preset("tiny").replace(num_hidden_layers=8, index_topk=16, layer_types=(),
                                     mlp_layer_types=("dense",) + ("sparse",) * 7, indexer_types=())
    torch.manual_seed(1)
    plain = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch")
    other = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch")
    other.load_state_dict(plain.state_dict())
    settings = {**SETTINGS[name], "dsa_keep_selection": keep}
    apply_memory(other, MemoryConfig(**{k: v for k, v in settings.items() if k != "offload_activations"}))
    calls = []
    select = dsa_ops.select_tokens
    monkeypatch.setattr(dsa_ops, "select_tokens", lambda *a, **k: calls.append(1) or select(*a, **k))
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(4, 9, (1, 163), generator=g)
    weights = torch.rand(1, 162, generator=g)
    loss_a, grads_a = _step(plain, ids, weights)
    calls.clear()
    loss_b, grads_b = _step(other, ids, weights, offload=settings.get("offload_activations", False))
    forwards = 3 if settings.get("recompute_nested") else 2
    assert len(calls) == (2 if keep else 2 * forwards)
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_a)
    for key, ga in grads_a.items():
        err = (ga - grads_b[key]).abs().max() / ga.abs().max().clamp_min(1e-8)
        assert err < 1e-4, (key, err.item())


# forwards of each MoE chunk per step: forward, (the layer's recompute,) the chunk's recompute; a
# nested or selective-MoE recompute does not checkpoint such a MoE a second time
CHUNK_RECOMPUTE = {
    "alone": (dict(), 2),
    "full": (dict(recompute="full"), 3),
    "full-nested": (dict(recompute="full", recompute_nested=True), 3),
    "selective-moe": (dict(recompute="selective", recompute_modules=["moe"]), 2),
}


@pytest.mark.parametrize("name", CHUNK_RECOMPUTE)
def test_moe_chunk_recompute_runs_each_chunk_again_in_backward(pg, name):
    """With ``moe_chunk_recompute`` each MoE chunk is checkpointed: the router runs once more per
    chunk in backward (on top of a recomputed layer's forward). What it saves in memory is
    measured in tests/plan/test_measured.py."""
    settings, forwards = CHUNK_RECOMPUTE[name]
    torch.manual_seed(0)
    model = build_model(get_preset("tiny").replace(index_topk=32), pg, ParallelSizes(), kernel_backend="torch")
    apply_memory(model, MemoryConfig(moe_chunks=3, moe_chunk_recompute=True, **settings))
    moe_layers = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "router")]
    calls = []
    for moe in moe_layers:
        moe.router.register_forward_hook(lambda *_: calls.append(1))
    _step(model, torch.randint(4, 9, (1, 97)), torch.ones(1, 96))
    assert len(calls) == len(moe_layers) * 3 * forwards
