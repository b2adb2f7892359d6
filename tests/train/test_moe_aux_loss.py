"""The MoE auxiliary load-balancing loss: ``train.moe_aux_loss_coeff`` reaches megatron-core's
router, its gradient reaches the router weights with the global batch's scale, and its value is
logged per step as ``moe_aux_loss``; checked against DeepSeek-V3's formula written out here."""

import pytest
import torch

from genome_lm.config import load_config
from genome_lm.train import trainer
from genome_lm.train.trainer import train


def _config(dataset, out, coeff, steps=2, extra=()):
    return load_config("demo-cpu", [f"data.dataset={dataset}", f"train.out_dir={out}", f"train.steps={steps}",
                                    "data.seq_len=256", "train.global_batch_size=2", "train.warmup_steps=1",
                                    "train.indexer_dense_steps=1", "train.save_every=0", "model.kernel_backend=torch",
                                    f"train.moe_aux_loss_coeff={coeff}", *extra])


def balance_loss(x, weight, topk, per_sequence=True):
    """DeepSeek-V3's balance loss (its eqs. 17-20) on router inputs x [S, B, H] and gate weight
    [E, H]: s = sigmoid(x W^T), s' = s / sum_j s_j, f_i = E / (topk T) * #{t: i in top-k(s_t)},
    P_i = mean_t s'_i, loss = sum_i f_i P_i; per sequence then averaged over the B sequences
    (per_sequence), or over all S * B tokens as one batch."""
    s = torch.sigmoid(x.double() @ weight.double().T)  # [S, B, E]
    if not per_sequence:
        s = s.reshape(-1, 1, s.shape[-1])
    n_tokens, n_experts = s.shape[0], s.shape[-1]
    chosen = torch.zeros_like(s).scatter(-1, s.topk(topk, dim=-1).indices, 1.0)
    f = n_experts / (topk * n_tokens) * chosen.sum(0)  # [B, E]
    p = (s / s.sum(-1, keepdim=True)).mean(0)  # [B, E]
    return (f * p).sum(-1).mean()


def _spy(monkeypatch):
    """Record the router inputs of every forward and each step's router-weight gradients."""
    from genome_lm.model.router import GLMRouterBase
    from genome_lm.train import optim

    inputs, grads = [], []
    build, step = trainer.build, optim.CPUAdamW.step

    def spying_build(*args, **kwargs):
        model = build(*args, **kwargs)
        for name, module in model.named_modules():
            if isinstance(module, GLMRouterBase):
                module.register_forward_hook(
                    lambda m, args, out, name=name: inputs.append((name, args[0].detach().clone(),
                                                                   m.weight.detach().clone())))
        return model

    def spying_step(self):
        grads.append({n[: -len(".weight")]: p.main_grad.detach().clone() for n, p in self.named
                      if n.endswith("router.weight")})
        return step(self)

    monkeypatch.setattr(trainer, "build", spying_build)
    monkeypatch.setattr(optim.CPUAdamW, "step", spying_step)
    return inputs, grads


def test_aux_loss_is_logged_and_reaches_the_router_gradients(small_dataset, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    coeff = 0.5
    inputs, grads = _spy(monkeypatch)
    with_aux = train(_config(small_dataset, tmp_path / "aux", coeff), progress=False)
    aux_inputs, aux_grads = list(inputs), list(grads)
    inputs.clear()
    grads.clear()
    plain = train(_config(small_dataset, tmp_path / "plain", 0), progress=False)

    # (b) coefficient 0: the loss is not computed, so not logged; the router gradients are the LM's
    assert all(m.moe_aux_loss is None for m in plain.history)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'plain' / 'mlflow.db'}")
    assert client.get_metric_history(plain.run_id, "moe_aux_loss") == []
    assert with_aux.history[0].lm_loss == plain.history[0].lm_loss  # same weights, same batches

    # (a) the logged value: per MoE layer and micro-batch the formula on the router's own inputs,
    # summed over the layers, averaged over the 2 micro-batches of step 1
    routers = sorted(aux_grads[0])
    assert len(routers) == 3 and len(aux_inputs) >= 2 * 3  # 3 MoE layers in the tiny preset
    step1 = aux_inputs[:6]
    expected = sum(float(balance_loss(x, w, topk=2)) for _, x, w in step1) / 2
    values = [m.moe_aux_loss for m in with_aux.history]
    assert values[0] == pytest.approx(expected, rel=1e-5)
    assert all(v > 0 for v in values) and len(values) == 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'aux' / 'mlflow.db'}")
    assert [h.value for h in client.get_metric_history(with_aux.run_id, "moe_aux_loss")] == \
        pytest.approx(values, rel=1e-6)
    m = with_aux.history[0]
    assert m.loss == pytest.approx(m.lm_loss + m.indexer_loss + coeff * m.moe_aux_loss, rel=1e-6)

    # ... and its gradient: every router's weight gradient changes; the last MoE layer's (whose
    # output feeds no later auxiliary loss) by coeff x the mean over the micro-batches of
    # d(formula)/d(router weight), the gradient of the run without the loss being the LM's alone
    for name in routers:
        difference = aux_grads[0][name] - grads[0][name]
        assert difference.abs().max() > 1e-3 * grads[0][name].abs().max(), name
    last = routers[-1]
    weight = next(w for n, _, w in step1 if n == last).requires_grad_(True)
    mean = sum(balance_loss(x, weight, topk=2) for n, x, _ in step1 if n == last) / 2
    (expected_grad,) = torch.autograd.grad(coeff * mean, weight)
    torch.testing.assert_close(aux_grads[0][last] - grads[0][last], expected_grad.float(), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("kind", ["seq_aux_loss", "aux_loss"])
def test_router_aux_loss_matches_the_formula(kind, tmp_path):
    """One router on random inputs: the recorded value is the formula's, its gradient is
    coeff x scale x the formula's, and a forward alone records nothing."""
    from genome_lm.checkpoint import build
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.router import GLMRouterBase, take_aux_loss

    coeff, scale = 0.3, 0.25
    cfg = load_config("demo-cpu", [f"train.moe_aux_loss_coeff={coeff}", f"train.moe_aux_loss={kind}",
                                   "model.kernel_backend=torch"])
    with parallel_context() as pg:
        torch.manual_seed(0)
        model = build(cfg, pg, ParallelSizes())
        router = next(m for m in model.modules() if isinstance(m, GLMRouterBase))
        router.aux_loss_grad_scale = scale
        x = torch.randn(24, 3, model.cfg.hidden_size)
        probs, _ = router(x)
        assert float(take_aux_loss(model)) == 0.0  # recorded when the gradient is applied
        (probs * 0).sum().backward()  # the routing's own gradient is zero: only the auxiliary loss's
        recorded = take_aux_loss(model)
        assert float(take_aux_loss(model)) == 0.0  # taken once
        weight = router.weight.detach().clone().requires_grad_(True)
        expected = balance_loss(x, weight, topk=model.cfg.num_experts_per_tok, per_sequence=kind == "seq_aux_loss")
        (expected_grad,) = torch.autograd.grad(coeff * scale * expected, weight)
    assert float(recorded) == pytest.approx(float(expected.detach()), rel=1e-5)
    torch.testing.assert_close(router.weight.grad, expected_grad.float(), rtol=1e-4, atol=1e-8)

