"""``genome-lm variants``: zero-shot variant effect scores of a VCF, by preceding context.

For each variant and each preceding-context length L the model scores a window of L bases before
the first base the variant changes, the allele, and ``right`` bases after it, once with the
reference allele and once with the alternative. The score is the log-likelihood ratio over the
positions the variant can change (the allele and everything after it):

- ``sum``: sum log p(alt window) - sum log p(ref window) over those positions;
- ``mean``: the same per position (for an indel the two alleles cover different counts).

A negative score says the model finds the alternative less likely: more damaging. With ``rc``
the window is also read on the other strand (the reverse complement, L bases of preceding
context on that strand too) and the two scores averaged. The order-k Markov chain fitted on the
FASTA's records gives the same ratio with no model.

The per-site sharing (``variants.score``): all variants that change the same first base share the
preceding context, which runs once.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from genome_lm import __version__
from genome_lm.data.tokenizer import BASE_TOKENS, tokenize
from genome_lm.engine import quiet_megatron_import
from genome_lm.errors import GenomeLMError
from genome_lm.progress import progress_bar
from genome_lm.units import size_label

from .schema import MarkovInfo, Models, Settings, VariantsReport

COMPLEMENT = str.maketrans("ACGTNacgtn", "TGCANtgcan")


def reverse_complement(seq: str) -> str:
    return seq.translate(COMPLEMENT)[::-1]


@dataclass
class Site:
    """Variants that change the same first base: the same preceding context on the forward
    strand (``start``); on the reverse strand those that end at the same base share it."""

    contig: str
    position: int  # 0-based start (forward) or end (reverse) of the change
    members: list[int] = field(default_factory=list)  # indices into the variant list


def sites(variants, strand: str) -> list[Site]:
    found: dict[tuple[str, int], Site] = {}
    for i, v in enumerate(variants):
        at = v.start if strand == "+" else v.end
        found.setdefault((v.contig, at), Site(v.contig, at)).members.append(i)
    return list(found.values())


def allele_windows(v, fasta, left: int, right: int, strand: str) -> tuple[bytes, bytes, bytes]:
    """(preceding context, reference continuation, alternative continuation) as bytes, read in the
    direction of ``strand``: the continuation is the allele and ``right`` bases. On the reverse
    strand the context is what follows the variant on the forward one (``vcf.windows`` with the
    sides swapped, reverse-complemented)."""
    from .vcf import windows

    if strand == "+":
        ref, alt, at = windows(v, fasta, left, right)
    else:
        ref, alt, _ = windows(v, fasta, right, left)
        ref, alt, at = reverse_complement(ref), reverse_complement(alt), left
    return ref[:at].encode(), ref[at:].encode(), alt[at:].encode()


def score_model(lm, variants, fasta, *, left: int, right: int, strand: str = "+", chunk: int | None = None,
                on_site=None) -> tuple[np.ndarray, np.ndarray]:
    """(sum, mean) log-likelihood ratios [n variants] of a model at preceding context ``left``."""
    from .score import continuation_logprobs

    total = np.full(len(variants), np.nan)
    mean = np.full(len(variants), np.nan)
    for site in sites(variants, strand):
        wanted: dict[bytes, int] = {}
        pairs = []
        for i in site.members:  # the same preceding context for all of them
            prefix, ref, alt = allele_windows(variants[i], fasta, left, right, strand)
            pairs.append((i, wanted.setdefault(ref, len(wanted)), wanted.setdefault(alt, len(wanted))))
        conts = list(wanted)
        lps = continuation_logprobs(lm.model, tokenize(prefix), [tokenize(c) for c in conts],
                                    token_map=lm.token_map, chunk=chunk)
        for i, r, a in pairs:
            total[i] = lps[a].sum() - lps[r].sum()
            mean[i] = lps[a].mean() - lps[r].mean()
        if on_site is not None:
            on_site(len(site.members))
    return total, mean


def score_markov(markov, variants, fasta, *, right: int, strand: str = "+") -> tuple[np.ndarray, np.ndarray]:
    """The order-k chain's (sum, mean) log-likelihood ratios: it sees ``markov.order`` bases."""
    total = np.full(len(variants), np.nan)
    mean = np.full(len(variants), np.nan)
    k = max(markov.order, 1)
    for i, v in enumerate(variants):
        before, ref, alt = allele_windows(v, fasta, k, right, strand)
        lp = [-markov.nll(tokenize(before + c))[len(before) - 1:] for c in (ref, alt)]
        total[i] = lp[1].sum() - lp[0].sum()
        mean[i] = lp[1].mean() - lp[0].mean()
    return total, mean


MARKOV_BASES = 16_000_000  # at most this much of the records' sequence fits the chain


def reference_sequences(fasta, contigs: list[str], max_bases: int = MARKOV_BASES) -> list[np.ndarray]:
    """Token arrays of the N-free stretches of ``contigs`` (a record may be mostly N, as the
    BRCA1 reference is before its 200 kbp), at most ``max_bases`` in all."""
    out, left = [], max_bases
    for contig in contigs:
        tokens = tokenize(fasta.fetch(contig, 0, fasta.lengths[contig]).encode())
        base = np.isin(tokens, BASE_TOKENS)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], base.astype(np.int8), [0]])))
        for a, b in zip(edges[::2], edges[1::2]):
            if b - a >= 64 and left > 0:
                out.append(tokens[a:min(b, a + left)])
                left -= out[-1].size
    return out


@dataclass
class VariantRequest:
    vcf: Path
    fasta: Path
    model: str
    out: Path
    baseline: str | None = None
    contexts: list[int] = field(default_factory=lambda: [4096])  # preceding context, bases
    right: int = 4095  # following context: with 4,096 before, the field's 8,192-base window
    rc: bool = False
    score: str = "sum"  # the ratio the metrics rank by: sum or mean
    max_indel: int = 50
    label: str | None = None
    positive: tuple[str, ...] = ()
    negative: tuple[str, ...] | None = None
    compare: tuple[str, ...] = ()
    strict: bool = False
    chunk: int | None = None
    resamples: int = 1000
    seed: int = 0
    max_variants: int | None = None
    tracking: bool = True
    tracking_uri: str | None = None


def no_variant_scored(vcf: Path, skipped) -> str:
    """Why a run has nothing to score, in one line: the skips by reason and the first of them, to
    look up (nothing is written, so no file lists them)."""
    from .report import reason_counts, reasons_in_words

    if not skipped:
        return f"{vcf}: no variant could be scored: the file has no variant records"
    first = skipped[0]  # chrom:pos ref>alt, as a reader looks it up in the VCF
    return (f"{vcf}: no variant could be scored: {len(skipped):,} skipped "
            f"({reasons_in_words(reason_counts(skipped))}); the first: {first.chrom}:{first.pos} "
            f"{first.ref}>{first.alt}, {first.reason}")


def run_variants(req: VariantRequest, *, progress: bool = True, on_note=None) -> VariantsReport:
    """Score every variant of ``req.vcf``, write the report files into ``req.out``; returns the
    report."""

    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.eval.baselines import fit_markov_on
    from genome_lm.eval.models import load_model

    from . import report as rep
    from .vcf import Reference, read_variants

    note = on_note or (lambda text: None)
    if req.score not in ("sum", "mean"):
        raise GenomeLMError(f"--score {req.score}: expected sum or mean")
    if not req.contexts or min(req.contexts) < 1 or req.right < 0:
        raise GenomeLMError("--contexts: at least one preceding context of 1 base or more; --right >= 0")
    out = Path(req.out)
    started = time.time()
    # on the reverse strand the preceding context lies after the variant: both sides must hold it
    reach = max(req.contexts)
    left, right = (max(reach, req.right), max(reach, req.right)) if req.rc else (reach, req.right)
    found = read_variants(req.vcf, req.fasta, left=left, right=right, max_indel=req.max_indel, strict=req.strict,
                          label=req.label, positive=req.positive, negative=req.negative)
    variants = list(found.variants)
    labels = None if found.labels is None else np.asarray(found.labels, dtype=np.int64)
    if req.max_variants is not None:
        variants = variants[:req.max_variants]
        labels = None if labels is None else labels[:req.max_variants]
    if not variants:
        raise GenomeLMError(no_variant_scored(req.vcf, found.skipped))
    with Reference(req.fasta) as fasta:
        records = sorted({v.contig for v in variants})
        markov = fit_markov_on(reference_sequences(fasta, records))
        per_strand: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # score -> (sum, mean) per strand
        strands = ("+", "-") if req.rc else ("+",)
        with quiet_megatron_import(), parallel_context(ParallelSizes()) as pg:
            loaded = {"model": load_model(req.model, pg)}
            if req.baseline:
                loaded["baseline"] = load_model(req.baseline, pg, init_of=loaded["model"])
            jobs = [(name, L, strand) for name in loaded for L in sorted(set(req.contexts)) for strand in strands]
            with progress_bar(quiet=not progress) as bar:
                for name, L, strand in jobs:
                    task = bar.add_task(f"{name} at {size_label(L)}{' (reverse strand)' if strand == '-' else ''}",
                                        total=len(variants), unit="variants")
                    per_strand.setdefault(f"{name}@{L}", []).append(
                        score_model(loaded[name], variants, fasta, left=L, right=req.right, strand=strand,
                                    chunk=req.chunk, on_site=lambda n, t=task: bar.advance(t, n)))
        per_strand["markov"] = [score_markov(markov, variants, fasta, right=req.right, strand=strand)
                                for strand in strands]
    scores = rep.combine(per_strand)  # strand-averaged sum and mean per model, context and the chain
    compare = rep.compare_columns(variants, req.compare, req.vcf)
    settings = Settings(vcf=str(req.vcf), fasta=str(req.fasta), contexts=sorted(set(req.contexts)), right=req.right,
                        reverse_complement=req.rc, score=req.score, max_indel=req.max_indel, label=req.label,
                        positive=list(req.positive), negative=None if req.negative is None else list(req.negative),
                        compare=list(req.compare), resamples=req.resamples, seed=req.seed, chunk=req.chunk)
    models = Models(model=loaded["model"].info, baseline=loaded["baseline"].info if "baseline" in loaded else None,
                    markov=MarkovInfo(order=markov.order, fitted_on=records, bases=markov.train_bases))
    report = VariantsReport(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), genome_lm=__version__,
        seconds=round(time.time() - started, 1), settings=settings, models=models,
        data=rep.data_summary(variants, labels, found.skipped),
        metrics=rep.metrics(scores, compare, labels, variants, req) if labels is not None else None)
    report.summary = rep.summary(report, out / rep.SKIPPED_TSV if found.skipped else None)
    rep.write_outputs(report, variants, labels, scores, compare, out, skipped=found.skipped)
    if req.tracking:
        report.mlflow = rep.log_to_mlflow(report, out, loaded["model"], req.tracking_uri, note, started)
        rep.write_json(report, out / "variants.json")
    return report
