"""LoRA in the planner (``genome_lm.plan.peft``): the module and parameter names it generates from
the config against the built tiny model, its adapter counts against ``apply_lora``'s (whole and
per rank), what a frozen base saves for backward against saved-tensor hooks, a LoRA step's FLOPs
against torch's counter, and what the memory and time models make of it."""

from __future__ import annotations

import fnmatch
import json
import re

import pytest
import torch

from genome_lm.config import PeftConfig, load_config
from genome_lm.errors import GenomeLMError
from genome_lm.model import PRESETS
from genome_lm.plan import activations as act
from genome_lm.plan import peft as P
from genome_lm.plan.memory_model import Hardware, estimate, layer_bytes, model_config, with_changes
from genome_lm.plan.time_model import ADAM_BYTES, CONSTANTS, estimate_time, gpu_spec

from .saved import saved_by_piece

TINY = PRESETS["tiny"]
# the tiny model with a second dense layer, so that a dense MLP is checked past the first layer
TWO_DENSE = TINY.replace(mlp_layer_types=("dense", "dense", "sparse", "sparse"))
LINEARS = ("Linear", "ColumnParallelLinear", "RowParallelLinear")


def _built(cfg, pg, peft: PeftConfig | None = None, dtype=torch.float32):
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import build_model
    from genome_lm.model.peft import apply_lora

    torch.manual_seed(0)
    model = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch", dtype=dtype)
    if peft is not None:
        apply_lora(model, peft)
    return model


def test_names_are_the_built_models(pg):
    """Every projection (name, whole shape, column / row / replicated), every other module (name,
    class) and every parameter (name, elements) of the tiny model, generated from its config."""
    from genome_lm.model.peft import NOT_TARGETS

    model = _built(TWO_DENSE, pg)
    built = {n: m for n, m in model.named_modules()}
    projections = {n: m for n, m in built.items() if type(m).__name__ in LINEARS}
    ours = {lin.name: lin for lin in P.linears(TWO_DENSE)}
    assert set(ours) == set(projections)
    for name, lin in ours.items():
        module = projections[name]
        assert tuple(module.weight.shape) == (lin.n_out, lin.n_in), name
        kind = {"Linear": "replicated", "ColumnParallelLinear": "column", "RowParallelLinear": "row"}
        assert kind[type(module).__name__] == lin.split, name
        assert lin.expert == (".local_experts." in name) and lin.shared == (".shared_experts." in name)
    others = {n: type(m).__name__ for n, m in built.items() if n not in projections}
    assert others == dict(P.other_modules(TWO_DENSE))
    assert {n: p.numel() for n, p in model.named_parameters()} == {n: k for n, k, _ in P.parameters(TWO_DENSE)}
    assert P.NOT_TARGETS == NOT_TARGETS


CASES = {
    "default": {},
    "fc2": {"targets": ["*.linear_fc2"]},
    "mixed": {"rank": 4, "targets": ["layers.2.*_proj", "*.self_attention.o_proj", "output_layer", "*.indexer.wq_b"],
              "train": ["*.router.weight", "layers.3.mlp.experts.local_experts.2.linear_fc1.weight", "*.attn_hc.fn"]},
    "one-expert": {"targets": ["layers.1.mlp.experts.local_experts.5.*", "*.shared_experts.linear_fc1"],
                   "train": ["embedding.weight", "final_norm.weight"]},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_counts_equal_the_built_model(pg, case):
    """The modules ``apply_lora`` adapts, its lora_a / lora_b elements and what stays trainable,
    against the planner's count from the config (one process: every split whole)."""
    peft = PeftConfig(method="lora", **CASES[case])
    model = _built(TINY, pg, peft)
    layers, head = P.trained(TINY, peft)
    adapted = {n for n, m in model.named_modules() if hasattr(m, "lora_a")}
    assert adapted == {lin.name for lay in (*layers, head) for lin in lay.adapters}
    assert adapted == {n for n, m in model.named_modules() if type(m).__name__ in LINEARS
                       and any(fnmatch.fnmatchcase(n, p) for p in peft.targets)}
    elements = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert elements == sum(P.lora_parameters(TINY, peft).values()) > 0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == sum(P.trainable_split(TINY, peft).values())
    assert sum(P.lora_by_kind(TINY, peft).values()) == elements


def test_adapter_count_by_hand():
    """rank x (in + out) per adapted projection; the default takes KDA q, k, v, o, MLA q_b and o,
    and fc1 / fc2 of every MLP (dense, shared, each routed expert). GLM-5.3-Flash at rank 8:
    1,409,912,832 elements, 2.82 GB in bf16 (docs/plan.md, "How PEFT is counted")."""
    def by_hand(cfg, r=8):
        D, W = cfg.hidden_size, cfg.linear_num_heads * cfg.linear_head_dim
        H = cfg.num_attention_heads
        kda = 3 * r * (D + W) + r * (W + D)
        mla = r * (cfg.q_lora_rank + H * cfg.qk_head_dim) + r * (H * cfg.v_head_dim + D)
        mlp = lambda inner: r * (D + 2 * inner) + r * (inner + D)  # noqa: E731
        total = 0
        for i in range(cfg.num_hidden_layers):
            total += kda if cfg.layer_types[i] == "linear_attention" else mla
            total += mlp(cfg.intermediate_size) if cfg.mlp_layer_types[i] == "dense" else \
                cfg.n_routed_experts * mlp(cfg.moe_intermediate_size) + mlp(cfg.shared_expert_size)
        return total

    lora = PeftConfig(method="lora")
    for cfg in (TINY, PRESETS["glm-5.3-flash"]):
        assert sum(P.lora_parameters(cfg, lora).values()) == by_hand(cfg)
    assert sum(P.lora_parameters(PRESETS["glm-5.3-flash"], lora).values()) == 1_409_912_832
    # the expert part is split as the expert weights are: lora_b of fc1, lora_a of fc2 over ep x etp
    split = P.lora_parameters(PRESETS["glm-5.3-flash"], lora)
    E, layers, r = 288, 42, 8
    assert split["expert"] == E * layers * r * (2 * 2048 + 2048)
    assert split["expert_replicated"] == E * layers * r * (4096 + 4096)


@pytest.mark.parametrize("sets, message", [
    ({"targets": ["*.no_such_proj"]}, "peft.targets '*.no_such_proj' matches no projection"),
    ({"train": ["*.nothing"]}, "peft.train '*.nothing' matches no parameter"),
    ({"rank": 80}, "peft.rank 80 is larger than"),
    ({"targets": ["*.kv_b_proj"]}, "kv_b_proj is read as a raw weight"),
    ({"targets": ["*.mlp.router"]}, "layers.1.mlp.router is a GLMRouter, not a linear projection"),
])
def test_the_planner_refuses_what_apply_lora_refuses(sets, message):
    """The same settings tests/model/test_peft.py has apply_lora refuse, refused from the config
    alone, in one line."""
    with pytest.raises(GenomeLMError, match=re.escape(message)) as err:
        P.trained(TINY, PeftConfig(method="lora", **sets))
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ split layouts
@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"tp": 2, "sequence_parallel": True}, {"ep": 2}, {"etp": 2}, {"pp": 2}],
                         ids=["tp2-sp", "ep2", "etp2", "pp2"])
def test_each_rank_holds_what_the_plan_says(tmp_path, sizes):
    """Two gloo processes: each rank's lora_a / lora_b elements and trainable parameters against
    ``local_count`` of the planner's split (adapters split as their layers, routed experts' over
    expert parallel and expert-tensor parallel, a pipeline stage's layers and head)."""
    import subprocess
    import sys
    from pathlib import Path

    from genome_lm.engine.parallel import free_port

    worker = Path(__file__).with_name("lora_worker.py")
    peft = {"train": ["*.router.weight", "output_layer.weight"]}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), json.dumps(sizes),
                               json.dumps(peft), str(tmp_path / f"{r}.json")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    lora = PeftConfig(method="lora", **peft)
    tp, ep, etp = sizes.get("tp", 1), sizes.get("ep", 1), sizes.get("etp", 1)
    stages = [range(0, 2), range(2, 4)] if sizes.get("pp") else [range(0, 4), range(0, 4)]
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        layers = stages[rank]
        first, last = layers.start == 0, layers.stop == 4
        want = sum(P.local_count(P.lora_parameters(TINY, lora, layers, first, last), tp, ep, etp))
        assert got["lora"] == want, (rank, got, want)
        want = sum(P.local_count(P.trainable_split(TINY, lora, layers, first, last), tp, ep, etp))
        assert got["trainable"] == want, (rank, got, want)


# ------------------------------------------------------------------------------ activations
SAVED = {
    "default": {},
    "fc2": {"targets": ["*.linear_fc2"]},
    "o_proj+trained": {"targets": ["*.self_attention.o_proj"], "train": ["*.attn_hc.fn", "*.input_layernorm.weight",
                                                                        "*.A_log", "*.o_norm_weight"]},
    "dropout": {"targets": ["*.q_a_proj", "*.kv_a_proj_with_mqa", "*.f_b_proj", "output_layer"], "dropout": 0.1,
                "train": ["final_norm.weight", "*.experts.local_experts.1.linear_fc1.weight"]},
    "embedding": {"train": ["embedding.weight", "*.kv_a_layernorm.weight"]},
    "layer 3 only": {"targets": ["layers.3.self_attention.q_a_proj", "layers.3.mlp.shared_experts.*"]},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(SAVED))
def test_saved_bytes_under_lora_match_the_model(pg, dtype, case):
    """What the tiny model (a second dense layer added) saves for backward under LoRA, piece by
    piece, against the plan: within 1% from the first layer with something trained on, and the
    layers before it save nothing (nothing there needs a gradient). That first layer itself is
    planned as any layer, an upper bound: before its first adapter nothing needs a gradient
    either (docs/plan.md, "How PEFT is counted")."""
    peft = PeftConfig(method="lora", **SAVED[case])
    model = _built(TWO_DENSE, pg, peft, dtype).train()
    T = 1024
    counts = saved_by_piece(model, torch.randint(4, 8, (1, T + 1), generator=torch.Generator().manual_seed(0)))
    s = act.Shard(a=dtype.itemsize)
    inert = P.inert_layers(TWO_DENSE, peft)
    planned = layer_bytes(TWO_DENSE, s, peft=peft, inert=inert)
    first = next(lay.layer for lay in P.trained(TWO_DENSE, peft)[0] if lay.adapters or lay.trained)
    assert inert == (0 if case == "embedding" else first)
    for i, layer in enumerate(planned):
        for piece, want in (("attention", layer.attention), ("mlp", layer.mlp_saved), ("rest", layer.rest)):
            got = counts[(i, piece)] / T
            if i < inert:
                assert got == want == 0, f"layer {i} {piece}"
            elif i == inert and case != "embedding":
                assert got <= want * 1.001, f"layer {i} {piece}: {got} > {want}"
            else:
                assert got == pytest.approx(want, rel=0.01), f"layer {i} {layer.kind}/{layer.mlp} {piece}"
    head = act.saved_head(TWO_DENSE, s) + P.head_change(TWO_DENSE, s, P.trained(TWO_DENSE, peft)[1], peft)
    # (a trained embedding keeps its token ids, 8 bytes a token, which the plan does not count)
    assert counts["head"] / T == pytest.approx(head, rel=0.01 if case != "embedding" else 0.05)


def test_a_partly_trained_indexer_is_counted_whole(pg):
    """An indexer with one trained tensor keeps less than the whole indexer's loss inputs; the
    plan counts them all (an upper bound, within 10% of the DSA layer's attention)."""
    peft = PeftConfig(method="lora", train=["layers.3.self_attention.indexer.wk.weight"])
    counts = saved_by_piece(_built(TINY, pg, peft).train(), torch.randint(4, 8, (1, 1025)))
    want = layer_bytes(TINY, act.Shard(a=4), peft=peft)[3].attention
    assert want * 0.9 < counts[(3, "attention")] / 1024 <= want


# ------------------------------------------------------------------------------ memory and time
def test_the_frozen_base_has_no_gradient_and_no_optimizer_state():
    """The 512k config on 64 B200 without optimizer offload: the parameters are the base's and the
    adapters' in bf16; the fp32 gradient buffer and the optimizer state (fp32 master copy and
    Adam's two moments, sharded over data parallel) hold the adapters only."""
    full = load_config("glm-5.3-flash-512k-64xb200", ["memory.optimizer_offload=false"])
    lora = with_changes(full, peft={"method": "lora"})
    cfg = model_config(full)
    a_dense, a_expert = P.local_count(P.lora_parameters(cfg, lora.peft), tp=8, ep=32, etp=2)
    items = {i.name: i.bytes for i in estimate(lora, Hardware()).device}
    base = {i.name: i.bytes for i in estimate(full, Hardware()).device}
    assert items["parameters"] == pytest.approx(base["parameters"] + 2 * (a_dense + a_expert))
    assert items["gradients (fp32 buffer)"] == pytest.approx(4 * (a_dense + a_expert))
    # dense state over the 8 data x context parallel ranks, expert state over 64 / (32 x 2) = 1
    assert items["optimizer state"] == pytest.approx((a_dense / 8 + a_expert / 1) * (4 + 8))
    assert items["optimizer state"] < base["optimizer state"] / 100


def test_the_time_model_counts_a_frozen_base():
    """Frozen projections do no weight-gradient product (the routed experts' backward 1x their
    forward instead of 2x), the adapters' products and memory traffic are added, the data-parallel
    reduction and the optimizer step cover the trained parameters only."""
    full = load_config("glm-5.3-flash-512k-64xb200", ["memory.optimizer_offload=false", "memory.recompute=none",
                                                      "memory.moe_chunk_recompute=false", "parallel.ep=8",
                                                      "parallel.etp=1"])
    lora = with_changes(full, peft={"method": "lora"})
    hw = Hardware(gpus=64)
    t_full, t_lora = estimate_time(full, hw), estimate_time(lora, hw)
    part = lambda t, name: sum(i.seconds for i in t.items if i.name == name)  # noqa: E731
    assert part(t_lora, "MoE routed experts") == pytest.approx(part(t_full, "MoE routed experts") * 2 / 3)
    # the output layer: forward, the logits again per loss block, and 1x instead of 2x backward
    assert part(t_lora, "output layer") == pytest.approx(part(t_full, "output layer") * 3 / 4)
    traffic = sum(i.seconds for i in t_lora.items if i.name.startswith("LoRA adapters on "))
    assert part(t_lora, "LoRA adapters") > 0 and traffic > 0
    cfg, gpu = model_config(full), gpu_spec("B200")
    dense, experts = P.local_count(P.lora_parameters(cfg, lora.peft), tp=8, ep=8, etp=1)
    dp_dense, dp_expert = 64 // 8, 64 // 8
    hbm = gpu.hbm * CONSTANTS.hbm
    assert part(t_lora, "optimizer step (GPU Adam)") == pytest.approx(
        (dense / dp_dense + experts / dp_expert) * ADAM_BYTES / hbm)
    moved = sum(n * 6 * (d - 1) / d for n, d in ((dense, dp_dense), (experts, dp_expert)))
    nvlink = gpu.nvlink * CONSTANTS.nvlink  # tp x cp x pp = 8 apart: over the network
    network = gpu.network * CONSTANTS.network
    assert part(t_lora, "data parallel (gradients, parameters)") + sum(
        i.seconds for i in t_lora.hidden if i.name.startswith("data parallel")) == pytest.approx(moved / network)
    assert nvlink > network  # (the stride of 8 leaves the node)
    assert t_lora.tokens_per_s > t_full.tokens_per_s


def test_the_plan_names_the_adapters():
    from typer.testing import CliRunner

    from genome_lm.cli import app

    result = CliRunner().invoke(app, ["plan", "--config", "glm-5.3-flash-512k-64xb200", "--peft", "lora", "--json"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    params = next(i for i in report["device"] if i["name"] == "parameters")
    assert "LoRA adapters (rank 8); the base frozen" in params["note"]
    result = CliRunner().invoke(app, ["plan", "--config", "glm-5.3-flash-512k-64xb200", "--peft", "qlora"])
    assert result.exit_code == 1 and result.output.strip() == "error: --peft qlora: expected none or lora"
