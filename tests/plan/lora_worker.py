"""One rank of the split LoRA count (run by test_peft.py as a subprocess).

    python tests/plan/lora_worker.py RANK WORLD PORT '{"tp": 2}' '{"train": [...]}' OUT
Each rank writes {"lora": its lora_a and lora_b elements, "trainable": its trainable elements}."""

import json
import os
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"

import torch  # noqa: E402

from genome_lm.config import PeftConfig  # noqa: E402
from genome_lm.engine.parallel import ParallelSizes, init_distributed, parallel_context  # noqa: E402
from genome_lm.model import PRESETS  # noqa: E402
from genome_lm.model.model import build_model  # noqa: E402
from genome_lm.model.peft import apply_lora  # noqa: E402


def main(rank: int, world: int, port: int, sizes: dict, peft: dict, out: str) -> None:
    init_distributed(rank, world, init_method=f"tcp://127.0.0.1:{port}")
    sizes = ParallelSizes(**sizes)
    with parallel_context(sizes) as pg:
        torch.manual_seed(0)
        model = build_model(PRESETS["tiny"], pg, sizes, kernel_backend="torch")
        apply_lora(model, PeftConfig(method="lora", **peft))
        counts = {"lora": sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n),
                  "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
        with open(out, "w") as f:
            json.dump(counts, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5]),
         sys.argv[6])
