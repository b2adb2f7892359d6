"""Variant probes (``genome_lm.variants.probe``): the grouped folds never split a block between
training and test; a probe on shuffled labels is at chance and one on labels that are a known
function of the features recovers it; the features equal the model's own forward over each
allele's window; a saved probe applies as fitted and refuses another model's embeddings."""

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from genome_lm.errors import GenomeLMError
from genome_lm.variants.probe import (
    PROBE_SCHEMA,
    Probe,
    ProbeSpec,
    cross_validate,
    fit_probe,
    position_folds,
    position_groups,
    variant_features,
)


def _positions(rng, n):
    contigs = list(rng.choice(["chr1", "chr2", "chr17"], n))
    starts = rng.integers(0, 200_000, n)
    return contigs, starts


@pytest.mark.parametrize("seed", range(5))
def test_no_block_is_in_both_training_and_test(seed):
    rng = np.random.default_rng(seed)
    contigs, starts = _positions(rng, 500)
    folds = position_folds(contigs, starts, block=1000, k=5)
    groups = position_groups(contigs, starts, 1000)
    assert set(folds.tolist()) == set(range(5))
    for g in np.unique(groups):
        assert len(set(folds[groups == g].tolist())) == 1  # a block lies in one fold only
    # a naive check of the same from the positions themselves
    for f in range(5):
        test = {(c, s // 1000) for c, s, k in zip(contigs, starts.tolist(), folds.tolist()) if k == f}
        train = {(c, s // 1000) for c, s, k in zip(contigs, starts.tolist(), folds.tolist()) if k != f}
        assert not test & train
    with pytest.raises(GenomeLMError, match="blocks of 1,000,000 bases; use fewer folds"):
        position_folds(contigs, starts, block=1_000_000, k=5)


def test_shuffled_labels_are_at_chance_and_a_known_function_is_recovered():
    rng = np.random.default_rng(4)
    n, f = 600, 24
    X = rng.normal(size=(n, f))
    contigs, starts = _positions(rng, n)
    w = np.zeros(f)
    w[:3] = (2.0, -1.5, 1.0)
    y = (X @ w + rng.normal(0, 0.5, n) > 0).astype(int)
    known = cross_validate(X, y, contigs, starts, block=1000, k=5)
    assert roc_auc_score(y, known.scores) > 0.93 and not np.isnan(known.scores).any()
    shuffled = rng.permutation(y)
    chance = cross_validate(X, shuffled, contigs, starts, block=1000, k=5)
    assert 0.4 < roc_auc_score(shuffled, chance.scores) < 0.6
    with pytest.raises(GenomeLMError, match="both classes"):
        cross_validate(X, np.zeros(n), contigs, starts)


def test_a_saved_probe_applies_as_fitted_and_refuses_another_model(tmp_path):
    rng = np.random.default_rng(2)
    X = rng.normal(size=(300, 10))
    y = (X[:, 0] > 0).astype(int)
    contigs, starts = _positions(rng, 300)
    probe = fit_probe(X, y, contigs, starts, ProbeSpec(), "f" * 64)
    probe.save(tmp_path / "probe.json")
    back = Probe.load(tmp_path / "probe.json", "f" * 64)
    assert back.schema == PROBE_SCHEMA and back.C in (1e-3, 1e-2, 1e-1, 1.0, 10.0)
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    z = StandardScaler().fit(X)
    want = LogisticRegression(C=back.C, max_iter=5000).fit(z.transform(X), y).decision_function(z.transform(X))
    np.testing.assert_allclose(back.decision(X), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(GenomeLMError, match="fitted on another model's embeddings"):
        Probe.load(tmp_path / "probe.json", "0" * 64)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(GenomeLMError, match="not a genome-lm probe"):
        Probe.load(tmp_path / "bad.json")


def test_features_are_the_models_own_forward_over_each_allele(tmp_path):
    """Each variant's reference and alternative features are the mean hidden state, over the
    allele and the ``right`` bases after it, of a full forward over its window (the model cut
    after the layer, no hooks): 1e-5 of the largest value; the difference is alt - ref."""
    import pysam

    from genome_lm.data.tokenizer import tokenize
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.eval.models import LoadedModel, ModelInfo
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model
    from genome_lm.variants.run import allele_windows
    from genome_lm.variants.score import continuation_logprobs
    from genome_lm.variants.vcf import Reference, read_variants
    from tests.eval.test_embeddings import reference

    rng = np.random.default_rng(5)
    seq = "".join(rng.choice(list("ACGT"), 1200))
    fa = tmp_path / "ref.fa"
    fa.write_text(">chr5\n" + "\n".join(seq[i:i + 60] for i in range(0, len(seq), 60)) + "\n")
    pysam.faidx(str(fa))
    header = pysam.VariantHeader()
    header.contigs.add("chr5", length=len(seq))
    vcf = tmp_path / "v.vcf"
    with pysam.VariantFile(str(vcf), "w", header=header) as out:
        for pos in (400, 400, 650, 651):
            ref = seq[pos - 1]
            alt = [b for b in "ACGT" if b != ref][pos % 3]
            r = out.new_record(contig="chr5", start=pos - 1, alleles=(ref, alt))
            out.write(r)
        r = out.new_record(contig="chr5", start=899, alleles=(seq[899:902], seq[899]))  # a deletion
        out.write(r)
    variants = list(read_variants(vcf, fa, left=300, right=40).variants)
    spec = ProbeSpec(layers=("layer_1", "final"), contexts=(150, 300), right=40)
    with parallel_context(ParallelSizes()) as pg:
        torch.manual_seed(3)
        model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="torch").eval()
        lm = LoadedModel(model, ModelInfo(kind="preset", path="preset:tiny"))
        zero_shot = {}
        X = variant_features(lm, variants, Reference(fa), spec, chunk=64, zero_shot=zero_shot)
        D = model.cfg.hidden_size
        assert X.shape == (len(variants), 2 * 2 * 3 * D) and np.isfinite(X).all()
        with Reference(fa) as fasta:
            for i, v in enumerate(variants):
                for c, L in enumerate(spec.contexts):
                    prefix, ref, alt = allele_windows(v, fasta, L, spec.right, "+")
                    for j, layer in enumerate(spec.layers):
                        got = X[i].reshape(2, 2, 3, D)[c, j]
                        for k, allele in enumerate((ref, alt)):
                            window = tokenize(prefix + allele)
                            want = reference(model, window, layer)[len(prefix):].mean(0)
                            np.testing.assert_allclose(got[k], want, rtol=0, atol=1e-5 * np.abs(want).max())
                        np.testing.assert_allclose(got[2], got[1] - got[0], rtol=1e-6, atol=1e-7)
                    # the zero-shot ratio from the same forwards: variants.score's shared-prefix scoring
                    lp_ref, lp_alt = continuation_logprobs(model, tokenize(prefix), [tokenize(ref), tokenize(alt)])
                    assert zero_shot[L][i] == pytest.approx(lp_alt.sum() - lp_ref.sum(), rel=1e-5, abs=1e-5)


def test_probe_command_fits_applies_and_refuses(tmp_path):
    """``genome-lm probe`` on a small labelled VCF: every output written, a row per variant with
    its fold, AUROC and AUPRC for the probe, the baseline, the zero-shot ratio, the Markov chain
    and a --compare field; --apply with the
    same model scores the VCF with the saved probe; with another model, or without labels and a
    probe, one line and exit 1."""
    import json

    from typer.testing import CliRunner

    from genome_lm.cli import app
    from tests.variants.test_variants_cli import _write_inputs

    vcf, fa = _write_inputs(tmp_path, np.random.default_rng(1))
    base = ["probe", "--vcf", str(vcf), "--fasta", str(fa), "--model", "builtin:tiny-long", "--contexts", "128",
            "--right", "16", "--layers", "0,final", "--quiet"]
    fitted = tmp_path / "fit"
    result = CliRunner().invoke(app, [*base, "--label", "CLASS", "--positive", "bad", "--compare", "SCORE",
                                      "--folds", "2", "--block", "200", "--resamples", "50", "--out", str(fitted)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    report = json.loads((fitted / "probe-report.json").read_text())
    assert set(report["metrics"]) == {"probe", "position + consequence", "zero-shot at 128", "markov", "SCORE"}
    rows = (fitted / "probe.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["variant", "probe", "position + consequence", "label", "fold", "zero-shot at 128",
                                   "markov"]
    assert len(rows) == 1 + report["variants"] and "  probe (n=" in result.output and "    AUROC " in result.output
    assert all(len(line) <= 80 for line in result.output.splitlines() if str(tmp_path) not in line), result.output
    probe = Probe.load(fitted / "probe.json")
    assert probe.layers == ["layer_0", "final"] and probe.contexts == [128] and probe.right == 16

    applied = tmp_path / "apply"
    result = CliRunner().invoke(app, [*base, "--apply", str(fitted / "probe.json"), "--out", str(applied)])
    assert result.exit_code == 0, result.output
    scores = [float(line.split("\t")[1]) for line in (applied / "probe.tsv").read_text().splitlines()[1:]]
    assert len(scores) == report["variants"] and np.isfinite(scores).all()

    other = CliRunner().invoke(app, ["probe", "--vcf", str(vcf), "--fasta", str(fa), "--model", "preset:tiny",
                                     "--apply", str(fitted / "probe.json"), "--out", str(tmp_path / "x")])
    assert other.exit_code == 1 and "fitted on another model's embeddings" in other.output
    unlabelled = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "y")])
    assert unlabelled.exit_code == 1 and "give --label" in unlabelled.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
