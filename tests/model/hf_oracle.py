"""Make random glm5_next checkpoints with transformers, in a subprocess.

transformers' glm5_next must not see flash-linear-attention on a CPU machine (it would swap in
Triton kernels that fail there), and hiding fla inside the pytest process would break the tests
that use it, so checkpoints are made by running this file as a script.

    python tests/model/hf_oracle.py OUT_DIR '{"hidden_size": 32, ...}' SEED
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Small, valid glm5_next text config: 4 layers (3 KDA + 1 DSA), layer 0 dense, the others MoE.
# 16 indexer heads: with few heads many pools score exactly 0 and the top-k has ties, which
# transformers breaks in an unspecified order (genome-lm takes the earlier pool).
TINY_TEXT = dict(
    vocab_size=16, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
    q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8, index_topk=16, index_head_dim=8, index_n_heads=16,
    linear_head_dim=8, linear_num_heads=2, index_kpool=4, pad_token_id=0,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
)
# Overrides of TINY_TEXT that every split of the multi-process tests divides: 4 MLA heads, 4 KDA
# heads (and 4 experts); topk 16 < T, so the selection matters.
SPLIT_TEXT = {"num_attention_heads": 4, "num_key_value_heads": 4, "linear_num_heads": 4, "vocab_size": 16}
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=32, intermediate_size=16,
                   projection_intermediate_size=16)


def make_checkpoint(out: Path, text: dict | None = None, seed: int = 0, timeout: int = 300) -> Path:
    """Write a random transformers glm5_next checkpoint (TINY_TEXT updated by ``text``) to ``out``."""
    config = {**TINY_TEXT, **(text or {})}
    result = subprocess.run([sys.executable, __file__, str(out), json.dumps(config), str(seed)],
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return out


def _main(out: str, text_json: str, seed: str) -> None:
    sys.modules["fla"] = None  # type: ignore[assignment]
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(int(seed))
    model = Glm5NextForConditionalGeneration(
        Glm5NextConfig(text_config=json.loads(text_json), vision_config=TINY_VISION)).eval()
    # transformers initialises norms to 1, biases and gates to 0: move them off those values so
    # that a swapped or skipped tensor changes the output
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "visual" in name:
                continue
            if p.dim() == 1 or name.endswith(("compress_ape", "compress_gate")):
                p.add_(torch.randn_like(p.float()).to(p.dtype) * 0.1)
    model.save_pretrained(out, max_shard_size="50KB")


if __name__ == "__main__":
    _main(*sys.argv[1:4])
