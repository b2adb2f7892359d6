"""Supervised variant-effect probes: a regularized logistic regression on the model's embeddings
around each variant, cross-validated with folds grouped by genomic position (issue 51).

**Features** (``variant_features``): for each preceding context L and each chosen layer
(``eval.embeddings``), the model reads L bases before the variant once (chunked prefill), then
each allele with ``right`` bases after it (``Prefill.fork``, as zero-shot scoring does); a
layer's embedding of an allele is the mean of its hidden states over those positions. A variant's
features are the reference's, the alternative's and their difference, for every (L, layer).

**Cross-validation** (``position_folds``, ``cross_validate``): neighbouring variants share
sequence (and in a saturation screen, the same codon), so a probe tested on a variant whose
neighbour it was trained on is flattered. The variants are grouped into blocks of ``block`` bases
of their contig, and whole blocks go to the folds: no block is in both a fold's training and
test variants. Inside each training part, the regularization strength is chosen by the same
grouped cross-validation (AUROC); the out-of-fold predictions of all variants give the AUROC and
AUPRC with bootstrap intervals (``variants.metrics``).

**Baseline**: the probe must beat what position and consequence class alone predict
(``baseline_features``): the same logistic regression on the variant's position (scaled) and a
one-hot of its consequence.

A fitted probe (``Probe``, saved as JSON) names the model's weights fingerprint, the layers,
contexts and ``right`` it was fitted with; applying it with another model is refused.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from genome_lm.data.tokenizer import tokenize
from genome_lm.engine import quiet_megatron_import
from genome_lm.errors import GenomeLMError
from genome_lm.eval.baselines import fit_markov_on
from genome_lm.eval.embeddings import parse_layers
from genome_lm.progress import progress_bar
from genome_lm.units import size_label

from .metrics import auprc, auroc, bootstrap
from .run import allele_windows, reference_sequences, score_markov, sites

if TYPE_CHECKING:
    from genome_lm.eval.models import LoadedModel

PROBE_SCHEMA = "genome-lm.probe/1"
C_GRID = (1e-3, 1e-2, 1e-1, 1.0, 10.0)


@dataclass(frozen=True)
class ProbeSpec:
    layers: tuple[str, ...] = ("final",)  # eval.embeddings names
    contexts: tuple[int, ...] = (1024,)
    right: int = 64  # bases after the allele whose hidden states are averaged


@torch.no_grad()
def variant_features(lm: LoadedModel, variants, fasta, spec: ProbeSpec, *, chunk: int | None = None,
                     on_variant=None, zero_shot: dict | None = None) -> np.ndarray:
    """[n variants, len(contexts) x len(layers) x 3 x hidden_size] float32 (module docstring).
    ``zero_shot`` (a dict) receives, per context, each variant's zero-shot log-likelihood ratio
    from the same forwards: sum log p(alt + right) - sum log p(ref + right), nats."""
    from genome_lm.eval.embeddings import LayerTaps
    from genome_lm.eval.score import _model_ids
    from genome_lm.model.prefill import Prefill

    model, width = lm.model.eval(), lm.model.cfg.hidden_size
    blocks = []
    with LayerTaps(model, spec.layers) as taps:
        for L in spec.contexts:
            feats = np.full((len(variants), len(spec.layers), 3, width), np.nan, dtype=np.float32)
            ratio = np.full(len(variants), np.nan)
            for site in sites(variants, "+"):
                windows = {i: allele_windows(variants[i], fasta, L, spec.right, "+") for i in site.members}
                prefix = tokenize(windows[site.members[0]][0])
                longest = max(max(len(r), len(a)) for _, r, a in windows.values())
                prefill = Prefill(model, total_tokens=len(prefix) + longest)
                ids = _model_ids(model, prefix, lm.token_map, None)[None]
                step = chunk or ids.shape[1]
                for start in range(0, ids.shape[1], step):
                    last = prefill(ids[:, start:start + step])[0, -1]  # predicts each allele's first token
                taps.take()
                means: dict[bytes, np.ndarray] = {}
                logp: dict[bytes, float] = {}
                for i, (_, ref, alt) in windows.items():
                    for k, allele in enumerate((ref, alt)):
                        if allele not in means:
                            cont = _model_ids(model, tokenize(allele), lm.token_map, None)
                            logits = prefill.fork(1)(cont[None])[0]  # [n, V]
                            hidden = taps.take()
                            means[allele] = np.stack([hidden[name].mean(0).cpu().numpy() for name in spec.layers])
                            preds = torch.cat([last[None], logits[:-1]]).float().log_softmax(-1)
                            logp[allele] = float(preds.gather(1, cont[:, None]).double().sum())
                        feats[i, :, k] = means[allele]
                    feats[i, :, 2] = feats[i, :, 1] - feats[i, :, 0]
                    ratio[i] = logp[alt] - logp[ref]
                    if on_variant is not None:
                        on_variant(1)
            blocks.append(feats.reshape(len(variants), -1))
            if zero_shot is not None:
                zero_shot[L] = ratio
    return np.concatenate(blocks, axis=1)


def consequence_classes(consequences: list[str | None]) -> list[str]:
    return sorted({str(c) for c in consequences if c is not None})


def baseline_features(variants, consequences: list[str | None], classes: list[str]) -> np.ndarray:
    """Position (Mbp) and a one-hot of the consequence over ``classes`` (the fitted probe's)."""
    pos = np.array([v.start for v in variants], dtype=np.float64) / 1e6
    out = [pos] + [np.array([str(c) == k for c in consequences], dtype=np.float64) for k in classes]
    return np.stack(out, axis=1)


def position_folds(contigs: list[str], starts: np.ndarray, *, block: int, k: int) -> np.ndarray:
    """Fold index [n] in 0..k-1: variants grouped by (contig, start // block), whole groups to a
    fold (``GroupKFold``: the folds as even in size as the groups allow)."""
    groups = position_groups(contigs, starts, block)
    if len(np.unique(groups)) < k:
        raise GenomeLMError(f"--probe-folds {k}: the variants fall in {len(np.unique(groups))} blocks of {block:,} "
                            "bases; use fewer folds or smaller blocks")
    fold = np.empty(len(groups), dtype=np.int64)
    for f, (_, test) in enumerate(GroupKFold(n_splits=k).split(np.zeros(len(groups)), groups=groups)):
        fold[test] = f
    return fold


def position_groups(contigs: list[str], starts: np.ndarray, block: int) -> np.ndarray:
    keys = [(c, int(s) // block) for c, s in zip(contigs, np.asarray(starts).tolist())]
    _, groups = np.unique(np.array([f"{c}:{b}" for c, b in keys]), return_inverse=True)
    return groups


def _fit(X: np.ndarray, y: np.ndarray, groups: np.ndarray, k_inner: int, seed: int):
    """A scaled, L2-regularized logistic regression, its C chosen by grouped inner CV (AUROC)."""
    best, best_auc = C_GRID[0], -1.0
    inner = min(k_inner, len(np.unique(groups)))
    if inner >= 2 and 0 < y.sum() < len(y):
        for C in C_GRID:
            scores = np.full(len(y), np.nan)
            for train, test in GroupKFold(n_splits=inner).split(X, y, groups):
                if len(np.unique(y[train])) < 2:
                    continue
                m = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=5000, random_state=seed))
                scores[test] = m.fit(X[train], y[train]).decision_function(X[test])
            ok = ~np.isnan(scores)
            if ok.any() and len(np.unique(y[ok])) == 2:
                auc = roc_auc_score(y[ok], scores[ok])
                if auc > best_auc:
                    best, best_auc = C, auc
    model = make_pipeline(StandardScaler(), LogisticRegression(C=best, max_iter=5000, random_state=seed))
    return model.fit(X, y), best


@dataclass
class CVResult:
    scores: np.ndarray  # out-of-fold decision values, higher = positive
    folds: np.ndarray
    C: list[float]  # chosen per fold


def cross_validate(X: np.ndarray, y: np.ndarray, contigs: list[str], starts: np.ndarray, *, block: int = 1000,
                   k: int = 5, k_inner: int = 4, seed: int = 0) -> CVResult:
    """Out-of-fold probe scores of every variant (module docstring)."""
    y = np.asarray(y).astype(np.int64)
    if len(np.unique(y)) < 2:
        raise GenomeLMError("the probe needs labelled variants of both classes")
    folds = position_folds(contigs, starts, block=block, k=k)
    groups = position_groups(contigs, starts, block)
    scores, chosen = np.full(len(y), np.nan), []
    for f in range(k):
        test, train = folds == f, folds != f
        if len(np.unique(y[train])) < 2:
            raise GenomeLMError(f"fold {f + 1}: its training variants hold one class; use fewer folds")
        model, C = _fit(X[train], y[train], groups[train], k_inner, seed)
        scores[test] = model.decision_function(X[test])
        chosen.append(C)
    return CVResult(scores, folds, chosen)


@dataclass
class Probe:
    """A fitted probe: the scaler and the regression, and what they were fitted on."""

    schema: str
    model_fingerprint: str
    layers: list[str]
    contexts: list[int]
    right: int
    C: float
    classes: list[str]  # the consequence classes of the baseline features
    mean: list[float]
    scale: list[float]
    coef: list[float]
    intercept: float
    n_train: int

    def decision(self, X: np.ndarray) -> np.ndarray:
        z = (X - np.asarray(self.mean)) / np.asarray(self.scale)
        return z @ np.asarray(self.coef) + self.intercept

    def save(self, path: Path) -> None:
        from genome_lm.eval.report import atomic_write

        atomic_write(Path(path), json.dumps(asdict(self)).encode())

    @classmethod
    def load(cls, path: Path, fingerprint: str | None = None) -> Probe:
        try:
            data = json.loads(Path(path).read_text())
            probe = cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise GenomeLMError(f"{path}: not a genome-lm probe ({exc})") from None
        if probe.schema != PROBE_SCHEMA:
            raise GenomeLMError(f"{path}: not a genome-lm probe (schema {probe.schema!r})")
        if fingerprint is not None and probe.model_fingerprint != fingerprint:
            raise GenomeLMError(f"{path}: fitted on another model's embeddings (weights fingerprint "
                                f"{probe.model_fingerprint[:12]}, this model's {fingerprint[:12]})")
        return probe


def fit_probe(X: np.ndarray, y: np.ndarray, contigs: list[str], starts: np.ndarray, spec: ProbeSpec,
              fingerprint: str, *, block: int = 1000, k_inner: int = 4, seed: int = 0,
              classes: list[str] | None = None) -> Probe:
    """The probe fitted on every labelled variant (C by grouped CV), to apply to another VCF."""
    model, C = _fit(X, np.asarray(y).astype(np.int64), position_groups(contigs, starts, block), k_inner, seed)
    scaler, reg = model[0], model[-1]
    return Probe(schema=PROBE_SCHEMA, model_fingerprint=fingerprint, layers=list(spec.layers),
                 contexts=list(spec.contexts), right=spec.right, C=C, classes=list(classes or []),
                 mean=scaler.mean_.tolist(),
                 scale=scaler.scale_.tolist(), coef=reg.coef_[0].tolist(), intercept=float(reg.intercept_[0]),
                 n_train=len(y))


@dataclass(frozen=True)
class ProbeRequest:
    vcf: Path
    fasta: Path
    model: str
    out: Path
    layers: str = "final"  # eval.embeddings.parse_layers text
    contexts: tuple[int, ...] = (1024,)
    right: int = 64
    label: str | None = None
    positive: tuple[str, ...] = ()
    negative: tuple[str, ...] | None = None
    compare: tuple[str, ...] = ()
    apply: Path | None = None  # a saved probe: score the VCF with it instead of fitting one
    folds: int = 5
    block: int = 1000
    chunk: int | None = None
    max_variants: int | None = None
    resamples: int = 1000
    seed: int = 0


def run_probe(req: ProbeRequest, *, progress: bool = True) -> dict:
    """Fit and cross-validate a probe on ``req.vcf``'s labelled variants (or, with ``req.apply``,
    score them with a saved one) into ``req.out``: ``probe.json`` (the probe fitted on every
    variant), ``probe.tsv`` (each variant's out-of-fold scores) and ``probe-report.json`` (AUROC
    and AUPRC with intervals: the probe on the model's features and position + consequence, the
    baseline on position + consequence alone, the model's zero-shot log-likelihood ratio over the
    allele and ``right`` bases at each context, the Markov chain's, the --compare fields).
    Returns the report."""
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.eval.cache import weights_fingerprint
    from genome_lm.eval.models import load_model
    from genome_lm.eval.report import atomic_write

    from .report import compare_columns
    from .vcf import Reference, read_variants

    if req.apply is None and not req.label:
        raise GenomeLMError("a probe is fitted on labelled variants: give --label (and --positive), or --apply PROBE")
    saved = Probe.load(req.apply) if req.apply is not None else None
    contexts, right = (tuple(saved.contexts), saved.right) if saved else (tuple(req.contexts), req.right)
    found = read_variants(req.vcf, req.fasta, left=max(contexts), right=right, label=req.label,
                          positive=req.positive, negative=req.negative)
    variants = list(found.variants)[:req.max_variants]
    if not variants:
        raise GenomeLMError(f"{req.vcf}: no variant could be scored")
    labels = None if found.labels is None else np.asarray(found.labels[:len(variants)], dtype=np.int64)
    compare = compare_columns(variants, req.compare, req.vcf)
    with quiet_megatron_import(), parallel_context(ParallelSizes()) as pg, Reference(req.fasta) as fasta:
        lm = load_model(req.model, pg)
        fingerprint = weights_fingerprint(lm.model)
        if saved is not None and saved.model_fingerprint != fingerprint:
            raise GenomeLMError(f"{req.apply}: fitted on another model's embeddings (weights fingerprint "
                                f"{saved.model_fingerprint[:12]}, {req.model}'s {fingerprint[:12]})")
        layers = tuple(saved.layers) if saved else parse_layers(req.layers, lm.model.cfg.num_hidden_layers)
        spec = ProbeSpec(layers, contexts, right)
        zero_shot: dict[int, np.ndarray] = {}
        with progress_bar(quiet=not progress) as bar:
            task = bar.add_task("probe features", total=len(variants) * len(spec.contexts), unit="variants")
            X = variant_features(lm, variants, fasta, spec, chunk=req.chunk, on_variant=lambda n: bar.advance(task, n),
                                 zero_shot=zero_shot)
        markov = fit_markov_on(reference_sequences(fasta, sorted({v.contig for v in variants})))
        markov_ratio = score_markov(markov, variants, fasta, right=spec.right)[0]
    consequences = [v.info.get("CONSEQUENCE") for v in variants]
    classes = saved.classes if saved else consequence_classes(consequences)
    base = baseline_features(variants, consequences, classes)
    contigs, starts = [v.contig for v in variants], np.array([v.start for v in variants])
    out = Path(req.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {"variant": [v.key for v in variants]}
    report: dict = {"schema": "genome-lm.probe-report/1", "vcf": str(req.vcf), "model": req.model,
                    "spec": asdict(spec), "variants": len(variants)}
    if saved is not None:
        rows["probe"] = saved.decision(np.concatenate([X, base], axis=1))
    else:
        full = np.concatenate([X, base], axis=1)
        cv = {name: cross_validate(data, labels, contigs, starts, block=req.block, k=req.folds, seed=req.seed)
              for name, data in (("probe", full), ("position + consequence", base))}
        rows.update({name: r.scores for name, r in cv.items()}, label=labels, fold=cv["probe"].folds)
        unsupervised = {f"zero-shot at {size_label(L)}": -r for L, r in zero_shot.items()}  # higher = damaging
        unsupervised["markov"] = -markov_ratio
        rows.update(unsupervised)
        columns = {**{name: r.scores for name, r in cv.items()}, **unsupervised, **compare}
        metrics = {}
        for name, values in columns.items():
            keep = ~np.isnan(values)
            y = labels[keep]
            if 0 < y.sum() < len(y):
                metrics[name] = {"n": int(keep.sum()),
                                 **{m.__name__: dict(zip(("value", "lo", "hi"),
                                                         bootstrap(values[keep], y, m, req.resamples, req.seed)))
                                    for m in (auroc, auprc)}}
        report.update(positives=int(labels.sum()), folds=req.folds, block=req.block, metrics=metrics,
                      C=cv["probe"].C)
        fit_probe(full, labels, contigs, starts, spec, fingerprint, block=req.block, seed=req.seed,
                  classes=classes).save(out / "probe.json")
    lines = ["\t".join(rows)] + ["\t".join(str(rows[k][i]) if not isinstance(rows[k][i], float) else f"{rows[k][i]:.6g}"
                                           for k in rows) for i in range(len(variants))]
    atomic_write(out / "probe.tsv", ("\n".join(lines) + "\n").encode())
    atomic_write(out / "probe-report.json", json.dumps(report, indent=1).encode())
    return report
