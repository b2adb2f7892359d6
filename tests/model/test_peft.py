"""LoRA on a frozen base (``genome_lm.model.peft``): fresh adapters give the base exactly, an
adapter's output is the naive ``W x + s B A x``, training moves only what it should, bad
settings are one line."""

import fnmatch
import re

import pytest
import torch

from genome_lm.checkpoint import build
from genome_lm.config import load_config
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.errors import GenomeLMError

LORA = ["peft.method=lora", "peft.rank=4", "peft.alpha=8"]


def _tokens(seed=0, B=2, T=96):
    return torch.randint(4, 8, (B, T), generator=torch.Generator().manual_seed(seed))


def _adapted(model):
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_a")}


def test_fresh_adapters_give_the_base_models_logits_bit_for_bit():
    """Against the base with its weights frozen, bit for bit. (megatron-core runs a frozen weight
    through its own op, LinearWithFrozenWeight, whose rounding differs from the trainable path's
    on some inputs: against the unfrozen base the logits agree to about 1e-6 relative.)"""
    base_cfg = load_config("demo-finetune-cpu")
    lora_cfg = load_config("demo-finetune-cpu", LORA)
    with parallel_context() as pg:
        base = build(base_cfg, pg, ParallelSizes()).eval()
        lora = build(lora_cfg, pg, ParallelSizes()).eval()
        with torch.no_grad():
            trainable = base(_tokens()).logits
            for p in base.parameters():
                p.requires_grad_(False)
            want, got = base(_tokens()).logits, lora(_tokens()).logits
    assert torch.equal(want, got)
    torch.testing.assert_close(got, trainable, rtol=1e-5, atol=1e-5)
    adapted = _adapted(lora)
    patterns = lora_cfg.peft.targets
    # every module the default patterns name has an adapter: KDA and MLA projections, every fc1 / fc2
    assert {n for n, _ in lora.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)} == set(adapted)
    kinds = {n.split(".")[-1] for n in adapted}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "linear_fc1", "linear_fc2"}
    assert any(".experts.local_experts." in n for n in adapted) and any(".shared_experts." in n for n in adapted)
    assert all(not p.requires_grad for n, p in lora.named_parameters() if ".lora_" not in n)
    assert all(p.requires_grad for n, p in lora.named_parameters() if ".lora_" in n)


def _naive_delta(module, x, scale):
    b = module.lora_b.reshape(-1, module.lora_b.shape[-1])
    return scale * (x @ module.lora_a.t()) @ b.t()


def test_an_adapter_adds_the_naive_low_rank_product():
    """With random B, each adapted layer's output minus the frozen layer's is s B A x, on fresh
    inputs of uneven length; a GLU fc1's B keeps the [gate; up] halves."""
    cfg = load_config("demo-finetune-cpu", LORA)
    with parallel_context() as pg:
        model = build(cfg, pg, ParallelSizes()).eval()
        gen = torch.Generator().manual_seed(3)
        for name, module in _adapted(model).items():
            with torch.no_grad():
                module.lora_b.copy_(torch.randn(module.lora_b.shape, generator=gen))
            n_in = module.lora_a.shape[1]
            x = torch.randn(37, 1, n_in, generator=gen)
            with torch.no_grad():
                out = module(x)
                out = out[0] if isinstance(out, tuple) else out
                hooks = module._forward_hooks
                saved = dict(hooks)
                hooks.clear()
                plain = module(x)
                plain = plain[0] if isinstance(plain, tuple) else plain
                hooks.update(saved)
            want = plain + _naive_delta(module, x, cfg.peft.alpha / cfg.peft.rank)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6, msg=name)
            if name.endswith("linear_fc1"):
                assert module.lora_b.dim() == 3 and module.lora_b.shape[0] == 2


def test_training_moves_only_the_adapters_and_the_named_tensors(tmp_path):
    """Two optimizer steps: every frozen tensor bit-for-bit unchanged (the expert biases too), no
    optimizer state for it; the adapters and the tensors peft.train names moved."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from genome_lm.train.optim import CPUAdamW

    cfg = load_config("demo-finetune-cpu", [*LORA, "peft.train=['output_layer.weight']"])
    with parallel_context() as pg:
        model = build(cfg, pg, ParallelSizes())
        weights = lambda: [*model.named_parameters(), *((n, b) for n, b in model.named_buffers()  # noqa: E731
                                                        if n.endswith("expert_bias"))]
        before = {n: t.detach().clone() for n, t in weights()}
        ddp = DistributedDataParallel(model.tf_config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                      model, pg_collection=pg)
        optimizer = CPUAdamW(ddp, cfg.train, pg)
        optimizer.set_lr(1e-2)
        for step in range(2):
            ddp.zero_grad_buffer()
            tokens = _tokens(step)
            logits = model(tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            assert optimizer.step()[0]
        held = {id(p) for p in optimizer.optimizer.state}
        experts_moved = False
        for name, t in weights():
            trained = ".lora_" in name or name == "output_layer.weight"
            if not trained:
                assert torch.equal(t, before[name]), name
                assert id(t) not in held, name
            elif ".local_experts." in name:  # a routed expert moves when tokens were routed to it
                experts_moved |= not torch.equal(t, before[name])
            else:
                assert not torch.equal(t, before[name]), name
                assert id(t) in held, name
        assert experts_moved


@pytest.mark.parametrize("sets, message", [
    (["peft.targets=['*.no_such_proj']"], "peft.targets '*.no_such_proj' matches no module"),
    (["peft.train=['*.nothing']"], "peft.train '*.nothing' matches no parameter"),
    (["peft.rank=80"], "peft.rank 80 is larger than"),
    (["peft.targets=['*.kv_b_proj']"], "kv_b_proj is read as a raw weight"),
    (["peft.targets=['*.mlp.router']"], "is a GLMRouter, not a linear projection"),
    (["model.checkpoint=null"], "peft.method=lora adapts a trained base: set model.checkpoint"),
])
def test_bad_settings_are_one_line(sets, message):
    cfg = load_config("demo-finetune-cpu", [*LORA, *sets])
    with parallel_context() as pg, pytest.raises(GenomeLMError, match=re.escape(message)) as err:
        build(cfg, pg, ParallelSizes())
    assert "\n" not in str(err.value)


def test_rank_zero_is_refused_by_the_config():
    with pytest.raises(GenomeLMError, match="peft.rank: Input should be greater than or equal to 1"):
        load_config("demo-finetune-cpu", ["peft.method=lora", "peft.rank=0"])


def test_a_bf16_base_takes_adapters_in_its_dtype():
    """The frozen base held in bf16: adapters in bf16 beside it, gradients only for them, and the
    adapted logits those of the fp32 model with the same adapters to bf16's precision."""
    gen = torch.Generator().manual_seed(8)
    logits = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config("demo-finetune-cpu", [*LORA, f"model.dtype={dtype}", "model.kernel_backend=torch"])
        with parallel_context() as pg:
            model = build(cfg, pg, ParallelSizes())
            torch.manual_seed(1)
            with torch.no_grad():
                for name, module in sorted(_adapted(model).items()):
                    module.lora_b.copy_(torch.randn(module.lora_b.shape, generator=gen.manual_seed(len(name))) * 0.1)
            out = model(_tokens(B=1, T=80)).logits
            logits[dtype] = out.detach().float()
            out.float().logsumexp(-1).mean().backward()
            params = dict(model.named_parameters())
            want = torch.bfloat16 if dtype == "bf16" else torch.float32  # the linears' (mHC and gates stay fp32)
            assert all(m.weight.dtype == m.lora_a.dtype == m.lora_b.dtype == want for m in _adapted(model).values())
            assert all(p.grad is None for n, p in params.items() if ".lora_" not in n)
            assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in params.items() if n.endswith("lora_b")
                       and ".local_experts." not in n)
    scale = logits["fp32"].abs().max()
    assert (logits["bf16"] - logits["fp32"]).abs().max() / scale < 3e-2
