"""The one training step (``genome_lm.train.step``): the planner's measured step
(``plan.measure.train_step`` on a model from ``plan.measure.build_measured``, what its workers
run) and the trainer's (``Trainer._forward_backward``) give the same losses and gradients for
the same micro-batches and switches; ``memory.loss_chunk`` reaches the loss from both; ``bench
model``'s step reports the plain mean next-token cross-entropy that transformers reports."""

import pytest
import torch

from genome_lm.config import load_config
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.plan import measure
from genome_lm.plan.memory_model import with_changes
from genome_lm.train import step as step_mod

T = 256
SETTINGS = {  # (memory switches, train fields)
    "plain": ({}, {}),
    "loss-chunk-96": ({"loss_chunk": 96}, {}),  # 3 blocks, the last one short
    "recompute-full": ({"recompute": "full"}, {}),
    "moe-aux-loss": ({}, {"moe_aux_loss_coeff": 0.01}),
}


@pytest.fixture
def chunk_calls(monkeypatch):
    """(positions, block) of each ``chunked_lm_loss`` call a step makes."""
    calls = []
    real = step_mod.chunked_lm_loss

    def spy(output_layer, h_SBD, *args, chunk, **kwargs):
        calls.append((h_SBD.shape[0], chunk))
        return real(output_layer, h_SBD, *args, chunk=chunk, **kwargs)

    monkeypatch.setattr(step_mod, "chunked_lm_loss", spy)
    return calls


@pytest.fixture(scope="module")
def pg():
    with parallel_context() as groups:
        yield groups


def _run(dataset, out, memory=None, train=None):
    # indexer_loss_coeff 0.5: a step that dropped the coefficient (or its share per micro-batch) differs
    run = load_config("demo-cpu", [f"data.dataset={dataset}", f"train.out_dir={out}", f"data.seq_len={T}",
                                   "train.global_batch_size=2", "train.micro_batch_size=1",
                                   "train.indexer_loss_coeff=0.5", "model.kernel_backend=torch"])
    return with_changes(run, memory=memory or {}, train=train or {})


def _trainer_step(run, pg):
    """The trainer's step on its first two micro-batches (after the dense warm-up: the config's
    indexer loss): its loss sums, the batches, and every parameter's gradient (DDP's main_grad)."""
    from genome_lm.engine.backend import current
    from genome_lm.train.trainer import Trainer

    trainer = Trainer(run, pg, ParallelSizes(), current())
    micro, positions = trainer._micro_batches()
    weight = sum(b.loss_weight.sum() for b in micro)
    trainer.ddp.zero_grad_buffer()
    lm_sum, indexer = trainer._forward_backward(micro, run.train.indexer_dense_steps, weight, positions)
    grads = {n: p.main_grad.clone() for n, p in trainer.model.named_parameters()}
    return trainer, micro, float(lm_sum / weight), float(indexer), grads


def _measured_step(run, pg, state, micro):
    """The planner's step (as ``measure._worker`` runs it) on the same weights and micro-batches."""
    model = measure.build_measured(run, pg, ParallelSizes(), n_micro=len(micro))
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    sums = measure.train_step(model, run, micro)
    weight = sum(b.loss_weight.sum() for b in micro)
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    return model, float(sums.lm_sum / weight), float(sums.indexer), grads


@pytest.mark.parametrize("name", list(SETTINGS))
def test_planner_and_trainer_run_the_same_step(small_dataset, tmp_path, pg, chunk_calls, name):
    memory, train = SETTINGS[name]
    run = _run(small_dataset, tmp_path / "run", memory, train)
    trainer, micro, lm_t, idx_t, grads_t = _trainer_step(run, pg)
    assert len(micro) == 2 and micro[0].tokens.shape == (1, T)
    assert float(sum(b.loss_weight.sum() for b in micro)) < 2 * T  # soft-masked and N targets weigh less than 1
    model, lm_m, idx_m, grads_m = _measured_step(run, pg, trainer.model.state_dict(), micro)
    if memory.get("recompute") == "full":  # the same numbers either way: check that both switched it on
        assert all(getattr(layer, "recomputed", False) for m in (model, trainer.model) for layer in m.layers)
    assert lm_m == pytest.approx(lm_t, rel=1e-7) and idx_m == pytest.approx(idx_t, rel=1e-7)
    assert idx_t > 0  # the sparse indexer loss ran
    # loss_chunk reaches both losses (the chunked loss agrees with the whole one to rounding, so
    # the numbers alone would not tell): each micro-batch of each step in blocks of 96
    assert chunk_calls == ([(T, 96)] * 4 if memory.get("loss_chunk") else [])
    assert grads_m.keys() == grads_t.keys()
    assert sum(int(g.count_nonzero()) for g in grads_t.values()) > 0
    for key, want in grads_t.items():
        torch.testing.assert_close(grads_m[key], want, rtol=1e-6, atol=1e-9, msg=lambda m: f"{key}: {m}")


def test_loss_chunk_reaches_the_planner_step(tmp_path, pg, chunk_calls):
    """With ``memory.loss_chunk`` set the planner's step scores the output layer through
    ``chunked_lm_loss`` in blocks of that many positions (once per micro-batch); unset, not."""
    run = _run(tmp_path / "no-data", tmp_path / "run", {"loss_chunk": 96})  # random batches: no dataset read
    model = measure.build_measured(run, pg, ParallelSizes())
    micro = measure.random_batches(run, 2)
    measure.train_step(model, run, micro)
    assert chunk_calls == [(T, 96)] * 2
    measure.train_step(model, with_changes(run, memory={"loss_chunk": None}), micro)
    assert len(chunk_calls) == 2


def test_bench_model_step_reports_the_mean_next_token_cross_entropy(pg):
    """``bench model`` compares genome-lm's loss with transformers' on the same weights: the step
    it runs (all T inputs, no target for the last) must report their plain mean next-token loss."""
    from genome_lm.compare import bench
    from genome_lm.config import MemoryConfig
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model

    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch")
    ids = bench._token_ids(dict(seed=0, B=2, T=64))
    batch = bench._next_token_batch(ids)
    spec = step_mod.StepSpec(memory=MemoryConfig(), mode="off", global_weight=batch.loss_weight.sum())
    sums = step_mod.forward_backward(model, [batch], spec)
    with torch.no_grad():
        want = bench._next_token_loss(model(ids).logits, ids)
    assert float(sums.lm_sum / spec.global_weight) == pytest.approx(float(want), rel=1e-6)
    assert spec.global_weight == 2 * 63
