"""Named model sizes. One architecture; the presets differ only in numbers.

- ``glm-5.3-flash``: the published GLM-5.3-Flash text model (45 layers, about 320B parameters,
  18B active), with the released checkpoint's k-pool of 4 tokens.
- ``glm-5.3-flash-4layer``: the first four layers of it (3 KDA + 1 DSA, layer 3 MoE), the slice
  SkyRL uses for CI; fits one GPU.
- ``tiny``: the same layer pattern at widths that train on a laptop CPU in minutes, with the DNA
  vocabulary (9 tokens, padded to 16).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from genome_lm.errors import GenomeLMError

from .config import ModelConfig

if TYPE_CHECKING:
    from genome_lm.config import RunConfig

GLM_5_3_FLASH = ModelConfig(index_kpool=4, pad_token_id=154820)

PRESETS: dict[str, ModelConfig] = {
    "glm-5.3-flash": GLM_5_3_FLASH,
    "glm-5.3-flash-4layer": GLM_5_3_FLASH.replace(num_hidden_layers=4, layer_types=(), mlp_layer_types=(),
                                                  indexer_types=()),
    "tiny": ModelConfig(
        vocab_size=16, hidden_size=64, num_hidden_layers=4, intermediate_size=192,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
        index_n_heads=4, index_head_dim=16, index_topk=256, index_kpool=4,
        linear_num_heads=4, linear_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"), pad_token_id=0,
    ),
}
# The long-context recipe's model: tiny, initialised at 1/sqrt(hidden_size) instead of the full
# model's 0.02 (tuned for a width of 6,144). At 0.02 a 64-wide model's attention logits start near
# zero and the DSA layer's query path gets ~1e-3 of the KDA layers' gradient; on a copy task (a
# 64-base unit repeated) it copies (0.03 nats/base) after 700 steps at 0.125 and not at all at 0.02.
PRESETS["tiny-long"] = PRESETS["tiny"].replace(initializer_range=0.125)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}") from None


def model_config(run: RunConfig) -> ModelConfig:
    """The ModelConfig a run (a RunConfig) builds: its checkpoint's config.json when there is one,
    else its preset."""
    ckpt = run.model.checkpoint
    if ckpt and (Path(ckpt) / "config.json").exists():
        return ModelConfig.from_hf(Path(ckpt) / "config.json")
    try:
        return get_preset(run.model.preset)
    except ValueError as exc:
        raise GenomeLMError(str(exc)) from None
