"""The planner's saved bytes per token, piece by piece, against what the real tiny model saves
for backward (saved-tensor hooks during one forward, each storage counted once, parameters
left out)."""

import pytest
import torch

from genome_lm.model import PRESETS
from genome_lm.plan import activations as act
from genome_lm.plan.memory_model import layer_bytes

from .saved import saved_by_piece

T = 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_bytes_per_piece_match_the_model(pg, dtype):
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import build_model

    cfg = PRESETS["tiny"]
    model = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch", dtype=dtype)
    torch.manual_seed(0)
    counts = saved_by_piece(model, torch.randint(4, 8, (1, T + 1)))
    planned = layer_bytes(cfg, act.Shard(a=dtype.itemsize))
    for i, layer in enumerate(planned):
        for piece, want in (("attention", layer.attention), ("mlp", layer.mlp_saved), ("rest", layer.rest)):
            got = counts[(i, piece)] / T
            assert got == pytest.approx(want, rel=0.03), f"layer {i} {layer.kind}/{layer.mlp} {piece}"
    head = counts["head"] / T
    assert head == pytest.approx(act.saved_head(cfg, act.Shard(a=dtype.itemsize)), rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"tp": 2}, {"cp": 2}, {"cp": 2, "split_dsa_selection": False},
                                   {"tp": 2, "sequence_parallel": True}],
                         ids=["tp2", "cp2", "cp2-published-layout", "tp2-sp"])
def test_split_model_saves_what_the_plan_says(tmp_path, sizes):
    """Two gloo processes: rank 0's saved bytes per piece against the plan for that split (heads
    and MoE tokens / tp; tokens / cp with the DSA indexer and selection over the whole sequence;
    with sequence parallel the mHC, norms and merges / tp as well)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from genome_lm.engine.parallel import free_port

    worker = Path(__file__).with_name("split_worker.py")
    out, port, n = tmp_path / "counts.json", free_port(), 512
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), json.dumps(sizes), str(n),
                               str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    counts = json.loads(out.read_text())
    cfg = PRESETS["tiny"]
    shard = act.Shard(tp=sizes.get("tp", 1), cp=sizes.get("cp", 1), sp=sizes.get("sequence_parallel", False),
                      gather_token_inputs=sizes.get("split_dsa_selection", True))
    local = n // shard.cp
    for i, layer in enumerate(layer_bytes(cfg, shard)):
        for piece, want in (("attention", layer.attention), ("mlp", layer.mlp_saved), ("rest", layer.rest)):
            got = counts[f"{i},{piece}"] / local
            assert got == pytest.approx(want, rel=0.05), f"layer {i} {layer.kind}/{layer.mlp} {piece}: {got} vs {want}"
