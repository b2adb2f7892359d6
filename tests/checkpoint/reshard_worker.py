"""One rank of a resharding check (run by test_reshard.py as a subprocess).

    python tests/checkpoint/reshard_worker.py RANK WORLD PORT JSON

JSON: {"mode": "reference" | "save" | "load", "sizes": {"tp": 2, ...}, "hf": the start (a Hugging Face folder),
"ids": a saved id tensor, "out": a file for rank 0's result, and
- save: "run": a run folder; the rank takes one AdamW step from the start with an elementwise
  gradient (``fake_grad``: the same for every element whatever the layout, so the step's weights
  and Adam moments are known without reductions) and writes a checkpoint of step 1 there;
- load: "checkpoint", and "expected": {"weights", "exp_avg", "exp_avg_sq"}, Hugging Face folders
  holding what the checkpoint should hold (written by a one-process reference). Each rank loads
  the checkpoint into its model and optimizer and compares every local tensor with the same
  folders loaded by the Hugging Face loader under the same layout (``load_hf_checkpoint``, whose
  slicing is tested apart): bit for bit.
- reference: one process takes the same step and writes "expected" (the three folders).
Rank 0 saves {"logits": the whole batch's logits or None under pipeline parallel} to OUT.
"""

import json
import os
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"

import torch  # noqa: E402

from genome_lm.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from genome_lm.checkpoint.huggingface import HFCheckpoint, export_hf_checkpoint, load_hf_checkpoint  # noqa: E402
from genome_lm.engine.parallel import ParallelSizes, init_distributed, parallel_context  # noqa: E402
from genome_lm.model.model import build_model  # noqa: E402


def fake_grad(p):
    return torch.sin(7.0 * p) + 0.1


def adam(model):
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, foreach=False)


def step(model, opt):
    for p in model.parameters():
        p.grad = fake_grad(p.detach())
    opt.step()


def logits(model, ids):
    if model.pg.pp.size() > 1:
        return None
    with torch.no_grad():
        return model(ids).logits


def main(rank, world, port, spec):
    init_distributed(rank, world, init_method=f"tcp://127.0.0.1:{port}")
    sizes = ParallelSizes(**spec["sizes"])
    ids = torch.load(spec["ids"])
    with parallel_context(sizes) as pg:
        cfg = HFCheckpoint(spec["hf"]).config()
        model = build_model(cfg, pg, sizes, kernel_backend="torch")
        opt = adam(model)
        if spec["mode"] == "reference":  # one process: the step's weights and moments as HF folders
            load_hf_checkpoint(model, spec["hf"])
            step(model, opt)
            export_hf_checkpoint(model, spec["expected"]["weights"])
            for what in ("exp_avg", "exp_avg_sq"):
                moments = build_model(cfg, pg, sizes, kernel_backend="torch")
                load_hf_checkpoint(moments, spec["hf"])  # the expert biases
                with torch.no_grad():
                    for (_, q), p in zip(moments.named_parameters(), model.parameters()):
                        q.copy_(opt.state[p][what])
                export_hf_checkpoint(moments, spec["expected"][what])
        elif spec["mode"] == "save":
            load_hf_checkpoint(model, spec["hf"])
            step(model, opt)
            meta = {"layout": vars(sizes), "model_config": cfg.to_hf()}
            save_checkpoint(spec["run"], 1, model, opt, {"step": 1}, meta)
        else:
            load_checkpoint(spec["checkpoint"], model, opt, layout=vars(sizes))
            expected = {}
            for what, folder in spec["expected"].items():
                reference = build_model(cfg, pg, sizes, kernel_backend="torch")
                load_hf_checkpoint(reference, folder)
                expected[what] = dict(reference.named_parameters())
            checked = 0
            for name, p in model.named_parameters():
                assert torch.equal(p, expected["weights"][name]), name
                for what in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(opt.state[p][what], expected[what][name]), (what, name)
                assert int(opt.state[p]["step"]) == 1
                checked += 1
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    assert torch.equal(b, dict(reference.named_buffers())[name]), name
            assert checked == len(list(model.parameters()))
        out = logits(model, ids)
        if rank == 0:
            torch.save({"logits": out}, spec["out"])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
