"""Scoring over many ranks: the windows of an evaluation split among groups of ranks, each group
running the model split by tensor, context and expert parallelism.

- A **window group** is the set of ranks that score one window together, in lockstep. Without
  expert parallelism it is one data-parallel replica (its tensor- and context-parallel ranks),
  and the replicas share out the windows. An expert-parallel group spans data-parallel ranks,
  whose MoE dispatch must run the same forwards, so under expert parallelism every rank scores
  every window together.
- Inside a group, a window runs whole (``split_nll``): tensor parallel computes the cross-entropy
  over the vocabulary shards, never gathering the logits; context parallel gives each rank its
  zigzag part of the window and all-gathers the per-token NLLs. A group of one rank runs the
  chunked prefill as a single process does (``--chunk``); a split model scores a window in one
  forward, its memory bounded by the split instead.
- **Pipeline parallel** splits the layers: the first stage embeds the window and sends the mHC
  streams on, each stage runs its layers, the last one computes the NLLs and broadcasts them
  back over the stages (T floats), so every rank of the group ends with them.
- **Rank 0 keeps the scores.** It says which windows still need scoring (those not in its
  per-window cache), the groups score them in rounds of one window per group, and after each
  round rank 0 gathers the groups' scores and writes them to the cache at once: a killed run
  re-run with the same arguments scores only what is missing. Rank 0 then reads every window
  from the cache and writes the report exactly as a one-process evaluation does.

"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from genome_lm.engine.parallel import ParallelSizes


HEAD_CHUNK = 16384  # positions per block of the output layer and cross-entropy (plan.eval_model counts it)


def window_groups(pg, sizes: ParallelSizes) -> tuple[int, int, bool]:
    """(this rank's group, number of groups, whether this rank reports its group's scores)."""
    inner_lead = pg.tp.rank() == 0 and pg.cp.rank() == 0 and pg.pp.rank() == 0
    if sizes.ep > 1:
        return 0, 1, dist.get_rank() == 0
    return pg.dp.rank(), pg.dp.size(), inner_lead


@torch.no_grad()
def split_nll(model, pg, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """Per-token NLL [B, T] (fp32) of whole sequences, the same on every rank of a window group.
    The output layer and the cross-entropy run on ``HEAD_CHUNK`` positions at a time. Tensor
    parallel: the cross-entropy over the vocabulary shards (the logits are never gathered: at 1M
    tokens and GLM-5.3-Flash's 154,880 entries they would be 310 GB); context parallel:
    each rank its zigzag part (padded at the end to a multiple of 2 x cp, which no earlier
    position sees), the NLLs all-gathered, T floats per rank."""
    from genome_lm.train.loss import token_cross_entropy

    cp = pg.cp.size()
    T = inputs_BT.shape[1]
    if cp > 1:
        from genome_lm.engine.context_parallel import zigzag_split

        pad = (-T) % (2 * cp)
        inputs_BT = zigzag_split(torch.nn.functional.pad(inputs_BT, (0, pad), value=pad_id), cp, pg.cp.rank())
        targets_BT = zigzag_split(torch.nn.functional.pad(targets_BT, (0, pad), value=pad_id), cp, pg.cp.rank())
    h_SBD = _last_stage_hidden(model, pg, inputs_BT)
    if h_SBD is not None:
        parts = []
        for s0 in range(0, h_SBD.shape[0], HEAD_CHUNK):  # the logits of one block of positions at a time
            logits = model.output_layer(h_SBD[s0:s0 + HEAD_CHUNK])[0].transpose(0, 1)  # [B, c, V / tp]
            parts.append(token_cross_entropy(logits.contiguous(), targets_BT[:, s0:s0 + HEAD_CHUNK].contiguous(),
                                             pg.tp))
        nll = torch.cat(parts, dim=1).contiguous()
    else:
        nll = torch.empty(targets_BT.shape, dtype=torch.float32)
    if pg.pp.size() > 1:  # the last stage's NLLs to every stage
        dist.broadcast(nll, src=dist.get_global_rank(pg.pp, pg.pp.size() - 1), group=pg.pp)
    if cp == 1:
        return nll
    from genome_lm.engine.context_parallel import zigzag_merge

    parts = [torch.empty_like(nll) for _ in range(cp)]
    dist.all_gather(parts, nll, group=pg.cp)
    return zigzag_merge(parts, dim=1)[:, :T]


def _last_stage_hidden(model, pg, inputs_BT: torch.Tensor) -> torch.Tensor | None:
    """The final hidden states [S, B, D] of ``inputs_BT`` on the last pipeline stage (the only
    stage without pipeline parallel); None on the stages before it, which pass their mHC streams
    on (``train.pipeline.communicator``, the same point-to-point sends as training)."""
    if pg.pp.size() == 1:
        return model.hidden(inputs_BT)[0]
    from genome_lm.train.pipeline import communicator

    comm = communicator(model)
    B, P = inputs_BT.shape
    received = comm.recv_forward(model.stream_shape(B, P), model.pre_process)  # None on the first stage
    out, _ = model.hidden(inputs_BT if model.pre_process else None, streams=received, positions=P)
    if model.post_process:
        return out
    comm.send_forward(out.contiguous(), model.post_process)
    return None


def split_window_nll(model, pg, tokens: np.ndarray, token_map, max_context: int | None) -> np.ndarray:
    """``score.token_nll`` (or ``token_nll_cut`` with ``max_context``) of one window for a model
    split inside its window group: the window in one forward, or its ``max_context``-token
    segments as the rows of one batch and the ragged last segment alone."""
    from .score import _model_ids, cut_segments

    ids = _model_ids(model, tokens, token_map, None)
    pad = model.cfg.pad_token_id or 0
    L = len(tokens) - 1
    if max_context is None or max_context >= L:
        return split_nll(model, pg, ids[None, :-1], ids[None, 1:], pad)[0].double().cpu().numpy()
    rows, targets, ragged = cut_segments(ids, max_context)
    out = np.empty(L, dtype=np.float64)
    out[:ragged] = split_nll(model, pg, rows, targets, pad).flatten().double().cpu().numpy()
    if ragged < L:
        out[ragged:] = split_nll(model, pg, ids[None, ragged:-1], ids[None, ragged + 1:], pad)[0].double().cpu().numpy()
    return out


def split_model(sizes: ParallelSizes) -> bool:
    """Whether a window group holds more than one rank (the model split inside it)."""
    return sizes.tp * sizes.cp * sizes.pp > 1 or sizes.ep > 1


def score_into_cache(model, dataset, split: str, windows: list[int], *, cache, pg, sizes: ParallelSizes,
                     chunk: int | None, token_map, max_context: int | None, on_done=None) -> None:
    """Collective over every rank: score each of ``windows`` missing from rank 0's ``cache`` and
    store it there (rank 0 writes). ``on_done(n)`` (rank 0): n more predicted tokens are in the
    cache, windows found there already included."""
    from genome_lm.data.loader import SplitReader

    from .score import token_nll, token_nll_cut

    rank = dist.get_rank()
    reader = SplitReader(dataset, split)
    missing = [None]
    if rank == 0:
        missing[0] = [w for w in windows if not cache.has(w, reader.windows[w].length - 1)]  # damaged: missing
        if on_done is not None:
            on_done(sum(reader.windows[w].length - 1 for w in set(windows) - set(missing[0])))
    dist.broadcast_object_list(missing, src=0)
    missing = missing[0]
    group, groups, lead = window_groups(pg, sizes)
    split = split_model(sizes)
    was_training = model.training
    model.eval()
    try:
        for first in range(0, len(missing), groups):
            mine = missing[first + group] if first + group < len(missing) else None
            result = None
            if mine is not None:
                tokens = reader.tokens(mine)
                if split:
                    nll = split_window_nll(model, pg, tokens, token_map, max_context)
                elif max_context is None:
                    nll = token_nll(model, tokens, chunk=chunk, token_map=token_map)
                else:
                    nll = token_nll_cut(model, tokens, max_context, chunk=chunk, token_map=token_map)
                result = (mine, nll) if lead else None
            gathered = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(result, gathered, dst=0)
            if rank == 0:
                for item in gathered:
                    if item is not None:
                        w, nll = item
                        cache.store(w, np.asarray(nll, dtype=np.float64))
                        if on_done is not None:
                            on_done(len(nll))
    finally:
        model.train(was_training)


def _tp_pick(local: torch.Tensor, ids: torch.Tensor, group) -> torch.Tensor:
    """The logits of vocabulary entries ``ids`` [c, k] from this rank's vocabulary shard
    ``local`` [c, V / tp] (fp64), summed over the TP ranks: each entry lives on one shard."""
    width = local.shape[1]
    offset = group.rank() * width if group.size() > 1 else 0
    at = ids - offset
    mine = (at >= 0) & (at < width)
    picked = torch.where(mine, local.gather(1, at.clamp(0, width - 1)), torch.zeros((), dtype=local.dtype))
    if group.size() > 1:
        dist.all_reduce(picked, group=group)
    return picked


def _tp_stats(local: torch.Tensor, targets: torch.Tensor, columns: torch.Tensor, group) -> torch.Tensor:
    """[c, 6] (log-probability of ``targets``, entropy, probabilities of ``columns`` A/C/G/T) of
    logits split by vocabulary over the TP ranks (never gathered): the log-sum-exp, the entropy
    and the picked entries each reduced over the shards."""
    tp = group.size() > 1
    top = local.max(dim=-1).values
    if tp:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = local - top[:, None]
    total = shifted.exp().sum(-1)
    if tp:
        dist.all_reduce(total, group=group)
    lse = top + total.log()
    weighted = ((local - lse[:, None]).exp() * local).sum(-1)
    if tp:
        dist.all_reduce(weighted, group=group)
    target = _tp_pick(local, targets[:, None], group)[:, 0]
    bases = _tp_pick(local, columns[None].expand(local.shape[0], -1), group)
    return torch.cat([(target - lse)[:, None], (lse - weighted)[:, None], (bases - lse[:, None]).exp()], dim=1)


@torch.no_grad()
def split_window_tracks(model, pg, ids: torch.Tensor, columns: torch.Tensor, taps=None):
    """A window's per-position tracks for a model split inside its window group (tensor, context,
    expert and pipeline parallel; the window in one forward): ``ids`` [T] in the model's vocabulary ->
    (stats [T - 1, 6]: for each input but the last, the log-probability of the next token, the
    entropy and the A/C/G/T probabilities (``columns``), fp64; hidden {layer: [T, D]} from
    ``taps`` (``embeddings.LayerTaps``), all T inputs fed), the same on every rank of the group."""
    from genome_lm.model.layer import gather_positions

    cp, tp, pp = pg.cp.size(), pg.tp.size(), pg.pp.size()
    T = ids.shape[0]
    inputs = ids[None] if taps is not None else ids[None, :-1]
    targets = torch.nn.functional.pad(ids[1:], (0, inputs.shape[1] - (T - 1)), value=0)[None]
    n = inputs.shape[1]
    if cp > 1:
        from genome_lm.engine.context_parallel import zigzag_split

        pad = (-n) % (2 * cp)
        pad_id = model.cfg.pad_token_id or 0
        inputs = zigzag_split(torch.nn.functional.pad(inputs, (0, pad), value=pad_id), cp, pg.cp.rank())
        targets = zigzag_split(torch.nn.functional.pad(targets, (0, pad), value=pad_id), cp, pg.cp.rank())
    h = _last_stage_hidden(model, pg, inputs)  # [S, 1, D]; None on a pipeline stage before the last
    hidden = {}
    if taps is not None:
        for name, value in taps.take().items():  # [S or S / tp under sequence parallel, D]
            if model.sequence_parallel and tp > 1 and value.shape[0] != inputs.shape[1]:
                value = gather_positions(value[:, None], inputs.shape[1], pg.tp)[:, 0]
            hidden[name] = value
    S = inputs.shape[1]
    if h is not None:
        parts = []
        for s0 in range(0, h.shape[0], HEAD_CHUNK):
            local = model.output_layer(h[s0:s0 + HEAD_CHUNK])[0][:, 0].double()  # [c, V / tp]
            parts.append(_tp_stats(local, targets[0, s0:s0 + HEAD_CHUNK], columns, pg.tp))
        stats = torch.cat(parts)
    else:
        stats = torch.empty(S, 2 + columns.numel(), dtype=torch.float64)
    if pp > 1:  # the last stage's tracks, and each layer's embeddings from the stage that holds it
        dist.broadcast(stats, src=dist.get_global_rank(pg.pp, pp - 1), group=pg.pp)
        if taps is not None:
            ranges = [None] * pp
            dist.all_gather_object(ranges, (model.layer_offset, len(model.layers)), group=pg.pp)
            for name in taps.names:
                owner = pp - 1 if name == "final" else next(
                    s for s, (first, n) in enumerate(ranges) if first <= int(name.split("_")[1]) < first + n)
                value = hidden.get(name)
                if value is None:
                    value = torch.empty(S, model.cfg.hidden_size, dtype=torch.float32)
                dist.broadcast(value.contiguous(), src=dist.get_global_rank(pg.pp, owner), group=pg.pp)
                hidden[name] = value
    if cp > 1:
        from genome_lm.engine.context_parallel import zigzag_merge

        def whole(x):
            gathered = [torch.empty_like(x) for _ in range(cp)]
            dist.all_gather(gathered, x.contiguous(), group=pg.cp)
            return zigzag_merge(gathered, dim=0)[:n]

        stats = whole(stats)
        hidden = {name: whole(value) for name, value in hidden.items()}
    return stats[:T - 1], hidden
