"""Peak memory of `genome-lm export`: the one-process export from checkpoint pieces (no model
built) against the earlier way, which builds the model, loads the checkpoint into it and exports
from its parameters, on the same checkpoint, each in a fresh process.

The checkpoint is the tiny preset widened (hidden 512, 8 layers, 16 experts: about 330 MB of fp32
weights), written once by one process. Each export reports its peak resident memory above the
process's resident memory after its imports (VmHWM reset there), next to the checkpoint's total
weight bytes and its largest tensor. The streamed export's bound: the largest tensor, one output
shard (64 MiB here) and the window of checkpoint pages mapped between unmaps (64 MiB), plus a
few MiB.

    .venv/bin/python benchmarks/bench_export_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from genome_lm.measure import worker_env

SHARD = 64 * 2**20
WINDOW = 64 * 2**20  # checkpoint.sharded.full_model_tensors' unmap_every

WRITE = r"""
import sys, torch
from genome_lm.checkpoint import save_checkpoint
from genome_lm.engine import quiet_megatron_import
from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.model import get_preset
from genome_lm.model.model import build_model
from genome_lm.config import load_config
cfg = get_preset("tiny").replace(hidden_size=512, num_hidden_layers=8, layer_types=(), mlp_layer_types=(),
                                 indexer_types=(), n_routed_experts=16, intermediate_size=1536,
                                 moe_intermediate_size=512)
run = load_config("demo-cpu", [])
with quiet_megatron_import(), parallel_context() as pg:
    torch.manual_seed(0)
    model = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch")
    meta = {"config": run.resolved(), "layout": vars(ParallelSizes()), "model_config": cfg.to_hf()}
    save_checkpoint(sys.argv[1], 1, model, None, {"step": 1}, meta)
"""

EXPORT = r"""
import json, sys, torch
from genome_lm.engine import quiet_megatron_import
with quiet_megatron_import():
    import genome_lm.train.export as export
    from genome_lm.checkpoint.huggingface import export_hf_checkpoint
    from genome_lm.model.model import build_model
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
from genome_lm.measure import reset_high_water, status_bytes
reset_high_water()  # the imports' peak does not count
base = status_bytes("VmRSS")
folder, out, how, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if how == "pieces":
    export.export_run(folder, out, max_shard_bytes=shard)
else:  # the earlier way: the model built, the checkpoint loaded into it, exported from it
    from genome_lm.checkpoint import load_checkpoint, verify
    from genome_lm.model.config import ModelConfig
    meta = verify(__import__("pathlib").Path(folder))
    with parallel_context() as pg:
        model = build_model(ModelConfig.from_hf(meta["model_config"]), pg, ParallelSizes(), kernel_backend="torch")
        load_checkpoint(folder, model, None)
        export_hf_checkpoint(model, out, max_shard_bytes=shard)
print(json.dumps({"peak_above_start": status_bytes("VmHWM") - base}))
"""


def main() -> None:
    env = worker_env(extra={"MALLOC_MMAP_THRESHOLD_": str(2**20), "MALLOC_TRIM_THRESHOLD_": str(2**20)})
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-c", WRITE, f"{tmp}/run"], env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        folder = Path(tmp) / "run" / "checkpoints" / "step-000001"
        index = json.loads((folder / "meta.json").read_text())["tensors"]
        sizes = {k: 4 * eval("*".join(map(str, e["shape"])) or "1") for k, e in index.items()}
        total, largest = sum(sizes.values()), max(sizes.values())
        print(f"checkpoint: {len(sizes)} tensors, {total / 2**20:,.0f} MiB of weights, largest tensor "
              f"{largest / 2**20:,.1f} MiB; output shards of {SHARD / 2**20:.0f} MiB")
        peaks = {}
        for how in ("model", "pieces"):
            proc = subprocess.run([sys.executable, "-c", EXPORT, str(folder), f"{tmp}/out-{how}", how, str(SHARD)],
                                  check=True, env=env, capture_output=True, text=True)
            peaks[how] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_above_start"]
            print(f"  export {how:>6}: peak {peaks[how] / 2**20:,.0f} MiB above start "
                  f"({peaks[how] / total:.2f} x the weights)")
        bound = largest + SHARD + WINDOW
        print(f"pieces / model: x{peaks['pieces'] / peaks['model']:.2f}; pieces against one tensor + one output shard "
              f"+ the mapped window ({bound / 2**20:,.0f} MiB): {peaks['pieces'] / 2**20 - bound / 2**20:+,.0f} MiB")


if __name__ == "__main__":
    main()
