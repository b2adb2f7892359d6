import dataclasses

import pytest

from genome_lm.model import PRESETS, ModelConfig, get_preset
from genome_lm.model.config import INDEXED, LINEAR, parameter_count


def test_default_pattern_is_glm5_next():
    cfg = get_preset("glm-5.3-flash")
    assert cfg.num_kda_layers == 34 and cfg.num_dsa_layers == 11
    assert all((t == INDEXED) == (i % 4 == 3) for i, t in enumerate(cfg.layer_types))
    assert cfg.mlp_layer_types[:3] == ("dense",) * 3 and set(cfg.mlp_layer_types[3:]) == {"sparse"}
    assert cfg.index_kpool == 4  # the released checkpoint, not the config default of 16


def test_published_parameter_counts():
    """docs/design.md, section 2: about 320B parameters in total, 18B active per token."""
    counts = parameter_count(get_preset("glm-5.3-flash"))
    assert 0.95 < counts["total"] / 320e9 < 1.02
    assert 0.93 < counts["active"] / 18e9 < 1.02


def test_presets_differ_only_in_numbers():
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for cfg in PRESETS.values():
        assert {f.name for f in dataclasses.fields(cfg)} == fields
        assert LINEAR in cfg.layer_types and INDEXED in cfg.layer_types
        assert "sparse" in cfg.mlp_layer_types
    slice_ = get_preset("glm-5.3-flash-4layer")
    full = get_preset("glm-5.3-flash")
    assert slice_.layer_types == full.layer_types[:4] and slice_.mlp_layer_types == full.mlp_layer_types[:4]


def test_hf_round_trip_through_transformers_config():
    from transformers import Glm5NextTextConfig

    for cfg in PRESETS.values():
        hf = Glm5NextTextConfig(**cfg.to_hf())
        assert ModelConfig.from_hf(hf.to_dict()) == cfg


def test_from_hf_reads_nested_and_linear_attn_config():
    text = {"hidden_size": 64, "num_hidden_layers": 2, "linear_attn_config": {"num_heads": 2, "head_dim": 8},
            "linear_lower_bound": None}
    cfg = ModelConfig.from_hf({"model_type": "glm5_next", "text_config": text})
    assert (cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim) == (64, 2, 8)
    assert cfg.linear_lower_bound is None
    assert cfg.layer_types == (LINEAR, LINEAR)


@pytest.mark.parametrize("field,value", [("qk_rope_head_dim", 64), ("attention_bias", True)])
def test_unsupported_fields_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf({field: value})


@pytest.mark.parametrize("changes,match", [
    (dict(num_hidden_layers=2, layer_types=("linear_attention",)), "layer_types has 1 entries"),
    (dict(index_topk=10, index_kpool=4), "multiple of index_kpool"),
    (dict(num_hidden_layers=4, indexer_types=("full", "full", "full", "shared")), "layer 2 must be a DSA"),
    (dict(num_hidden_layers=3, layer_types=("indexed_attention",) * 3, indexer_types=("full", "shared", "shared")),
     "layer 1 must be a DSA layer with its own"),
    (dict(num_hidden_layers=1, mlp_layer_types=("moe",)), "mlp_layer_types holds"),
    (dict(n_routed_experts=8, n_group=3), "n_group"),
])
def test_invalid_configs(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**changes)


def test_unknown_preset():
    with pytest.raises(ValueError, match="tiny"):
        get_preset("huge")
