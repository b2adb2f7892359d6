"""The model in reduced precision against its fp32 torch path, on the same weights and tokens.

The GPU path runs parameters and activations in bf16 through the tensor-core kernels (kernel
backend "triton": KDA, the DSA indexer's scores, sparse MLA); the reference is the fp32 torch
path. Each rounding is small (bf16 keeps 8 significant bits: a relative error of at most
2^-9 ~ 2e-3 per rounding, 2^-8 ~ 3.9e-3 between neighbours), but the model makes discrete
decisions: a MoE router's top-k experts and a DSA indexer's top-k pools. Where the k-th and the
next candidate score almost alike (top-k margins of 1e-4 to 1e-3 are common), the rounding flips
the decision, and a flipped token's output moves by O(1) — a different expert is a different
function, not a rounding error. So a comparison that looks only at the logits confounds two
things. ``compare_precision`` separates them:

- the free run: the model as it is, decisions its own; the LM loss of both runs, every routing
  and selection flip (with the reference's margin), and the largest |log-probability
  difference| before the first flip;
- the replayed run: every MoE layer routes and every DSA layer selects as the reference did
  (``compare.parity.replay_decisions``), so the difference at every position is the kernels'
  and activations' rounding alone: max |d logit|, max |d logprob|.

Both models hold the same numbers as weights: the reference is built in fp32, the bf16 model
takes its state (rounded once), and the reference takes that back (exact in fp32), so nothing
here measures the rounding of the weights themselves. The tokens are random DNA (A, C, G, T).
The device is the backend profile's (``build_model``): the same call runs on a CPU (Triton's
interpreter, small shapes) and on a GPU at a real layer size. It builds and holds both models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .parity import DNA_IDS, MAX_FLIPS_LISTED, Flip

U = 2.0**-8  # bf16: relative spacing of neighbouring values
ROUNDINGS_PER_LAYER = 8  # roundings of weight comparable to a layer's contribution (see ``bounds``)
FLIP_LOSS = 0.25  # relative loss difference per flipped fraction of the decisions (measured <= 0.19)

if TYPE_CHECKING:
    from genome_lm.model.config import ModelConfig
    from genome_lm.model.model import GLM5Model


@dataclass
class PrecisionResult:
    """One sequence of ``length`` tokens through ``backend`` in ``dtype`` and through ``reference``
    in fp32 on the same weights. Logit and log-probability differences are absolute, in nats."""

    length: int
    backend: str
    reference: str
    dtype: str
    loss: float  # LM cross-entropy (mean over the positions, nats), the free run
    loss_reference: float
    loss_rel_diff: float  # |loss - loss_reference| / loss_reference
    loss_replayed_rel_diff: float  # the same with every decision replayed
    max_abs_logit: float  # replayed: over every position
    max_abs_logprob: float
    rel_logit: float  # replayed: ||d logits|| / ||reference logits|| (Frobenius)
    max_abs_logit_reference: float  # the scale: the reference's largest |logit| ...
    rms_logit_reference: float  # ... and its root mean square over every (position, vocabulary) entry
    decisions: int  # (MoE layer, token) and (own-indexer DSA layer, query) pairs: what could flip
    routing_flips: int  # free run: (MoE layer, token) pairs routed otherwise than the reference
    selection_flips: int  # free run: (DSA layer, query) pairs with other pools
    first_flip: int | None  # the first position with a flip (None: none)
    max_abs_logprob_before_flip: float | None  # free run, positions before the first flip (None: a flip at 0)
    max_abs_logit_free: float  # free run, every position (flips included)
    flips: list[Flip] = field(default_factory=list)  # the first ones by position (at most MAX_FLIPS_LISTED)


def same_weights(cfg: ModelConfig, pg, *, seed: int, dtype: torch.dtype, backend: str,
                 reference: str) -> tuple[GLM5Model, GLM5Model]:
    """(reference model in fp32 on ``reference``, model in ``dtype`` on ``backend``), evaluation
    mode, holding the same numbers: the reference initialised from ``seed``, its state rounded
    into the other and copied back. Checked parameter by parameter and buffer by buffer."""
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model.model import build_model

    torch.manual_seed(seed)
    ref = build_model(cfg, pg, ParallelSizes(), kernel_backend=reference, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    model = build_model(cfg, pg, ParallelSizes(), kernel_backend=backend, dtype=dtype).eval()
    model.load_state_dict(ref.state_dict())  # rounded once where the model holds dtype
    ref.load_state_dict(model.state_dict())  # exact: every dtype value is an fp32 value
    theirs = model.state_dict()
    for name, value in ref.state_dict().items():
        if torch.is_tensor(value) and not torch.equal(value, theirs[name].to(value.dtype)):
            raise AssertionError(f"{name}: the two models' weights differ after the copy")
    return ref, model


def _lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten()))


def compare_precision(cfg: ModelConfig, T: int, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      backend: str = "triton", reference: str = "torch",
                      init_std: float | None = None) -> PrecisionResult:
    """One random DNA sequence of ``T`` tokens (and its next tokens as targets) through the model
    in ``dtype`` on ``backend`` and through the fp32 ``reference`` path, on the same weights
    (random, from ``seed``; ``init_std`` replaces ``cfg.initializer_range``); see the module
    docstring for what is measured. Raises AssertionError if the replayed run does not take the
    reference's decisions."""
    from genome_lm.engine.parallel import parallel_context

    from .parity import _Decisions, _IndexerInputs, boundary_margins, decision_flips, replay_decisions

    if init_std is not None:
        cfg = cfg.replace(initializer_range=init_std)
    vocab = torch.tensor([i for i in DNA_IDS[:4] if i < cfg.vocab_size] or list(range(cfg.vocab_size)))
    ids = vocab[torch.randint(len(vocab), (1, T + 1), generator=torch.Generator().manual_seed(seed))]
    with parallel_context() as pg, torch.no_grad():
        ref_model, model = same_weights(cfg, pg, seed=seed, dtype=dtype, backend=backend, reference=reference)
        device = next(model.parameters()).device
        inputs, targets = ids[:, :-1].to(device), ids[:, 1:].to(device)
        with _IndexerInputs(ref_model) as ref_inputs, _Decisions(ref_model) as ref_decided:
            ref_logits = ref_model(inputs).logits.float()
        with _Decisions(model) as decided:
            free = model(inputs).logits.float()
        # the recorder wraps the replay, so that it records the decisions the model used
        with replay_decisions(model, ref_decided), _Decisions(model) as replayed_decided:
            replayed = model(inputs).logits.float()
        margins = [boundary_margins(*seen, relative=True) for seen in ref_inputs.seen]
    if decision_flips(ref_decided, replayed_decided, margins):
        raise AssertionError("the replayed run did not take the reference's decisions")
    flips = decision_flips(ref_decided, decided, margins)
    first = flips[0].position if flips else None
    ref_lp = ref_logits.log_softmax(-1)
    d_logit = (replayed - ref_logits).abs()
    d_free_lp = (free.log_softmax(-1) - ref_lp).abs()
    loss, loss_ref, loss_replayed = (_lm_loss(x, targets) for x in (free, ref_logits, replayed))
    cut = T if first is None else first
    return PrecisionResult(
        length=T, backend=backend, reference=reference, dtype=str(dtype).removeprefix("torch."),
        loss=loss, loss_reference=loss_ref, loss_rel_diff=abs(loss - loss_ref) / loss_ref,
        loss_replayed_rel_diff=abs(loss_replayed - loss_ref) / loss_ref,
        max_abs_logit=float(d_logit.max()), max_abs_logprob=float((replayed.log_softmax(-1) - ref_lp).abs().max()),
        rel_logit=float((replayed - ref_logits).norm() / ref_logits.norm()),
        max_abs_logit_reference=float(ref_logits.abs().max()),
        rms_logit_reference=float(ref_logits.square().mean().sqrt()),
        decisions=T * (len(ref_decided.routing) + len(ref_decided.selection)),
        routing_flips=sum(f.kind == "routing" for f in flips),
        selection_flips=sum(f.kind == "selection" for f in flips),
        first_flip=first, max_abs_logprob_before_flip=float(d_free_lp[:, :cut].max()) if cut else None,
        max_abs_logit_free=float((free - ref_logits).abs().max()), flips=flips[:MAX_FLIPS_LISTED])


@dataclass
class Bounds:
    """What a ``PrecisionResult`` may reach in bf16 (see ``bounds``)."""

    rel_logit: float
    max_abs_logit: float
    max_abs_logprob: float  # replayed, and the free run before its first flip
    loss_replayed_rel: float
    loss_free_rel: float


def bounds(r: PrecisionResult, cfg: ModelConfig) -> Bounds:
    """The bf16 bounds for a comparison of the model ``cfg`` (its layers and vocabulary).

    Where the bounds come from. bf16 keeps 8 significant bits: neighbouring values differ by
    u = 2^-8 ~ 3.9e-3 relative (a rounding to nearest errs by at most half of that). A decoder layer's
    contribution goes through about R = 8 roundings of weight comparable to it (in its attention and
    its MLP half: the normalised input, the projections, the kernel's output or the activation, the
    output projection, the merge into the bf16 streams), independent in sign, so a layer errs by
    ~sqrt(R) u ~ 1.1e-2 relative (measured 1.1e-2 on the streams after tiny-long's first layer;
    the KDA kernel alone errs by 2-4e-3 RMS with bf16 inputs, ``test_kda_accuracy.py``), and L layers plus the final
    norm and output layer by sqrt(R L + 2) u (measured 1.6, 2.2, 2.4e-2 after tiny-long's layers
    2-4: the square-root growth). The bound takes twice that, for the correlation between roundings
    and a layer's gain on its input's error:

        rel_logit  (||d logits|| / ||logits||, routing and selection replayed)  <=  2 sqrt(R L + 2) u

    The largest entry of an error of that size spread over N = T x V entries is about sqrt(2 ln N)
    of its RMS (the tail of a Gaussian), so max |d logit| <= sqrt(2 ln N) rel_bound rms(logits); a
    log-probability moves by at most its logit's error plus the log-partition's (<= the largest
    logit error), so max |d logprob| <= 2 max |d logit|. The loss is a mean over T positions of
    -log p(target): replayed, its error averages down, |d loss| <~ 3 sqrt(2) rel_bound rms(logits) /
    sqrt(T) (three standard deviations of a mean of T terms of RMS <= sqrt(2) rel_bound rms).

    Free, the rounding flips decisions on near-ties, and a flip is not a rounding: it swaps one of a
    token's k experts (or one of a query's pools) for another, and moves that position's output by
    O(1) (max |d logit| 1.4-2.4 measured at init 1/sqrt(hidden); 0.01 at the tiny preset's 0.02).
    Its part of the loss grows with the fraction f of the decisions that flip (measured 0.4-8%) and
    with what a flip does to the loss, which depends on the model, not on u: measured, (loss
    difference - replayed loss difference) / f <= 0.19 relative. The bound is replayed bound + 0.25 f.
    """
    rel = 2 * math.sqrt(ROUNDINGS_PER_LAYER * cfg.num_hidden_layers + 2) * U
    logit = math.sqrt(2 * math.log(r.length * cfg.vocab_size)) * rel * r.rms_logit_reference
    replayed = 3 * math.sqrt(2) * rel * r.rms_logit_reference / math.sqrt(r.length) / r.loss_reference
    flipped = (r.routing_flips + r.selection_flips) / max(1, r.decisions)
    return Bounds(rel_logit=rel, max_abs_logit=logit, max_abs_logprob=2 * logit, loss_replayed_rel=replayed,
                  loss_free_rel=replayed + FLIP_LOSS * flipped)


def exceeded(r: PrecisionResult, b: Bounds) -> list[str]:
    """The figures of ``r`` above their bound in ``b``, as "name value > bound" (empty: within)."""
    pairs = [("rel_logit", r.rel_logit, b.rel_logit), ("max_abs_logit", r.max_abs_logit, b.max_abs_logit),
             ("max_abs_logprob", r.max_abs_logprob, b.max_abs_logprob),
             ("max_abs_logprob_before_flip", r.max_abs_logprob_before_flip, b.max_abs_logprob),
             ("loss_replayed_rel_diff", r.loss_replayed_rel_diff, b.loss_replayed_rel),
             ("loss_rel_diff", r.loss_rel_diff, b.loss_free_rel)]
    return [f"{name} {value:.3g} > {bound:.3g}" for name, value, bound in pairs
            if value is not None and not value <= bound]
