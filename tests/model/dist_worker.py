"""One rank of a multi-process model check (run by test_parallel.py as a subprocess).

    python tests/model/dist_worker.py RANK WORLD PORT JSON
JSON: {"hf": checkpoint dir, "sizes": {"tp": 2, "cp": 2, ...}, "ids": path of a saved id tensor,
       "indexer_loss": "off"|"dense"|"sparse", "out": result file (rank 0 writes it),
       "export": optional dir to export the loaded model to, "query_chunk": DSA queries per block,
       "lora": optional {"targets": [...], "train": [...]}: LoRA (rank 4) on the loaded base, every
       adapter tensor drawn whole from its name and sliced like its layer, so all layouts hold the
       same non-zero adapters}
The first rank of each pipeline stage s writes OUT.stage<s> with torch.save: {"loss": its part
of the loss, "logits": [B, T, V] in natural order (last stage; else None), "grads": {name in the
whole model's numbering: full-size gradient}, "selections": the stage's DSA layers' token
selections [B, T, S] in forward order}; without pipeline parallel that is rank 0 writing
OUT.stage0. Under pipeline parallel ("pp" in sizes) each sequence of the batch is one
micro-batch of genome-lm's 1F1B schedule.
"""

import json
import os
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from genome_lm.checkpoint.huggingface import HFCheckpoint, export_hf_checkpoint, groups_of, load_hf_checkpoint  # noqa: E402
from genome_lm.engine.context_parallel import zigzag_merge, zigzag_split  # noqa: E402
from genome_lm.engine.layout import ep_gather, global_expert_name, tp_gather, tp_slice  # noqa: E402
from genome_lm.engine.parallel import ParallelSizes, init_distributed, parallel_context  # noqa: E402
from genome_lm.model.model import build_model  # noqa: E402
from genome_lm.model.peft import apply_lora  # noqa: E402
from genome_lm.train.optim import allreduce_sequence_parallel_grads  # noqa: E402


def full_grads(model):
    """Every gradient at full size, after the reductions megatron-core's DDP would do: experts
    over the expert-data-parallel group (under tensor parallel, ranks route different tokens)."""
    grads = {}
    expt_dp = model.pg.expt_dp
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if ".experts.local_experts." in name and expt_dp.size() > 1:
            torch.distributed.all_reduce(g, group=expt_dp)
        tp_group, ep_group = groups_of(model, name)
        g = tp_gather(g, p, tp_group, glu=name.endswith("linear_fc1.weight"))
        if ep_group is not None and ep_group.size() > 1:
            parts = ep_gather(g, ep_group)
            local = model.cfg.n_routed_experts // ep_group.size()
            prefix, rest = name.split(".experts.local_experts.")
            j, tail = rest.split(".", 1)
            for r, part in enumerate(parts):
                grads[f"{prefix}.experts.local_experts.{r * local + int(j)}.{tail}"] = part
            continue
        grads[name] = g
    return grads


def add_lora(model, spec):
    """LoRA with every ``lora_a`` and ``lora_b`` random (B non-zero, so the adapters change the
    output): each drawn whole from its whole-model name, this rank keeping its slice."""
    from genome_lm.config import PeftConfig

    apply_lora(model, PeftConfig(method="lora", rank=4, alpha=8, **spec), seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" not in name:
                continue
            tp_group, ep_group = groups_of(model, name)
            key = global_expert_name(model.global_name(name), model.cfg.n_routed_experts, ep_group)
            split = getattr(p, "tensor_model_parallel", False) and tp_group.size() > 1
            shape = list(p.shape)
            if split:
                shape[p.partition_dim] *= tp_group.size()
            gen = torch.Generator().manual_seed(sum(map(ord, key)) * 7919 + len(key))
            full = torch.randn(shape, generator=gen) * 0.3
            p.copy_(tp_slice(full, p, tp_group))


def pipeline(model, pg, spec, all_ids):
    """Forward and backward of this data-parallel replica's share of the batch, one sequence per
    micro-batch, through genome-lm's 1F1B schedule; returns this stage's (loss part, logits or
    None) for the replica. Losses are normalised as in the one-process run: the cross-entropy by
    the whole batch's tokens, the indexer losses (per micro-batch) by the number of micro-batches
    of the whole batch."""
    from genome_lm.train.pipeline import run_1f1b

    dp, cp = pg.dp, pg.cp
    ids = all_ids[dp.rank()::dp.size()]
    rows = ids.shape[0]
    got = {"loss": torch.zeros(()), "logits": [None] * rows}

    def stage(i, streams):
        # context parallel: this rank's zigzag part of the inputs and of the labels
        inputs, labels = (zigzag_split(t, cp.size(), cp.rank()) for t in (ids[i:i + 1, :-1], ids[i:i + 1, 1:]))
        out, losses = model.hidden(inputs if model.pre_process else None, spec.get("indexer_loss", "off"),
                                   streams=streams, positions=inputs.shape[1])
        loss = sum(losses) / all_ids.shape[0] if losses else None
        if model.post_process:
            logits = model.output_layer(out)[0].transpose(0, 1)
            if pg.tp.size() > 1:
                from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

                logits = gather_from_tensor_model_parallel_region(logits, group=pg.tp)
            got["logits"][i] = logits.detach()
            ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            loss = ce / all_ids[:, 1:].numel() + (0 if loss is None else loss)
            out = None
        if loss is not None:
            got["loss"] += loss.detach()
        return out, loss

    run_1f1b(model, rows, model.stream_shape(1, (ids.shape[1] - 1) // cp.size()), stage)
    return got["loss"], torch.cat(got["logits"]) if model.post_process else None


def one_pass(model, pg, spec, all_ids):
    """Forward and backward of this data-parallel replica's share of the batch in one pass;
    returns (loss part, this rank's logits)."""
    dp, cp = pg.dp, pg.cp
    ids = all_ids[dp.rank()::dp.size()]  # data parallel: each replica takes its share of the batch
    # context parallel: each rank takes its zigzag part of the inputs and of the labels
    inputs, labels = (zigzag_split(t, cp.size(), cp.rank()) for t in (ids[:, :-1], ids[:, 1:]))
    out = model(inputs, indexer_loss=spec.get("indexer_loss", "off"))
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    # the indexer losses are per sequence batch, already divided by cp under context parallel
    total = ce / all_ids[:, 1:].numel() + sum(out.indexer_losses) / dp.size()
    total.backward()
    return total.detach().clone(), out.logits.detach()


def whole_logits(logits, pg):
    """This rank's logits -> the batch's, in natural order: the context-parallel zigzag parts
    merged, then the data-parallel replicas' rows (replica r holds rows r, r + dp, ...)."""
    if pg.cp.size() > 1:
        parts = [torch.empty_like(logits) for _ in range(pg.cp.size())]
        torch.distributed.all_gather(parts, logits.contiguous(), group=pg.cp)
        logits = zigzag_merge(parts, dim=1)
    if pg.dp.size() > 1:
        parts = [torch.empty_like(logits) for _ in range(pg.dp.size())]
        torch.distributed.all_gather(parts, logits.contiguous(), group=pg.dp)
        logits = torch.stack(parts, dim=1).flatten(0, 1)
    return logits


def main(rank, world, port, spec):
    init_distributed(rank, world, init_method=f"tcp://127.0.0.1:{port}")
    sizes = ParallelSizes(**spec["sizes"])
    with parallel_context(sizes) as pg:
        cfg = HFCheckpoint(spec["hf"]).config()
        model = build_model(cfg, pg, sizes, kernel_backend="torch", absorbed_mla=spec.get("absorbed", False))
        load_hf_checkpoint(model, spec["hf"])
        if spec.get("lora"):
            add_lora(model, spec["lora"])
        if spec.get("query_chunk"):
            from genome_lm.train.memory import apply_dsa_query_chunk
            apply_dsa_query_chunk(model, spec["query_chunk"])
        selections = []  # every DSA layer's whole-sequence selection, in forward order
        for module in model.modules():
            if getattr(module, "indexer", None) is not None:
                module.register_forward_hook(lambda m, args, out: selections.append(out.idx.clone()))
        if spec.get("export"):
            export_hf_checkpoint(model, spec["export"], like=spec["hf"])
        all_ids = torch.load(spec["ids"])
        loss, logits = (pipeline if sizes.pp > 1 else one_pass)(model, pg, spec, all_ids)
        allreduce_sequence_parallel_grads(model)
        if pg.dp_cp.size() > 1:  # what megatron-core's DDP does for the non-expert parameters
            for name, p in model.named_parameters():
                if ".experts.local_experts." not in name and p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=pg.dp_cp)
        grads = {model.global_name(k): v for k, v in full_grads(model).items()}
        torch.distributed.all_reduce(loss, group=pg.dp_cp)
        if logits is not None:
            logits = whole_logits(logits, pg)
        if torch.distributed.get_global_rank(pg.pp, 0) == 0:  # the first rank of each stage
            torch.save({"loss": float(loss), "logits": logits, "grads": grads, "selections": selections},
                       f"{spec['out']}.stage{pg.pp.rank()}")

if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
