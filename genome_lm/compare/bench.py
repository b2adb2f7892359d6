"""``genome-lm bench model``: forward+backward time and peak memory of the whole model on this
machine, optionally against transformers' glm5_next with the same weights in the same run.

Every measurement runs in a fresh worker subprocess (``genome_lm.measure.run_fresh``: ``python -m
genome_lm.compare.bench JSON``), so peak memory is that process's own high-water mark (Linux VmHWM, reset after the
model and the token ids exist) and one run cannot leave memory or thread pools behind for the
next. transformers runs with flash-linear-attention hidden (``sys.modules["fla"] = None``):
otherwise glm5_next swaps in fla's Triton kernels, which fail on a CPU (docs/design.md, section 3).

The same work on both sides: batch 1, the same random DNA ids (4..8), fp32, training mode,
loss = cross entropy of the logits against the next token, ``loss.backward()``; genome-lm's side
is the trainer's own step (``train.step``) with weight 1 on every target. With
``compare_transformers`` genome-lm's weights are first exported with ``export_hf_checkpoint`` to
a temporary folder; genome-lm's workers load them back with ``load_hf_checkpoint`` and
transformers' workers with ``from_pretrained``, so both hold identical weights (the rows carry
each side's loss, which must agree).

Timing: one warm-up step at the full length (first-touch page faults and allocator growth are
off the clock; they cost transformers about 2x at 2k tokens), then up to ``repeats`` timed steps,
stopping early once ``step_budget_s`` of timed steps has passed (long lengths get fewer); the row
holds the median.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from genome_lm.engine import quiet_megatron_import
from genome_lm.measure import MeasurementError, reset_high_water, run_fresh, serve, status_bytes
from genome_lm.model.presets import get_preset

if TYPE_CHECKING:
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

IMPLS = ("genome-lm", "transformers")
DNA_IDS = (4, 5, 6, 7, 8)  # A C G T N in genome-lm's tokenizer
# A small vision tower for the exported config.json: transformers' Glm5NextConfig builds its
# (large) default one when the config has none, and the benchmark never runs it.
_TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=16, intermediate_size=16,
                    projection_intermediate_size=16)


def default_threads() -> int:
    """The cores this process may run on (what ``torch.set_num_threads`` gets by default)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def bench(preset: str = "tiny", lengths: tuple[int, ...] = (2048, 8192), *, compare_transformers: bool = False,
          repeats: int = 3, threads: int | None = None, timeout_s: float = 1200.0, step_budget_s: float = 30.0,
          seed: int = 0, kernel_backend: str = "auto", batch: int = 1, indexer_loss: str = "off",
          progress=None) -> list[dict]:
    """One row per (implementation, length), lengths in increasing order.

    ``batch`` sequences of each length per step; ``indexer_loss`` ("off", "dense", "sparse"):
    genome-lm's step also computes its DSA indexer loss and adds it to the loss it differentiates,
    as training with ``train.indexer_loss`` does (transformers has no such loss, so the two are
    then not the same work and cannot be compared).

    Row keys: impl, preset, T, B, threads, seconds (median fwd+bwd), repeats (timed steps),
    warmup_s, tokens_per_s, peak_mib (process high-water mark above the built model), loss,
    indexer_loss (genome-lm: the sum of the DSA layers' indexer losses, None when off),
    note ("measured", "timeout after N s", "skipped: ...", "failed: ..."); genome-lm's rows also
    ``speedup`` = transformers' seconds / genome-lm's seconds at that length (None when
    transformers did not finish or was not asked for). transformers runs only at the lengths
    given, each with ``timeout_s``; after a timeout the longer lengths are skipped."""
    check_indexer_loss(indexer_loss, compare_transformers)
    threads = threads or default_threads()
    lengths = tuple(sorted(set(lengths)))
    common = dict(preset=preset, B=batch, threads=threads, repeats=repeats, step_budget_s=step_budget_s, seed=seed,
                  kernel_backend=kernel_backend, indexer_loss=indexer_loss)
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        if progress is not None:
            progress(row)

    with tempfile.TemporaryDirectory(prefix="genome-lm-bench-") as tmp:
        checkpoint = None
        if compare_transformers:
            checkpoint = str(Path(tmp) / "checkpoint")
            _run_worker("export", dict(common, checkpoint=checkpoint), timeout_s)
        for T in lengths:
            record(_run_worker("genome-lm", dict(common, T=T, checkpoint=checkpoint), timeout_s))
        if compare_transformers:
            gave_up = None  # why a shorter length did not finish
            for T in lengths:
                if gave_up is not None:
                    record(dict(impl="transformers", preset=preset, T=T, B=batch, threads=threads, seconds=None,
                                peak_mib=None, note=f"skipped: {gave_up}"))
                    continue
                row = _run_worker("transformers", dict(common, T=T, checkpoint=checkpoint), timeout_s)
                record(row)
                if row.get("seconds") is None:
                    gave_up = f"{row['note'].split(':')[0]} at T={T:,}"
    add_speedup(rows)
    return rows


def check_indexer_loss(indexer_loss: str, compare_transformers: bool) -> None:
    """ValueError unless ``indexer_loss`` is a mode of the model's indexer loss, and off when
    compared with transformers (which has none)."""
    if indexer_loss not in ("off", "dense", "sparse"):
        raise ValueError(f"choose off, dense or sparse; got {indexer_loss!r}")
    if compare_transformers and indexer_loss != "off":
        raise ValueError("transformers' glm5_next has no indexer loss: compare with it only with the indexer loss off")


def add_speedup(rows: list[dict]) -> list[dict]:
    """genome-lm row ``speedup`` = transformers' seconds / genome-lm's seconds at the same T."""
    theirs = {r["T"]: r.get("seconds") for r in rows if r["impl"] == "transformers"}
    for row in rows:
        if row["impl"] == "genome-lm":
            ref = theirs.get(row["T"])
            row["speedup"] = ref / row["seconds"] if ref and row.get("seconds") else None
    return rows


def growth(rows: list[dict]) -> list[dict]:
    """Per implementation, between consecutive measured lengths: how much the tokens, the time
    and the peak memory grew (all 4.0 for an exactly linear model going from 2k to 8k)."""
    out = []
    for impl in IMPLS:
        measured = [r for r in rows if r["impl"] == impl and r.get("seconds")]
        for a, b in zip(measured, measured[1:]):
            mem = b["peak_mib"] / a["peak_mib"] if a.get("peak_mib") and b.get("peak_mib") else None
            out.append(dict(impl=impl, T_from=a["T"], T_to=b["T"], tokens=b["T"] / a["T"],
                            time=b["seconds"] / a["seconds"], memory=mem))
    return out


def with_ratio(rows: list[dict], key: str, group: tuple[str, ...], baseline: dict, out: str) -> list[dict]:
    """Add ``out`` = row[key] / baseline row's [key] to every row, the baseline being the row with
    the same ``group`` values that matches ``baseline`` (None where either side is missing)."""
    base = {tuple(r[g] for g in group): r[key] for r in rows if all(r.get(k) == v for k, v in baseline.items())}
    for row in rows:
        ref = base.get(tuple(row[g] for g in group))
        row[out] = row[key] / ref if ref and row.get(key) == row.get(key) and row.get(key) is not None else None
    return rows


def kernel_bench(op: str, lengths: tuple[int, ...], backward: bool = True) -> dict[str, list[dict]]:
    """``genome-lm bench kernels``: KDA rows (time relative to the chunked torch path) and DSA rows
    (time and memory relative to the sparse path) for ``op`` in kda, dsa or all."""
    results = {}
    if op in ("kda", "all"):
        from .kernels import kda_bench

        results["kda"] = with_ratio(kda_bench(lengths=lengths, backward=backward), "seconds", ("mode", "T"),
                                    {"impl": "torch"}, "x torch time")
    if op in ("dsa", "all"):
        from .kernels import dsa_bench

        rows = dsa_bench(lengths=lengths)
        for row in rows:
            row["peak_mib"] = row["peak_bytes"] / 2**20 if row.get("peak_bytes") is not None else None
            row["kib_per_token"] = row["bytes_per_token"] / 1024 if row.get("bytes_per_token") is not None else None
            row["note"] = row.get("skipped") or ("extrapolated" if row.get("extrapolated") else "measured")
        with_ratio(rows, "time_s", ("T",), {"path": "sparse"}, "x sparse time")
        results["dsa"] = with_ratio(rows, "peak_mib", ("T",), {"path": "sparse"}, "x sparse memory")
    return results


# --------------------------------------------------------------------------------- subprocesses
def _run_worker(role: str, cfg: dict, timeout_s: float) -> dict:
    base = dict(impl=role, preset=cfg["preset"], T=cfg.get("T"), B=cfg["B"], threads=cfg["threads"],
                seconds=None, peak_mib=None)
    try:
        return run_fresh("genome_lm.compare.bench", dict(cfg, role=role), timeout=timeout_s)
    except TimeoutError:
        if role == "export":
            raise RuntimeError(f"exporting the {cfg['preset']} weights took over {timeout_s:g} s") from None
        return dict(base, note=f"timeout after {timeout_s:g} s")
    except MeasurementError as err:
        if role == "export":
            raise RuntimeError(f"exporting the {cfg['preset']} weights failed: {err}") from None
        return dict(base, note="failed: " + str(err).split(": ", 1)[-1][-300:])


def _rss_mib(field: str) -> float:
    return status_bytes(field) / 2**20


def _token_ids(cfg: dict):
    import torch

    gen = torch.Generator().manual_seed(cfg["seed"])
    return torch.tensor(DNA_IDS)[torch.randint(len(DNA_IDS), (cfg["B"], cfg["T"]), generator=gen)]


def _next_token_loss(logits, ids):
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _time_steps(model: torch.nn.Module, step, cfg: dict) -> dict:
    """Warm up once, then time up to ``repeats`` steps (at least one) within ``step_budget_s``."""
    base = _rss_mib("VmRSS")
    reset_high_water()
    start = time.perf_counter()
    loss = step()
    warmup = time.perf_counter() - start
    times: list[float] = []
    while len(times) < max(cfg["repeats"], 1) and (not times or sum(times) < cfg["step_budget_s"]):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return dict(seconds=seconds, repeats=len(times), warmup_s=warmup, tokens_per_s=cfg["B"] * cfg["T"] / seconds,
                peak_mib=max(_rss_mib("VmHWM") - base, 0.0), loss=loss, note="measured")


def _build_genome_lm(cfg: dict, pg: ProcessGroupCollection):
    import torch

    from genome_lm.checkpoint.huggingface import load_hf_checkpoint
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import build_model

    torch.manual_seed(cfg["seed"])
    model = build_model(get_preset(cfg["preset"]), pg, ParallelSizes(), kernel_backend=cfg["kernel_backend"])
    if cfg.get("checkpoint") and Path(cfg["checkpoint"], "model.safetensors.index.json").exists():
        load_hf_checkpoint(model, cfg["checkpoint"])
    return model


def _export(cfg: dict) -> None:
    from genome_lm.checkpoint.huggingface import export_hf_checkpoint
    from genome_lm.engine.parallel import parallel_context

    with parallel_context() as pg:
        export_hf_checkpoint(_build_genome_lm(cfg, pg), cfg["checkpoint"])
    config_file = Path(cfg["checkpoint"], "config.json")
    config = json.loads(config_file.read_text())
    config.setdefault("vision_config", dict(_TINY_VISION, out_hidden_size=config["text_config"]["hidden_size"]))
    config_file.write_text(json.dumps(config, indent=2))


def _next_token_batch(ids_BT):
    """The trainer's step on ``ids`` [B, T] doing transformers' work: all T positions go through
    the model; targets the next token, weight 1 each, none for the last position. With the global
    weight = the number of targets the step's weighted LM loss is the plain mean next-token
    cross-entropy, ``_next_token_loss``, what transformers' rows report."""
    import torch

    from genome_lm.data.loader import IGNORE
    from genome_lm.train.step import Tokens

    labels = torch.cat([ids_BT[:, 1:], torch.full_like(ids_BT[:, :1], IGNORE)], dim=1)
    weights = torch.ones(ids_BT.shape, dtype=torch.float32)
    weights[:, -1] = 0.0
    return Tokens(ids_BT, labels, weights)


def _measure_genome_lm(cfg: dict) -> dict:
    with quiet_megatron_import():
        from genome_lm.config import MemoryConfig
        from genome_lm.engine.parallel import parallel_context
        from genome_lm.train.step import StepSpec, forward_backward
    with parallel_context() as pg:
        model = _build_genome_lm(cfg, pg).train()
        batch = _next_token_batch(_token_ids(cfg))
        mode = cfg.get("indexer_loss", "off")
        # the indexer losses join the loss that is differentiated with coefficient 1; none when off
        spec = StepSpec(memory=MemoryConfig(), mode=mode, global_weight=batch.loss_weight.sum(), tp_group=pg.tp)
        indexer = []

        def step() -> float:
            sums = forward_backward(model, [batch], spec)
            indexer[:] = [float(sums.indexer)]
            return float(sums.lm_sum / spec.global_weight)

        result = _time_steps(model, step, cfg)
        result["backend"] = f"{model.options.kernel_backend} kernels" + (
            f", {mode} indexer loss" if mode != "off" else "")
        result["indexer_loss"] = sum(indexer) if mode != "off" else None
    return result


def _measure_transformers(cfg: dict) -> dict:
    import torch

    from .parity import _import_transformers_model

    model = _import_transformers_model().from_pretrained(cfg["checkpoint"], dtype=torch.float32).train()
    ids = _token_ids(cfg)

    def step() -> float:
        loss = _next_token_loss(model(input_ids=ids).logits, ids)
        loss.backward()
        return loss.item()

    result = _time_steps(model, step, cfg)
    result["backend"] = f"{model.config._attn_implementation} attention"
    return result


def _worker(cfg: dict) -> dict:
    role = cfg["role"]
    if role == "transformers":
        sys.modules["fla"] = None  # type: ignore[assignment]  # before anything imports transformers
    import torch

    torch.set_num_threads(cfg["threads"])
    if role == "export":
        _export(cfg)
        return {"checkpoint": cfg["checkpoint"]}
    measured = (_measure_genome_lm if role == "genome-lm" else _measure_transformers)(cfg)
    row = dict(impl=role, preset=cfg["preset"], T=cfg["T"], B=cfg["B"], threads=torch.get_num_threads())
    row.update(measured)
    return row


if __name__ == "__main__":
    serve(_worker)
