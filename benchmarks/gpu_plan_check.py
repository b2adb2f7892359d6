"""On one GPU: the planner's peak for the GLM-5.3-Flash 4-layer slice next to
``torch.cuda.max_memory_allocated`` for one forward+backward step, at 32k-128k tokens.

    .venv/bin/python benchmarks/gpu_plan_check.py                       # 32k,64k,128k, the shipped config
    .venv/bin/python benchmarks/gpu_plan_check.py --lengths 32k --set memory.offload_activations=false

The model is built with random weights (``configs/glm-5.3-flash-4layer-1gpu.yaml`` without its
checkpoint), bf16, Triton kernels, the config's memory switches applied as the trainer applies
them. Measured: the allocator's peak during the step minus what was allocated before it (the
parameters); planned: the plan's activation peak plus the gradients, which this script keeps
as plain bf16 ``.grad`` tensors (2 bytes per parameter, where the trainer's megatron-core DDP
keeps an fp32 buffer). Not a test: it needs a GPU with about 80 GB free.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from genome_lm.config import load_config
    from genome_lm.plan.measure import measure_gpu_step, planned_gpu_step
    from genome_lm.plan.memory_model import with_changes
    from genome_lm.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="glm-5.3-flash-4layer-1gpu")
    ap.add_argument("--lengths", default="32k,64k,128k")
    ap.add_argument("--set", action="append", default=[], help="section.field=value, as for finetune")
    ap.add_argument("--json")
    a = ap.parse_args()
    base = load_config(a.config, ["model.checkpoint=null", *a.set])
    rows = []
    for T in (parse_size(x) for x in a.lengths.split(",")):
        import torch

        run = with_changes(base, data={"seq_len": T})
        want = planned_gpu_step(run)
        try:
            row = {"seq_len": T, "measured_bytes": measure_gpu_step(run).peak_bytes, "planned_bytes": want}
        except torch.cuda.OutOfMemoryError:  # the plan said so when planned > free memory
            free = torch.cuda.mem_get_info()[1]
            rows.append({"seq_len": T, "planned_bytes": want, "measured_bytes": None})
            print(f"T={T:>8,}: planned {want / 2**30:7.2f} GiB, measured: out of memory "
                  f"({free / 2**30:.0f} GiB GPU)", flush=True)
            torch.cuda.empty_cache()
            continue
        row["ratio"] = row["planned_bytes"] / row["measured_bytes"]
        rows.append(row)
        print(f"T={T:>8,}: planned {row['planned_bytes'] / 2**30:7.2f} GiB, measured "
              f"{row['measured_bytes'] / 2**30:7.2f} GiB (max_memory_allocated), plan/measured x{row['ratio']:.2f}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
