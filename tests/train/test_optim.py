import math
from types import SimpleNamespace

import pytest
import torch

from genome_lm.config import TrainConfig
from genome_lm.train.optim import grad_norm, learning_rate


def test_schedule_warmup_then_cosine_to_min():
    t = TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    lrs = [learning_rate(s, t) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone after warm-up
    assert lrs[-1] == pytest.approx(1e-4)
    mid = 10 + (100 - 10 - 1) / 2
    assert learning_rate(int(mid), t) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * int(mid - 10) / 89)))
    const = TrainConfig(steps=5, lr=2e-3, schedule="constant")
    assert {learning_rate(s, const) for s in range(5)} == {2e-3}
    lin = TrainConfig(steps=11, lr=1.0, min_lr=0.0, schedule="linear")
    assert [round(learning_rate(s, lin), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


class _Group:
    def __init__(self, rank=0, size=1):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_grad_norm_counts_replicated_params_once_and_shards_on_every_rank():
    sharded = torch.nn.Parameter(torch.zeros(3))
    sharded.tensor_model_parallel = True
    sharded.grad = torch.tensor([3.0, 0.0, 0.0])
    replicated = torch.nn.Parameter(torch.zeros(2))
    replicated.grad = torch.tensor([0.0, 4.0])
    params = [("a.weight", sharded), ("b.weight", replicated)]
    one = SimpleNamespace(tp=_Group(), expt_tp=_Group(), ep=_Group(), pp=_Group())
    assert grad_norm(params, one) == pytest.approx(5.0)
    # on tensor-parallel rank 1 the replicated parameter is not counted again
    second = SimpleNamespace(tp=_Group(rank=1), expt_tp=_Group(), ep=_Group(), pp=_Group())
    assert grad_norm(params, second) == pytest.approx(3.0)
    # main_grad wins over grad when DDP holds the gradient
    replicated.main_grad = torch.tensor([0.0, 0.0])
    assert grad_norm(params, one) == pytest.approx(3.0)


# ---- the GPU optimizer's settings (megatron-core's optimizer needs CUDA to be built; its
# ---- parameter groups and its config do not)
def test_megatron_weight_decay_groups_follow_the_cpu_optimizers_rule():
    """megatron-core's own parameter groups (the ones get_megatron_optimizer steps) with
    apply_weight_decay_multipliers decay exactly the parameters the CPU optimizer decays: none
    of the 1-D ones (norms, mHC, KDA's A_log and dt_bias)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_standard_config_overrides

    from genome_lm.checkpoint import build
    from genome_lm.config import load_config
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.train.optim import CPUAdamW, apply_weight_decay_multipliers, megatron_optimizer_options

    cfg = load_config("demo-cpu", ["train.weight_decay=0.1"])
    with parallel_context() as pg:
        torch.manual_seed(0)
        model = build(cfg, pg, ParallelSizes())
        ddp = DistributedDataParallel(model.tf_config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model,
                                      pg_collection=pg)
        config = OptimizerConfig(**megatron_optimizer_options(cfg, torch.float32))
        groups = _get_param_groups([ddp], config, get_standard_config_overrides(config))
        apply_weight_decay_multipliers(groups, cfg.train.weight_decay)
        megatron = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
        cpu = {id(p): g["weight_decay"] for g in CPUAdamW(ddp, cfg.train, pg).optimizer.param_groups
               for p in g["params"]}
        names = {id(p): n for n, p in model.named_parameters()}
    assert megatron == cpu
    assert {names[i] for i, wd in megatron.items() if wd == 0.0} >= {n for n in names.values() if "A_log" in n}
    assert set(megatron.values()) == {0.0, 0.1}


@pytest.mark.parametrize("name", ["demo-cpu", "glm-5.3-flash-512k-64xb200", "glm-5.3-flash-1m-64xb200",
                                  "glm-5.3-flash-4layer-1gpu"])
def test_megatron_optimizer_config_checks_gradients_and_offloads_whole(name):
    from megatron.core.optimizer import OptimizerConfig

    from genome_lm.config import load_config
    from genome_lm.train.optim import megatron_optimizer_options

    cfg = load_config(name)
    config = OptimizerConfig(**megatron_optimizer_options(cfg, torch.bfloat16))  # megatron-core's own checks pass
    assert config.loss_scale == 1.0  # a constant grad scaler: megatron-core's inf/NaN check runs in bf16 too
    assert config.use_precision_aware_optimizer == config.optimizer_cpu_offload == cfg.memory.optimizer_offload


def test_checkpoint_before_any_update_saves_no_optimizer_state():
    """All steps skipped so far: Adam has no state, which megatron-core cannot save or reload;
    the checkpoint records that and a resume keeps the fresh optimizer."""
    from genome_lm.train.optim import MegatronOptimizer

    class Inner:
        def __init__(self, state):
            self.state, self.loaded = state, []

        def state_dict(self):
            return {"inner": len(self.state)}

        def load_state_dict(self, state):
            self.loaded.append(state)

    fresh = MegatronOptimizer(Inner({}))
    state = fresh.state_dict()
    assert state == {"optimizer": None, "param_state": [None], "no_step_yet": True}
    fresh.load_state_dict(state)
    assert fresh.optimizer.loaded == []
    stepped = MegatronOptimizer(Inner({"p": {"exp_avg": torch.zeros(1)}}))
    assert stepped.state_dict() == {"optimizer": {"inner": 1}, "param_state": [None]}


def test_lr_scale_freezes_and_slows_the_named_parameters():
    """train.lr_scale: one step from the same weights and gradients, against an optimizer
    without it: the indexer (scale 0) does not move, the rest of the attention (0.5) moves half
    as far (Adam's step is proportional to its rate, weight decay included), everything else the
    same; the schedule's rate is multiplied in every later step too."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from genome_lm.checkpoint import build
    from genome_lm.config import load_config
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.train.optim import CPUAdamW

    scales = {"*.indexer.*": 0.0, "*.self_attention.*": 0.5}
    plain = load_config("demo-cpu", ["train.weight_decay=0.1"])
    scaled = plain.model_copy(update={"train": plain.train.model_copy(update={"lr_scale": scales})})
    moved = {}
    with parallel_context() as pg:
        for name, cfg in (("plain", plain), ("scaled", scaled)):
            torch.manual_seed(0)
            model = build(cfg, pg, ParallelSizes())
            ddp = DistributedDataParallel(model.tf_config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                          model, pg_collection=pg)
            optimizer = CPUAdamW(ddp, cfg.train, pg)
            optimizer.set_lr(1e-3)
            gen = torch.Generator().manual_seed(1)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            for n, p in sorted(model.named_parameters()):
                p.main_grad.copy_(torch.randn(p.shape, generator=gen))
            assert optimizer.step()[0]
            moved[name] = {n: (p.detach() - before[n]) for n, p in model.named_parameters()}
            start = before
            lrs = {g["lr"] for g in optimizer.optimizer.param_groups}
            assert lrs == ({1e-3} if name == "plain" else {1e-3, 5e-4, 0.0})
    indexer = [n for n in moved["plain"] if ".indexer." in n]
    attention = [n for n in moved["plain"] if ".self_attention." in n and ".indexer." not in n]
    assert indexer and attention
    for n, step in moved["plain"].items():
        assert step.abs().max() > 0, n
        if n in indexer:
            assert moved["scaled"][n].abs().max() == 0, n
        elif n in attention:
            ulps = 4 * torch.finfo(torch.float32).eps * start[n].abs() + 1e-9  # the rounding of p + step
            assert ((moved["scaled"][n] - 0.5 * step).abs() <= ulps).all(), n
        else:
            torch.testing.assert_close(moved["scaled"][n], step, rtol=0, atol=0)


def test_lr_scale_patterns_must_match_and_need_the_cpu_optimizer():
    from genome_lm.errors import GenomeLMError
    from genome_lm.train.optim import lr_scales, make_optimizer

    named = [("layers.0.self_attention.q_proj.weight", None), ("layers.0.mlp.router.weight", None)]
    assert lr_scales(named, {"*.mlp.*": 0.1, "*": 2.0}) == {"layers.0.self_attention.q_proj.weight": 2.0,
                                                          "layers.0.mlp.router.weight": 0.1}
    with pytest.raises(GenomeLMError, match=r"'\*\.indexr\.\*' matches no parameter"):
        lr_scales(named, {"*.indexr.*": 0.0})
    cfg = SimpleNamespace(train=SimpleNamespace(lr_scale={"*": 0.5}))
    with pytest.raises(GenomeLMError, match="only the CPU optimizer"):
        make_optimizer(cfg, None, None, SimpleNamespace(distributed_optimizer=True))
    with pytest.raises(ValueError, match="0 \\(frozen\\) or more"):
        TrainConfig(lr_scale={"*": -1.0})


def test_a_resumed_run_keeps_its_configs_lr_scale():
    """The saved groups' numbers come back on resume, but not ``lr_scale`` (issue 54, defect 3:
    a resumed run silently kept the multipliers it was saved with, whatever its config said)."""
    from genome_lm.checkpoint.sharded import optimizer_groups, set_optimizer_groups

    p = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    saved = torch.optim.AdamW([{"params": [p[0]], "lr_scale": 1.0}, {"params": [p[1]], "lr_scale": 0.5}], lr=1e-3,
                              betas=(0.8, 0.9))
    groups = optimizer_groups(saved)
    now = torch.optim.AdamW([{"params": [p[0]], "lr_scale": 1.0}, {"params": [p[1]], "lr_scale": 0.1}], lr=5e-4)
    set_optimizer_groups(now, groups, "ckpt")
    assert [g["lr_scale"] for g in now.param_groups] == [1.0, 0.1]  # the config's
    assert [g["betas"] for g in now.param_groups] == [(0.8, 0.9)] * 2 and now.param_groups[0]["lr"] == 1e-3
