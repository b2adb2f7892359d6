"""The layers come from megatron-core module specs: which classes the specs name for each
provider, and that the model really builds what its specs name."""

import importlib.util

import pytest
import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model import get_preset
from genome_lm.model.common import BuildOptions
from genome_lm.model.dsa import DSAAttention
from genome_lm.model.kda import KDAAttention
from genome_lm.model.model import GLM5Model, build_model
from genome_lm.model.specs import attention_spec, decoder_layer_spec, is_dense_mlp


@pytest.fixture
def pg():
    with parallel_context() as groups:
        yield groups


def test_local_specs_name_the_layers_of_each_position():
    cfg = get_preset("tiny")  # KDA, KDA, KDA, DSA; dense MLP first, then MoE
    provider = LocalSpecProvider()
    for i in range(cfg.num_hidden_layers):
        spec = decoder_layer_spec(cfg, i, provider)
        attention = spec.submodules.attention
        assert attention.module is (DSAAttention if i == 3 else KDAAttention)
        assert attention.submodules.linear_column is ColumnParallelLinear
        assert attention.submodules.linear_row is RowParallelLinear
        assert is_dense_mlp(spec.submodules.mlp) == (i == 0)
        if i == 0:
            assert spec.submodules.mlp.module is MLP
        else:
            moe = spec.submodules.mlp.keywords["submodules"]
            assert moe.router.__name__ == "GLMRouter"


def test_transformer_engine_specs_name_te_linears():
    """The GPU provider's spec: Transformer Engine's parallel linears (the classes exist in
    megatron-core whether or not TE is installed; building them needs TE and a GPU)."""
    te = pytest.importorskip("megatron.core.extensions.transformer_engine_spec_provider")
    provider = te.TESpecProvider()
    spec = attention_spec(get_preset("tiny"), 0, provider)
    assert spec.submodules.linear_column is provider.column_parallel_linear()
    assert spec.submodules.linear_row is provider.row_parallel_linear()
    assert spec.submodules.linear_column is not ColumnParallelLinear
    if importlib.util.find_spec("transformer_engine") is not None:  # the gpu extra
        assert spec.submodules.linear_column.__name__ == "TEColumnParallelLinear"


class _TaggedColumn(ColumnParallelLinear):
    built = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).built += 1


class _TaggedRow(RowParallelLinear):
    pass


def test_the_model_builds_what_its_specs_name(pg):
    """Swapping the linear classes in the attention specs changes the built layers (so the
    layers read their specs, not the provider directly), and the weights still load into the
    default model with the same outputs."""
    cfg = get_preset("tiny")
    provider = LocalSpecProvider()
    specs = [decoder_layer_spec(cfg, i, provider) for i in range(cfg.num_hidden_layers)]
    for spec in specs:
        spec.submodules.attention = ModuleSpec(
            module=spec.submodules.attention.module,
            submodules=type(spec.submodules.attention.submodules)(linear_column=_TaggedColumn, linear_row=_TaggedRow))
    torch.manual_seed(0)
    tagged = GLM5Model(cfg, pg, ParallelSizes(), BuildOptions(), layer_specs=specs)
    # per KDA layer q, k, v, f_b, b, g_b; the DSA layer q_b and kv_b
    assert _TaggedColumn.built == 3 * 6 + 2
    assert isinstance(tagged.layers[0].self_attention.q_proj, _TaggedColumn)
    assert isinstance(tagged.layers[3].self_attention.o_proj, _TaggedRow)
    assert isinstance(tagged.layers[1].mlp, MoELayer)
    plain = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch")
    plain.load_state_dict(tagged.state_dict())
    ids = torch.randint(4, 9, (1, 70), generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain(ids).logits, tagged(ids).logits)


def test_wrong_number_of_layer_specs_is_an_error(pg):
    cfg = get_preset("tiny")
    specs = [decoder_layer_spec(cfg, 0, LocalSpecProvider())]
    with pytest.raises(ValueError, match="1 layer specs for 4 layers"):
        GLM5Model(cfg, pg, ParallelSizes(), BuildOptions(), layer_specs=specs)


def test_the_transformer_config_is_megatron_cores_mla_config(pg):
    from megatron.core.transformer import MLATransformerConfig

    cfg = get_preset("glm-5.3-flash")
    from genome_lm.model.common import megatron_config

    tc = megatron_config(cfg, ParallelSizes(), BuildOptions())
    assert isinstance(tc, MLATransformerConfig)
    assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim) == \
        (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, 0, cfg.v_head_dim)
    assert (tc.dsa_indexer_n_heads, tc.dsa_indexer_head_dim, tc.dsa_indexer_topk) == \
        (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk)
