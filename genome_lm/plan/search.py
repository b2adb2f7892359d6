"""``genome-lm plan --search``: the layouts and memory switches that fit, ranked by predicted
tokens/s (the memory model says what fits, the time model how fast it runs).

For a model, a sequence length and a cluster (``Hardware``: GPUs, GPU kind, GPUs per node) the
search keeps the config's data, model and training settings (global batch, micro-batch, indexer
loss) and varies:

    layout   tp (up to a node), cp, pp (up to 8, dividing the layers), ep (any divisor of the
             routed experts), etp (1 or 2), whatever the config's own ep and etp; sequence
             parallel whenever tp > 1; the DSA selection shared out, the gradient reduction
             overlapped with backward and the shared expert with the all-to-alls (the time
             model's overlaps: free where they apply); every
             rank's micro-batches whole (global batch / (micro-batch x data parallel))
    memory   recompute (none, selective attention, full, full and nested), activation offload, optimizer
             offload, MoE in the config's chunks (recomputed one by one or not) or whole

The config's ``peft`` section is kept: with ``peft.method: lora`` every candidate is sized and
timed as LoRA on a frozen base (``plan.peft``), and ``--write`` writes the section.

Each switch saves memory and costs time. For one layout the search takes the combinations in
order of how many switches they turn on and skips one that turns on a superset of the switches
of a combination that already fits (it cannot be faster); the rest it sizes, and it times those
that fit. The published setting (the config as the published run ran it: the DSA selection on
every rank, ``published.PUBLISHED_TIME_SETTING``) is timed too, so the table says how far the
best layout is from it and why (the parts of the step that differ most), and so is the config
as given, which for the shipped configs is not the published setting (they share the selection
out); each only where its layout splits the GPUs searched (the published 64-GPU layout, EP 32
x ETP 2, does not split 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

import yaml

from genome_lm.config import PeftConfig, RunConfig
from genome_lm.engine.devices import GPUSpec
from genome_lm.errors import GenomeLMError

from .memory_model import Hardware, busiest, check_split, model_config, with_changes
from .time_model import CONSTANTS, Constants, Timing, estimate_time

TWOS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ETP = (1, 2)  # expert tensor parallel sizes tried (the published run's 2 at most)
# recompute levels, each saving more memory for more time: (recompute, recompute_nested)
RECOMPUTE = (("none", False), ("selective", False), ("full", False), ("full", True))


@dataclass
class Candidate:
    run: RunConfig
    label: str  # "published" for the published setting, "config" for the config as given, else ""
    peak: float  # bytes per GPU, the busiest rank
    fits: bool
    timing: Timing | None = None
    switches: tuple = field(default=())  # the memory switches' levels (for the dominance rule)

    @property
    def tokens_per_s(self) -> float:
        return self.timing.tokens_per_s if self.timing else 0.0

    def layout(self) -> str:
        p = self.run.parallel
        text = f"TP {p.tp} x CP {p.cp}" + (f" x PP {p.pp}" if p.pp > 1 else "") + f", EP {p.ep}"
        return text + (f" x ETP {p.etp}" if p.etp > 1 else "")

    def memory(self) -> str:
        m = self.run.memory
        parts = [f"recompute {m.recompute}{' nested' if m.recompute == 'full' and m.recompute_nested else ''}"
                 if m.recompute != "none" else "no recompute"]
        if m.offload_activations:
            parts.append("offload")
        if m.optimizer_offload:
            parts.append("optimizer offload")
        if m.moe_chunks > 1:
            parts.append(f"MoE in {m.moe_chunks}" + (" recomputed" if m.moe_chunk_recompute else ""))
        if not self.run.parallel.split_dsa_selection:
            parts.append("selection on every rank")
        return ", ".join(parts)

    def bound(self) -> str:
        """The resource with the most time, its share and its largest part, in a few words."""
        resource, share, top = self.timing.bound()
        return f"{resource} {share:.0%}: {top.name}"

    def as_dict(self) -> dict:
        return {"label": self.label, "layout": self.layout(), "memory": self.memory(), "peak_bytes": self.peak,
                "fits": self.fits, "parallel": self.run.parallel.model_dump(),
                "memory_switches": self.run.memory.model_dump(),
                "tokens_per_s": self.tokens_per_s, "step_seconds": self.timing.step_seconds if self.timing else None,
                "bottleneck": self.timing.bottleneck if self.timing else None}


def layouts(run: RunConfig, hw: Hardware):
    """Every (tp, cp, pp, ep, etp) of ``hw.gpus`` GPUs that splits the model and the batch: ep
    any divisor of the routed experts, etp of the experts' width up to ``ETP``, with ep x etp
    x pp dividing the GPUs (the config's own ep and etp play no part)."""
    cfg = model_config(run)
    gpus, tr = hw.gpus, run.train
    sequences = tr.global_batch_size // tr.micro_batch_size
    stages = [pp for pp in range(1, 9) if cfg.num_hidden_layers % pp == 0]  # megatron-core's even split
    eps = [ep for ep in range(1, cfg.n_routed_experts + 1) if cfg.n_routed_experts % ep == 0]
    etps = [etp for etp in ETP if cfg.moe_intermediate_size % etp == 0]
    for tp, cp, pp in product(TWOS, TWOS, stages):
        if tp > hw.gpus_per_node or gpus % (tp * cp * pp) or sequences % (gpus // (tp * cp * pp)):
            continue
        if cfg.linear_num_heads % (tp * cp) or cfg.num_attention_heads % (tp * cp):
            continue
        for ep, etp in product(eps, etps):
            if gpus % (ep * etp * pp):
                continue
            yield {"gpus": gpus, "tp": tp, "cp": cp, "pp": pp, "ep": ep, "etp": etp, "sequence_parallel": tp > 1,
                   "split_dsa_selection": True, "overlap_grad_reduce": True, "moe_shared_expert_overlap": ep > 1}


def memory_settings(run: RunConfig):
    """(levels, memory changes) for every combination of the switches, fewest switches first;
    ``levels`` orders each switch from off (0) up, for the dominance rule."""
    chunks = max(run.memory.moe_chunks, 1)
    moe = [(0, {"moe_chunks": 1, "moe_chunk_recompute": False})]
    if chunks > 1:
        moe += [(1, {"moe_chunks": chunks, "moe_chunk_recompute": False}),
                (2, {"moe_chunks": chunks, "moe_chunk_recompute": True})]
    out = []
    for (r, (recompute, nested)), offload, opt, (m, moe_fields) in product(enumerate(RECOMPUTE), (0, 1), (0, 1), moe):
        changes = {"recompute": recompute, "recompute_modules": ["attention"], "recompute_nested": nested,
                   "offload_activations": bool(offload), "optimizer_offload": bool(opt), **moe_fields}
        out.append(((r, offload, opt, m), changes))
    return sorted(out, key=lambda item: sum(item[0]))


def _dominated(levels: tuple, fitting: list[tuple]) -> bool:
    return any(all(a >= b for a, b in zip(levels, f)) for f in fitting)


def search(run: RunConfig, hw: Hardware, gpu: GPUSpec, constants: Constants = CONSTANTS) -> list[Candidate]:
    """Every fitting candidate, fastest first, with the published setting among them (fitting
    or not: its ``fits`` says) where the config's layout splits the GPUs. ``hw.gpus`` must be
    set. The run's ``peft`` section is kept: a LoRA run is searched as LoRA."""
    from .published import PUBLISHED_TIME_SETTING, setting_words

    if not hw.gpus:
        raise GenomeLMError("plan --search needs --gpus (the cluster to lay the run out on)")
    check_split(model_config(run), run.parallel)
    found: list[Candidate] = []
    for layout in layouts(run, hw):
        fitting: list[tuple] = []
        for levels, changes in memory_settings(run):
            if _dominated(levels, fitting):
                continue
            candidate = with_changes(run, parallel=layout, memory=changes)
            plan = busiest(candidate, hw)
            if plan.fits:
                fitting.append(levels)
                found.append(Candidate(candidate, "", plan.peak, True,
                                       estimate_time(candidate, hw, gpu, constants), levels))
    # the published setting: its memory as the config runs it (each MoE chunk recomputed, which
    # genome-lm adds to fit), its time as the published run was timed (published.py); only where
    # the config's layout splits these GPUs (the published 64-GPU layout does not split 8)
    if _splits(run.parallel, hw.gpus):
        published = with_changes(run, **PUBLISHED_TIME_SETTING)
        plan = busiest(with_changes(run, parallel=PUBLISHED_TIME_SETTING["parallel"]), hw)
        found.append(Candidate(published, "published", plan.peak, plan.fits,
                               estimate_time(published, hw, gpu, constants)))
    # the config as given, unless it is the published setting already
    if setting_words(run) and (given := _as_given(run, hw, gpu, constants)) is not None:
        found.append(given)
    if not any(c.fits and not c.label for c in found):
        raise GenomeLMError(f"no layout of {hw.gpus} {hw.gpu_name} GPUs fits {run.data.seq_len:,}-token sequences "
                            "with any memory switch (try more GPUs or a shorter --seq-len)")
    return sorted(found, key=lambda c: -c.tokens_per_s)


def _splits(p, gpus: int) -> bool:
    """Whether layout ``p`` (a ``ParallelConfig``) splits ``gpus`` as the trainer's process groups
    need (``memory_model.world_size``)."""
    return gpus % (p.tp * p.cp * p.pp) == 0 and gpus % (p.ep * p.etp * p.pp) == 0


def _as_given(run: RunConfig, hw: Hardware, gpu: GPUSpec, constants: Constants) -> Candidate | None:
    """The config itself on the search's GPUs, or None where its layout does not split them or
    its batch as ``layouts`` asks."""
    p = run.parallel
    sequences = run.train.global_batch_size // run.train.micro_batch_size
    if not _splits(p, hw.gpus) or sequences % (hw.gpus // (p.tp * p.cp * p.pp)):
        return None
    plan = busiest(run, hw)
    return Candidate(run, "config", plan.peak, plan.fits, estimate_time(run, hw, gpu, constants))


def differences(best: Timing, other: Timing, top: int = 4) -> list[tuple[str, float, float]]:
    """The parts of the step (by name) whose seconds differ most between two timings:
    (part, seconds in ``best``, seconds in ``other``)."""
    a, b = best.by("name"), other.by("name")
    parts = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0.0) - b.get(k, 0.0)))
    return [(k, a.get(k, 0.0), b.get(k, 0.0)) for k in parts[:top]]


def config_yaml(source_text: str, best: Candidate, note: str) -> str:
    """The config file ``source_text`` with the best candidate's parallel and memory sections,
    headed by ``note`` (comment lines)."""
    tree = yaml.safe_load(source_text) or {}
    tree.setdefault("data", {})["seq_len"] = best.run.data.seq_len
    tree["parallel"] = {k: v for k, v in best.run.parallel.model_dump().items()}
    memory = dict(tree.get("memory") or {})
    memory.update(best.run.memory.model_dump(include={"recompute", "recompute_modules", "recompute_nested",
                                                      "offload_activations", "optimizer_offload", "moe_chunks",
                                                      "moe_chunk_recompute"}))
    if memory["recompute"] != "selective":
        memory.pop("recompute_modules")
    tree["memory"] = memory
    # the peft section as searched (--peft, --set peft.*): its method and the fields not at their defaults
    tree.pop("peft", None)
    if best.run.peft.method != "none":
        peft, defaults = best.run.peft.model_dump(mode="json"), PeftConfig().model_dump(mode="json")
        tree["peft"] = {k: v for k, v in peft.items() if k == "method" or v != defaults[k]}
    header = "".join(f"# {line}\n" if line else "#\n" for line in note.splitlines())
    return header + yaml.safe_dump(tree, sort_keys=False)
