"""The numbers that define a GLM-5.3-Flash text model, in Hugging Face ``glm5_next`` names.

``ModelConfig`` uses the field names of transformers' ``Glm5NextTextConfig`` so that a
checkpoint's ``config.json`` maps onto it one to one (``from_hf``) and back (``to_hf``). The
per-layer lists (which layers are KDA or DSA, dense or MoE, own or shared indexer) are spelled
out, never recomputed in a second place. ``megatron_config`` turns it into the
``MLATransformerConfig`` that megatron-core's linear, MLP and MoE modules read.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"  # Kimi Delta Attention layer
INDEXED = "indexed_attention"  # MLA + DSA layer
DENSE, SPARSE = "dense", "sparse"  # MLP kinds
FULL, SHARED = "full", "shared"  # indexer kinds: own indexer, or reuse the previous full layer's


@dataclass(frozen=True)
class ModelConfig:
    """GLM-5.3-Flash text model (Hugging Face ``glm5_next`` text config field names)."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    intermediate_size: int = 12288  # dense MLP layers
    rms_norm_eps: float = 1e-5
    # MLA without positional encoding (the DSA layers)
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    # lightning indexer
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 16
    # KDA
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0  # None: the softplus gate instead of the safe gate
    # MoE
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    n_group: int = 1  # group-limited routing: experts in n_group groups, the best topk_group kept
    topk_group: int = 1
    router_aux_loss_coef: float = 0.001
    swiglu_limit: float = 10.0
    # mHC hyper-connections
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    # per layer; empty means the glm5_next default pattern
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(INDEXED if i % 4 == 3 else LINEAR for i in range(n)))
        if not self.mlp_layer_types:
            dense = min(3, n)
            object.__setattr__(self, "mlp_layer_types", (DENSE,) * dense + (SPARSE,) * (n - dense))
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", (FULL,) * n)
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot describe a working model."""
        n = self.num_hidden_layers
        for name, allowed in (("layer_types", (LINEAR, INDEXED)), ("mlp_layer_types", (DENSE, SPARSE)),
                              ("indexer_types", (FULL, SHARED))):
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} layers")
            bad = sorted(set(values) - set(allowed))
            if bad:
                raise ValueError(f"{name} holds {bad}; allowed: {list(allowed)}")
        for i, (kind, indexer) in enumerate(zip(self.layer_types, self.indexer_types)):
            # glm5_next hands a selection only from a full DSA layer to the layer right after it
            if kind == INDEXED and indexer == SHARED and (
                    i == 0 or self.layer_types[i - 1] != INDEXED or self.indexer_types[i - 1] != FULL):
                raise ValueError(f"layer {i} shares an indexer, so layer {i - 1} must be a DSA layer with its own")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise ValueError(f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool})")
        if self.n_group < 1 or self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts}) "
                             f"and topk_group ({self.topk_group}) lie in 1..n_group")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok exceeds n_routed_experts")
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
                    "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "hc_mult")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    # ----------------------------------------------------------------------------- derived sizes
    @property
    def num_kda_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    @property
    def num_dsa_layers(self) -> int:
        return self.layer_types.count(INDEXED)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim  # NoPE: no rotary part

    def layer_kind(self, i: int) -> tuple[str, str, str]:
        """Layer ``i``'s attention, indexer and MLP types: layers of one kind have the same
        FLOPs and activation bytes (``flops.step_work`` and the planner compute them once)."""
        return self.layer_types[i], self.indexer_types[i], self.mlp_layer_types[i]

    @property
    def shared_expert_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------- Hugging Face config
    @classmethod
    def from_hf(cls, config: dict | str | Path) -> "ModelConfig":
        """From a glm5_next ``config.json`` (path or dict; the text part of a multimodal one).

        Fields genome-lm does not model are accepted only at the values it implements: a RoPE
        part in MLA, grouped key/value heads, group-limited routing and attention bias raise
        ValueError naming the field."""
        if not isinstance(config, dict):
            config = json.loads(Path(config).read_text())
        text = dict(config.get("text_config") or config)
        unsupported = {"qk_rope_head_dim": 0, "attention_bias": False, "index_kpool_always_select_tail": True}
        for key, expected in unsupported.items():
            if key in text and text[key] not in (expected, None):
                raise ValueError(f"glm5_next config has {key}={text[key]!r}; genome-lm supports only {expected!r}")
        heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
        if heads is not None and kv_heads not in (None, heads):
            raise ValueError(f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads})")
        if (linear := text.get("linear_attn_config")) is not None:
            text.setdefault("linear_head_dim", linear.get("head_dim"))
            text.setdefault("linear_num_heads", linear.get("num_heads"))
            text.setdefault("linear_conv_kernel_dim", linear.get("short_conv_kernel_size"))
            text.setdefault("linear_lower_bound", linear.get("gate_lower_bound"))
        if "num_local_experts" in text:
            text.setdefault("n_routed_experts", text["num_local_experts"])
        if text.get("layer_types"):
            text["layer_types"] = [INDEXED if t == "full_attention" else t for t in text["layer_types"]]
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in text.items() if k in known and v is not None}
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if name in values:
                values[name] = tuple(values[name])
        if "linear_lower_bound" in text:  # None is meaningful here (softplus gate)
            values["linear_lower_bound"] = text["linear_lower_bound"]
        return cls(**values)

    def to_hf(self) -> dict:
        """The glm5_next text-config dict (what ``Glm5NextTextConfig(**d)`` accepts)."""
        d = dataclasses.asdict(self)
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            d[name] = list(d[name])
        d.update(qk_rope_head_dim=0, num_key_value_heads=self.num_attention_heads,
                 attention_bias=False, index_kpool_always_select_tail=True, hidden_act="silu")
        return d

    def summary(self) -> str:
        return (f"{self.num_hidden_layers} layers ({self.num_kda_layers} KDA, {self.num_dsa_layers} DSA), "
                f"hidden {self.hidden_size}, {self.n_routed_experts} experts top-{self.num_experts_per_tok}, "
                f"vocab {self.vocab_size}")


def parameter_count(cfg: ModelConfig) -> dict[str, int]:
    """Total and per-token active parameters, from the config alone (the planner uses this)."""
    h = cfg.hidden_size
    hc = cfg.hc_mult
    kda_w = cfg.linear_num_heads * cfg.linear_head_dim
    kda = (3 * h * kda_w + 3 * kda_w * cfg.linear_conv_kernel_dim + h * cfg.linear_head_dim
           + cfg.linear_head_dim * kda_w
           + kda_w + cfg.linear_num_heads + h * cfg.linear_num_heads + h * cfg.linear_head_dim
           + cfg.linear_head_dim * kda_w + cfg.linear_head_dim + kda_w * h)
    heads = cfg.num_attention_heads
    indexer = (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim
               + 2 * cfg.index_head_dim + h * cfg.index_n_heads + cfg.index_kpool * cfg.index_head_dim
               + cfg.index_head_dim * h)
    mla = (h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * cfg.qk_head_dim
           + h * cfg.kv_lora_rank + cfg.kv_lora_rank
           + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
           + heads * cfg.v_head_dim * h)
    dense = 3 * h * cfg.intermediate_size
    expert = 3 * h * cfg.moe_intermediate_size
    moe_total = cfg.n_routed_experts * expert + 3 * h * cfg.shared_expert_size + cfg.n_routed_experts * (h + 1)
    moe_active = cfg.num_experts_per_tok * expert + 3 * h * cfg.shared_expert_size + cfg.n_routed_experts * h
    mhc = 2 * ((2 + hc) * hc * (hc * h) + (2 + hc) * hc + 3)
    total = active = 0
    for i in range(cfg.num_hidden_layers):
        attn = kda if cfg.layer_types[i] == LINEAR else mla + (indexer if cfg.indexer_types[i] == FULL else 0)
        common = attn + 2 * h + mhc
        if cfg.mlp_layer_types[i] == DENSE:
            total += common + dense
            active += common + dense
        else:
            total += common + moe_total
            active += common + moe_active
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    return {"total": total + embed, "active": active + embed}
