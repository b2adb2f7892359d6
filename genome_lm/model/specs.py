"""megatron-core module specs of the GLM-5.3-Flash layers.

A decoder layer is built from a ``ModuleSpec`` (``megatron.core.transformer.spec_utils``) whose
submodules name the attention and the MLP; the attention's submodules name the parallel linear
classes its projections are made of. The classes come from a megatron-core backend spec
provider: ``LocalSpecProvider`` (torch ``ColumnParallelLinear`` / ``RowParallelLinear``, the
CPU path) or ``TESpecProvider`` (Transformer Engine's ``TEColumnParallelLinear`` /
``TERowParallelLinear``, GPU, the ``gpu`` extra). So one layer definition serves both, the way
megatron-core's own gated delta net and MLA specs do.

    decoder_layer_spec(cfg, i, provider)
      = ModuleSpec(DecoderLayer, DecoderLayerSubmodules(
            attention = ModuleSpec(KDAAttention if i % 4 != 3 else DSAAttention,
                                   AttentionSubmodules(linear_column, linear_row)),
            mlp       = ModuleSpec(MLP, MLPSubmodules(fc1, fc2))        first layers (dense)
                        megatron-core's MoE builder with glm5_next's router   the rest))

The KDA and DSA layers keep their small rank-``head_dim`` / LoRA down-projections as plain
replicated ``nn.Linear`` (every tensor-parallel rank holds them whole), as before.
"""

from __future__ import annotations

from .common import DecoderLayerSubmodules, attention_submodules, is_dense_mlp  # noqa: F401  (is_dense_mlp: callers)
from .config import DENSE, LINEAR, ModelConfig


def attention_spec(cfg: ModelConfig, layer_idx: int, provider):
    """KDA for linear layers (i % 4 != 3 in GLM-5.3-Flash), DSA for the others."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .dsa import DSAAttention
    from .kda import KDAAttention

    module = KDAAttention if cfg.layer_types[layer_idx] == LINEAR else DSAAttention
    return ModuleSpec(module=module, submodules=attention_submodules(provider))


def mlp_spec(cfg: ModelConfig, layer_idx: int, provider):
    """megatron-core's dense ``MLP`` for the first (dense) layers, its MoE layer for the rest,
    with glm5_next's router (``router.router_class``) in place of megatron-core's."""
    if cfg.mlp_layer_types[layer_idx] == DENSE:
        from megatron.core.transformer.mlp import MLP, MLPSubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec

        return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=provider.column_parallel_linear(),
                                                               linear_fc2=provider.row_parallel_linear()))
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    from .router import router_class

    builder = get_moe_module_spec_for_backend(provider, num_experts=cfg.n_routed_experts)
    builder.keywords["submodules"].router = router_class(cfg)
    return builder


def decoder_layer_spec(cfg: ModelConfig, layer_idx: int, provider):
    """The spec of decoder layer ``layer_idx`` (see the module docstring)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .layer import DecoderLayer

    return ModuleSpec(module=DecoderLayer, submodules=DecoderLayerSubmodules(
        attention=attention_spec(cfg, layer_idx, provider), mlp=mlp_spec(cfg, layer_idx, provider)))
