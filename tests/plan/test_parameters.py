"""Parameter counts of the planner: hand-computable, equal to ModelConfig.parameter_count and to
the real tiny model."""

import pytest

from genome_lm.model import PRESETS
from genome_lm.model.config import ModelConfig, parameter_count
from genome_lm.plan.memory_model import parameter_split


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_split_adds_up_to_parameter_count(preset):
    cfg = PRESETS[preset]
    assert sum(parameter_split(cfg).values()) == parameter_count(cfg)["total"]


def test_by_hand_one_dense_kda_layer():
    # 1 KDA layer, dense MLP, hidden 8, 2 heads x 4, conv 2, vocab 10, intermediate 6, 2 streams
    cfg = ModelConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, intermediate_size=6,
                      linear_num_heads=2, linear_head_dim=4, linear_conv_kernel_dim=2, hc_mult=2,
                      layer_types=("linear_attention",), mlp_layer_types=("dense",))
    W = 8  # heads x head dim
    kda_split = 3 * 8 * W + 3 * W * 2 + 2 * 4 * W + 2 + W + 8 * 2 + W * 8  # q,k,v conv f_b g_b A_log dt_bias b o
    kda_replicated = 2 * 8 * 4 + 4  # f_a, g_a, o_norm
    mhc = 2 * ((2 + 2) * 2 * 16 + (2 + 2) * 2 + 3)
    split = parameter_split(cfg)
    assert split == {"tensor": 2 * 10 * 8 + kda_split + 3 * 8 * 6, "replicated": 8 + 2 * 8 + mhc + kda_replicated,
                     "expert": 0}


def test_tiny_equals_the_built_model(pg):
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import build_model

    model = build_model(PRESETS["tiny"], pg, ParallelSizes(), kernel_backend="torch")
    numel = sum(p.numel() for p in model.parameters())
    numel += sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias"))
    split = parameter_split(PRESETS["tiny"])
    assert numel == sum(split.values())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == split["expert"]
