"""``genome-lm parity``: genome-lm's model against transformers' glm5_next on the same weights.

Loads a checkpoint written by transformers' ``save_pretrained`` twice, in transformers and
through genome-lm's loader, runs both on the same random DNA tokens at each length, and reports
the largest |logit difference| (and |log-probability difference|) per length. Used by users
converting a real checkpoint and by the tests, on random tiny configs.

Ties at the top-k boundary. When the pool with the k-th highest indexer score ties with the next
one (pools of identical content, which genomes are full of, or all-zero ReLU scores), the two
models may keep different pools: genome-lm keeps the lower pool (a documented, tested rule of
its indexer), transformers whatever ``torch.topk`` returns. From the first query with such a tie
on, outputs may differ legitimately: a DSA layer's output at that position feeds every later
position. Each row therefore counts the (layer, query) pairs with a boundary tie and the first
tied position, and judges parity on the positions before it; the difference after it is shown
apart ("after").

Flips on near-ties. A GPU kernel backend (``--backend triton``: bf16 operands on tensor cores)
rounds each layer's output by about 1%, which is enough to flip a decision whose two sides score
almost the same: a MoE router's k-th and next expert (measured on the shipped tiny-long model:
top-2 margins of 1e-4 to 1e-3 flip, and one flipped token's logits move by 0.4), or a DSA
layer's k-th and next pool. With any backend other than the torch path, parity also runs
genome-lm's torch path (fp32, which agrees with transformers to about 1e-5) on the same weights
and tokens, compares every MoE layer's experts and every DSA layer's selected pools position by
position, and lists each flip with its margin on the reference (the gap between the k-th and the
next router choice score, or between the k-th and the next pool score over the query's top
score). Parity is judged before the first tie or flip, whichever comes first. To judge every
position, ``replay_decisions`` makes a model route and select as a reference run did
(``ReplayRouting``, ``ReplaySelection``; ``compare.precision`` does so for bf16 against fp32).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from genome_lm.engine.backend import on_gpu
from genome_lm.errors import GenomeLMError

if TYPE_CHECKING:
    from genome_lm.model.model import GLM5Model

DNA_IDS = (4, 5, 6, 7, 8)  # A C G T N in genome-lm's tokenizer


@dataclass
class Flip:
    """A decision genome-lm's model makes otherwise than its torch path on the same input."""

    position: int
    kind: str  # "routing" (a MoE layer's experts) or "selection" (a DSA layer's pools)
    layer: int  # which MoE layer, or which DSA layer with its own indexer, in the order they run (0-based)
    margin: float  # the torch path's gap at the top-k boundary (router choice scores; pool scores / top score)


@dataclass
class ParityRow:
    length: int
    max_abs_logit: float  # before the first tie or flip (all positions without either)
    mean_abs_logit: float
    max_abs_logprob: float
    passed: bool
    tied_queries: int = 0  # (DSA layer, query) pairs whose top-k boundary is a tie
    first_tie: int | None = None  # the first position with one (None: no tie)
    max_abs_logit_after: float | None = None  # from the first tie or flip on, where decisions may differ
    routing_flips: int = 0  # (MoE layer, token) pairs whose experts differ from the torch path's
    selection_flips: int = 0  # (DSA layer, query) pairs whose pools differ from the torch path's
    first_flip: int | None = None
    flips: list[Flip] = field(default_factory=list)  # the first ones by position (at most MAX_FLIPS_LISTED)

    @property
    def cut(self) -> int:
        """The positions parity is judged on: before the first tie or flip."""
        return min(p for p in (self.first_tie, self.first_flip, self.length) if p is not None)


MAX_FLIPS_LISTED = 10


class _IndexerInputs:
    """Records each indexer's (q, k, w, gate, ape, kpool, topk) during a forward of genome-lm's model."""

    def __init__(self, model: GLM5Model):
        self.indexers = [m for m in model.modules() if hasattr(m, "indexer") and m.indexer is not None]
        self.seen: list[tuple] = []

    def __enter__(self):
        for attn in self.indexers:
            real = attn.indexer.inputs

            def record(*args, _real=real, _attn=attn, **kwargs):
                out = _real(*args, **kwargs)
                self.seen.append((*out, _attn.indexer.index_kpool_compress_ape, _attn.cfg.index_kpool,
                                  _attn.cfg.index_topk))
                return out

            attn.indexer.inputs = record
        return self

    def __exit__(self, *exc):
        for attn in self.indexers:
            del attn.indexer.inputs  # back to the class's method


def boundary_margins(q_BTHD, k_BTD, w_BTH, gate_BTD, ape_KD, kpool: int, topk: int, chunk: int = 256,
                     relative: bool = False) -> torch.Tensor:
    """[B, T]: the gap between the pool with the k-th highest score (k = topk // kpool) and the best
    pool left out, on the scores genome-lm's selection uses (fp32, ``indexer.pool_scores_chunk``);
    inf where the query sees at most k pools (nothing is left out). ``relative``: over the
    query's top score."""
    from genome_lm_kernels.dsa import indexer

    B, T, _, D = q_BTHD.shape
    kp = indexer.pool_keys(k_BTD, gate_BTD, ape_KD, kpool=kpool)
    n_pick = topk // kpool
    out = torch.full((B, T), float("inf"))
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        N = min(kp.shape[1], t1 // kpool)
        if N <= n_pick:
            continue
        scores = indexer.pool_scores_chunk(q_BTHD[:, t0:t1], kp[:, :N], w_BTH[:, t0:t1], t0, D**-0.5, kpool)
        top = scores.topk(n_pick + 1, dim=-1).values  # descending
        gap = torch.where(torch.isfinite(top[..., n_pick]), top[..., n_pick - 1] - top[..., n_pick], float("inf"))
        if relative:
            gap = gap / top[..., 0].abs().clamp_min(torch.finfo(top.dtype).tiny)
        out[:, t0:t1] = gap.float()
    return out


def boundary_ties(q_BTHD, k_BTD, w_BTH, gate_BTD, ape_KD, kpool: int, topk: int, chunk: int = 256) -> torch.Tensor:
    """[B, T] bool: the query's top-k boundary is a tie, i.e. the pool with the k-th highest score
    scores exactly as much as the best pool left out (``boundary_margins`` is 0)."""
    return boundary_margins(q_BTHD, k_BTD, w_BTH, gate_BTD, ape_KD, kpool, topk, chunk) == 0


class _OnRouters:
    """A context that wraps each MoE router's ``routing`` of ``model`` (``wrap(router, real)``
    returns the wrapper) and puts back what was there on exit: another such context's wrapper,
    or the class's method. Nested contexts wrap each other, the last one entered outermost."""

    def __init__(self, model: GLM5Model):
        from genome_lm.model.router import GLMRouterBase

        self.routers = [m for m in model.modules() if isinstance(m, GLMRouterBase)]
        self._saved: list = []

    def wrap(self, router, real):
        raise NotImplementedError

    def __enter__(self):
        self._saved = [router.__dict__.get("routing") for router in self.routers]
        for router in self.routers:
            router.routing = self.wrap(router, router.routing)
        return self

    def __exit__(self, *exc):
        for router, previous in zip(self.routers, self._saved):
            if previous is None:
                del router.routing
            else:
                router.routing = previous


class _Decisions(_OnRouters):
    """Records, during a forward of genome-lm's model, each MoE router's choice scores and experts
    ([tokens, experts] fp32 and bool) and each own-indexer DSA layer's selected pools [B, T, P]."""

    def __init__(self, model: GLM5Model):
        from genome_lm.model.dsa import DSAAttention

        super().__init__(model)
        self.dsa = [m for m in model.modules() if isinstance(m, DSAAttention) and m.indexer is not None]
        self.routing: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.selection: list[torch.Tensor] = []
        self._hooks = []

    def wrap(self, router, real):
        from genome_lm.model.router import choice_scores

        def record(logits, *args, **kwargs):
            probs, routing_map = real(logits, *args, **kwargs)
            scores = logits.detach().float().reshape(-1, logits.shape[-1]).sigmoid()
            choice = choice_scores(scores, router.expert_bias)
            self.routing.append((choice, routing_map.detach().reshape(choice.shape)))
            return probs, routing_map

        return record

    def __enter__(self):
        super().__enter__()
        self._hooks = [m.register_forward_hook(self._record_selection) for m in self.dsa]
        return self

    def _record_selection(self, module, args, out) -> None:
        from genome_lm_kernels import dsa as dsa_ops

        cfg = module.cfg
        self.selection.append(dsa_ops.selection_pools(out.idx, kpool=cfg.index_kpool, topk=cfg.index_topk))

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()


class ReplayRouting(_OnRouters):
    """Each MoE router of ``model`` routes to the experts of ``maps`` (one [tokens, experts] bool per
    MoE layer in the order they run: a reference run's ``_Decisions.routing`` maps), weighting
    them from its own scores: the model's output had it made the reference's routing decisions,
    so that a comparison measures the rounding of its kernels and not which side of a near-tie
    each token fell on. For inference (forward only)."""

    def __init__(self, model: GLM5Model, maps: list[torch.Tensor]):
        super().__init__(model)
        self.maps = maps
        self._calls = iter(())

    def __enter__(self):
        self._calls = iter(self.maps)  # the k-th routing call of a forward takes the k-th map
        return super().__enter__()

    def wrap(self, router, real):
        from genome_lm.model.router import expert_weights

        def replay(logits, *args, **kwargs):
            _, routing_map = real(logits, *args, **kwargs)  # its own bookkeeping (tokens per expert)
            forced = next(self._calls).to(routing_map.device).reshape(routing_map.shape)
            flat = logits.reshape(-1, logits.shape[-1])
            experts = forced.float().topk(int(forced[0].sum()), dim=-1).indices  # the True columns
            cfg = router.glm_config
            weights = expert_weights(flat.float().sigmoid(), experts, norm_topk_prob=cfg.norm_topk_prob,
                                     scaling=cfg.routed_scaling_factor)
            return torch.zeros_like(flat).scatter(1, experts, weights.type_as(flat)), forced

        return replay


class ReplaySelection:
    """Each DSA layer of ``model`` with its own indexer attends over the pools of ``pools`` (one
    [B, T, P] int32 per such layer in the order they run: a reference run's
    ``_Decisions.selection``) instead of the ones its indexer picks; a layer that shares the
    previous layer's indexer takes the replayed selection with it. With ``ReplayRouting``, the
    output the model would give had it made every decision of the reference, so that a comparison
    measures the rounding of its kernels and not which side of a near-tie a query fell on. The
    indexer's inputs are still computed, and its loss when asked for (over the replayed pools);
    its own selection is not.

    The hook is the one activation recompute uses to give a recomputed forward its forward's
    selection (``model.recompute_memo``): a replaying frame holding the given pools, so the
    layers take them in call order without any of their code changing. One forward per
    ``with``; a forward that asks for more selections than given, or fewer, raises."""

    def __init__(self, model: GLM5Model, pools: list[torch.Tensor]):
        from genome_lm.model.dsa import DSAAttention
        from genome_lm.model.recompute_memo import Memo

        self.layers = [m for m in model.modules() if isinstance(m, DSAAttention) and m.indexer is not None]
        if len(pools) != len(self.layers):
            raise ValueError(f"{len(pools)} selections for {len(self.layers)} DSA layers with their own indexer")
        device = next(model.parameters()).device
        self.memo = Memo()
        self.memo.values = [p.to(device) for p in pools]
        self._frame = None
        self._keep: list[bool] = []

    def __enter__(self):
        # a layer takes a kept selection only when it keeps one (memory.dsa_keep_selection)
        self._keep = [m.keep_selection for m in self.layers]
        for m in self.layers:
            m.keep_selection = True
        self._frame = self.memo.replaying()
        self._frame.__enter__()
        return self

    def __exit__(self, exc_type, *exc):
        self._frame.__exit__(exc_type, *exc)
        for m, keep in zip(self.layers, self._keep):
            m.keep_selection = keep
        used, given = self._frame.position, len(self.memo.values)
        if exc_type is None and used != given:
            raise RuntimeError(f"a replayed forward took {used} of the {given} selections given")
        return False


@contextlib.contextmanager
def replay_decisions(model: GLM5Model, reference: _Decisions):
    """``model`` routes every token (``ReplayRouting``) and selects every query's pools
    (``ReplaySelection``) as the run that ``reference`` recorded did. For one forward."""
    with ReplayRouting(model, [m for _, m in reference.routing]), ReplaySelection(model, reference.selection):
        yield


def decision_flips(reference: _Decisions, ours: _Decisions, selection_margins: list[torch.Tensor]) -> list[Flip]:
    """Every (layer, position) whose experts or pools differ between two runs of one sequence
    (batch 1), with the reference's margin; ``selection_margins``: per own-indexer DSA layer, the
    reference's ``boundary_margins(..., relative=True)`` [1, T]."""
    flips = []
    for layer, ((choice, ref_map), (_, our_map)) in enumerate(zip(reference.routing, ours.routing)):
        k = int(ref_map[0].sum())
        top = choice.topk(min(k + 1, choice.shape[-1]), dim=-1).values
        gap = top[:, k - 1] - top[:, k] if top.shape[-1] > k else torch.full_like(top[:, 0], float("inf"))
        for row in (ref_map != our_map).any(-1).nonzero().flatten().tolist():
            flips.append(Flip(row, "routing", layer, float(gap[row])))
    for layer, (ref_pools, our_pools, margin) in enumerate(zip(reference.selection, ours.selection, selection_margins)):
        for t in (ref_pools[0] != our_pools[0]).any(-1).nonzero().flatten().tolist():
            flips.append(Flip(t, "selection", layer, float(margin[0, t])))
    return sorted(flips, key=lambda f: (f.position, f.kind, f.layer))


def _import_transformers_model():
    """transformers' glm5_next class, with flash-linear-attention hidden on a CPU machine: when fla
    is importable, glm5_next swaps its torch KDA for fla's Triton kernels, which fail without a
    GPU (docs/design.md, section 3). The torch path is the independent reference we want."""
    if not on_gpu() and "fla" not in sys.modules:
        sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        import transformers
        from transformers import Glm5NextForConditionalGeneration
    except ImportError as exc:
        raise GenomeLMError(f"parity needs transformers >= 5.16.1 with glm5_next ({exc})") from None
    transformers.logging.set_verbosity_error()  # its "falling back to torch" notes are expected here
    return Glm5NextForConditionalGeneration


def run_parity(hf_dir: str | Path, lengths: list[int], *, tol: float = 1e-4, seed: int = 0,
               kernel_backend: str = "auto", progress=None) -> list[ParityRow]:
    from genome_lm.checkpoint.huggingface import HFCheckpoint, load_hf_checkpoint
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model.model import build_model

    hf_dir = Path(hf_dir)
    cfg = HFCheckpoint(hf_dir).config()
    hf_class = _import_transformers_model()
    hf_model = hf_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = [i for i in DNA_IDS if i < cfg.vocab_size] or list(range(cfg.vocab_size))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    with parallel_context() as pg:
        model = build_model(cfg, pg, ParallelSizes(), kernel_backend=kernel_backend).eval()
        load_hf_checkpoint(model, hf_dir)
        reference = None  # the torch path on the same weights, for the flips of a GPU kernel backend
        if model.options.kernel_backend.name != "torch":
            reference = build_model(cfg, pg, ParallelSizes(), kernel_backend="torch").eval()
            load_hf_checkpoint(reference, hf_dir)
        for length in lengths:
            ids = torch.tensor(vocab)[torch.randint(len(vocab), (1, length), generator=gen)]
            with torch.no_grad(), _IndexerInputs(model) as recorded, _Decisions(model) as decided:
                ours = model(ids).logits.float()
            with torch.no_grad():
                theirs = hf_model(input_ids=ids).logits.float()
                tied = torch.zeros(1, length, dtype=torch.bool)
                count = 0
                for inputs in recorded.seen:
                    layer_ties = boundary_ties(*inputs)
                    count += int(layer_ties.sum())
                    tied |= layer_ties
                flips = []
                if reference is not None:
                    with _IndexerInputs(reference) as ref_inputs, _Decisions(reference) as ref_decided:
                        reference(ids)
                    margins = [boundary_margins(*inputs, relative=True) for inputs in ref_inputs.seen]
                    flips = decision_flips(ref_decided, decided, margins)
            row = ParityRow(length, 0.0, 0.0, 0.0, False, tied_queries=count,
                            first_tie=int(tied[0].nonzero()[0]) if bool(tied.any()) else None,
                            routing_flips=sum(f.kind == "routing" for f in flips),
                            selection_flips=sum(f.kind == "selection" for f in flips),
                            first_flip=flips[0].position if flips else None, flips=flips[:MAX_FLIPS_LISTED])
            cut = row.cut
            diff = (ours - theirs).abs()
            lp = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs()
            finite = bool(torch.isfinite(ours).all() and torch.isfinite(theirs).all())
            if cut:
                row.max_abs_logit, row.mean_abs_logit = diff[:, :cut].max().item(), diff[:, :cut].mean().item()
                row.max_abs_logprob = lp[:, :cut].max().item()
            row.passed = finite and row.max_abs_logit <= tol
            row.max_abs_logit_after = None if cut == length else diff[:, cut:].max().item()
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
