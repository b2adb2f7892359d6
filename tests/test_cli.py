"""The command line: every command explains itself, sizes parse, the demo runs every stage."""

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from genome_lm import weights
from genome_lm.cli import app
from genome_lm.units import parse_size

runner = CliRunner()


def _commands(group: typer.Typer, prefix=()):
    for info in group.registered_commands:
        yield prefix + (info.name or info.callback.__name__.replace("_", "-"),)
    for sub in group.registered_groups:
        yield prefix + (sub.name,)
        yield from _commands(sub.typer_instance, prefix + (sub.name,))


@pytest.mark.parametrize("command", [" ".join(c) for c in _commands(app)])
def test_every_command_has_help(command):
    result = runner.invoke(app, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output and len(result.output.splitlines()) > 5


@pytest.mark.parametrize("text,value", [("524288", 524_288), ("512k", 524_288), ("1M", 1_048_576), ("32K", 32_768),
                                        ("2m", 2 << 20)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "k", "1.5k", "-3", "0", "12q"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("genome-lm ")


FAST_DEMO = ["--window", "8k", "--quiet", "--set", "train.steps=2", "--set", "data.seq_len=1024",
             "--set", "train.indexer_dense_steps=0", "--eval-windows", "1"]


@pytest.mark.slow
def test_demo_runs_every_stage(tmp_path):
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo"), *FAST_DEMO])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "demo" / "genome.planted.json").exists()
    assert (tmp_path / "demo" / "dataset" / "manifest.json").exists()
    assert (tmp_path / "demo" / "run" / "checkpoints" / "step-000002" / "meta.json").exists()
    assert (tmp_path / "demo" / "run" / "mlflow.db").exists()
    assert "fine-tuning in" in result.output and "by preceding context" in result.output
    # the summary sets the model against baselines that need no model, and names each
    text = " ".join(result.output.split())
    assert "for guessing A, C, G, T uniformly" in text and "Markov chain fitted on the training split" in text
    assert "--baseline (the run's starting weights)" in text
    # ... and against itself with its context cut; it starts from the shipped long-context model
    assert "model vs the same model with its context cut to 256 bases: loss" in text
    # it closes with what it measured, each line with its sign: the seed's finding, the chain, the cut
    closing = text[text.index("what this demo measured"):]
    assert "The seed's finding" in closing and "Markov chain" in closing and "The context beyond 256" in closing
    assert "long context helps" not in text
    meta = json.loads((tmp_path / "demo" / "run" / "checkpoints" / "step-000002" / "meta.json").read_text())
    assert Path(meta["config"]["model"]["checkpoint"]) == weights.ROOT / "tiny-long"
    again = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo"), *FAST_DEMO])
    assert again.exit_code == 0, again.output  # a demo again continues its finished run, never overwrites it
    assert "already up to date" in again.output and "the run was already complete at step 2" in again.output


def test_help_reflows_sentences_and_shows_no_type_for_flags():
    """A docstring sentence broken across source lines is one line in a wide --help; a flag such as
    --version shows no "<bool>" value."""
    result = runner.invoke(app, ["finetune", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.split()) for line in result.output.splitlines()]
    assert any("every rank runs this command and the sizes in" in line for line in lines)  # two source lines
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert "--version" in top.output and "<bool>" not in top.output
    assert "<bool>" not in result.output and "--resume" in result.output


def test_a_bad_set_field_blames_set_not_the_config_file(tmp_path):
    result = runner.invoke(app, ["finetune", "--set", "train.stepz=5", "--set", f"train.out_dir={tmp_path / 'r'}"])
    assert result.exit_code == 1
    assert result.output.startswith("error: --set train.stepz:") and ".yaml" not in result.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("backend,tol", [("torch", 1e-4), ("triton-fp32", 1e-4), ("triton", 5e-2)])
def test_parity_bound_follows_the_backend(backend, tol, monkeypatch, tmp_path):
    """parity's default --tol: 1e-4 for the fp32 paths, the bf16 bound for the tensor-core one."""
    from genome_lm.compare import parity

    seen = {}
    monkeypatch.setattr(parity, "run_parity", lambda hf, lengths, *, tol, **kw: seen.update(tol=tol) or [])
    result = runner.invoke(app, ["parity", "--hf", str(tmp_path), "--backend", backend, "--lengths", "8"])
    assert result.exit_code == 0, result.output
    assert seen == {"tol": tol}


def test_parity_refuses_a_gpu_backend_without_a_gpu_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = runner.invoke(app, ["parity", "--hf", str(tmp_path), "--backend", "triton"])
    assert result.exit_code == 1
    assert "--backend triton: the triton backend needs a CUDA device" in result.output
    assert "Traceback" not in result.output


def test_help_placeholders_survive_markdown():
    """--help renders in markdown mode, which drops an <out>-style placeholder as an HTML tag
    ("kept in /.scores"): no help text may hold one, and eval's shows its OUT and RUN."""
    import re

    import typer.main

    def texts(cmd):
        yield cmd.help or ""
        for p in cmd.params:
            yield getattr(p, "help", None) or ""
        for sub in getattr(cmd, "commands", {}).values():
            yield from texts(sub)

    tags = [t for t in texts(typer.main.get_command(app)) if re.search(r"<[A-Za-z][\w.-]*>", t)]
    assert not tags, tags
    result = runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    lines = " ".join(" ".join(line.split()) for line in result.output.splitlines())
    assert "OUT/.scores" in lines and "RUN/eval-CHROM" in lines and " /.scores" not in lines


def test_training_summary_reports_means_over_the_ends_of_the_run(tmp_path):
    """The summary's first and last loss are means over min(10, a quarter of the run) steps, with
    the steps named: one batch's loss swings, and the demo's single steps 1 and 40 said +2.8%
    where its held-out evaluation said -0.98%."""
    from types import SimpleNamespace

    from genome_lm.cli.base import console
    from genome_lm.cli.train import print_training

    losses = [1.30, 1.20, 1.40] * 13 + [1.50]  # 40 steps: noisy, flat but for a high last step
    steps = [SimpleNamespace(step=i + 1, lm_loss=x, tokens_per_s=1000.0, peak_host_mib=10.0) for i,
             x in enumerate(losses)]
    result = SimpleNamespace(all_steps=steps, history=steps, resumed_from=None, out_dir=tmp_path, steps_done=40,
                             stopped_by=None, checkpoint=tmp_path / "ck", tracking=None,
                             loss_curve=tmp_path / "loss_curve.png")
    with console.capture() as captured:
        print_training(result)
    text = " ".join(captured.get().split())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert f"{first:.4f} (1-10)" in text and f"{last:.4f} (31-40)" in text
    assert f"{(last - first) / first * 100:+.1f}%" in text and "mean training LM loss" in text
    assert f"loss curve: {tmp_path / 'loss_curve.png'}" in text  # every file it wrote is named
    short = steps[:3]  # fewer than 8 steps: single steps at both ends
    with console.capture() as captured:
        print_training(SimpleNamespace(**{**vars(result), "all_steps": short, "history": short, "steps_done": 3}))
    text = " ".join(captured.get().split())
    assert "1.3000 (1)" in text and "1.4000 (3)" in text and "mean training" not in text


DNA_FASTA = "hg38_chr2_1-2333275.fa.gz"
FAST_DNA = ["--window", "8k", "--quiet", "--set", "train.steps=2", "--set", "data.seq_len=1024",
            "--set", "train.indexer_dense_steps=0"]


@pytest.mark.slow
def test_dna_study_on_real_sequence_end_to_end(tmp_path):
    """``demo --fasta --train --eval`` on real human sequence (hg38 chr2, soft-masked), at a small
    scale: regions prepared apart, the shipped model fine-tuned, every held-out window scored
    against the starting weights, the Markov chain fitted on the training region and the context
    cut to 1,024 bases, and the summary in words (Markov verdict, where the loss changed, repeats
    and unmasked bases apart, the far-context interval)."""
    from tests.conftest import shared_genome

    fasta = shared_genome(DNA_FASTA)
    out = tmp_path / "dna"
    result = runner.invoke(app, ["demo", "--fasta", str(fasta), "--out", str(out), "--train",
                                 "chr2:1,000,001-1,100,000",
                                 "--eval", "chr2:1,100,001-1,116,384", *FAST_DNA])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "dataset" / "manifest.json").read_text())
    chroms = {split: [(c["requested"], c["start"], c["end"]) for c in manifest["splits"][split]["chromosomes"]]
              for split in ("train", "eval")}
    assert chroms == {"train": [("chr2:1,000,001-1,100,000", 1_000_000, 1_100_000)],
                      "eval": [("chr2:1,100,001-1,116,384", 1_100_000, 1_116_384)]}
    report = json.loads((out / "run" / "eval" / "eval.json").read_text())
    # every held-out window: 16,384 bases in windows of 8k starting every 2,048 (a quarter window;
    # 5 whole ones and the 6,144-base tail from 10,240), so the intervals are over the region's two
    # blocks of 8k bases, not over its windows
    assert len(report["data"]["windows"]) == 6
    assert report["settings"]["bootstrap"]["unit"] == "block of 8,192 bases"
    assert report["settings"]["bootstrap"]["units"] == 2
    assert {"model", "baseline", "markov", "uniform"} <= set(report["results"])
    (cut,) = report["ablation"]["cuts"]
    assert cut["max_context"] == 1024 and cut["beyond"]["from"] == 2048 and cut["beyond"]["all"]["tokens"] > 0
    model = report["results"]["model"]
    assert model["softmasked"]["tokens"] > 0 and model["unmasked"]["tokens"] > 0
    text = " ".join(result.output.split())
    assert "the study in short" in text and "Markov chain fitted on the training regions" in text
    assert "6 overlapping windows score each held-out base at several context lengths" in text
    assert "the intervals are over blocks of 8,192 bases of sequence" in text
    assert "against its starting weights the loss changed most at" in text
    assert "on unmasked bases" in text and "on soft-masked (repeat) bases" in text
    assert "with at least 2,048 bases of context" in text


@pytest.mark.parametrize("args,message", [
    (["--train", "chr2:1-100,000"], "missing --eval"),
    (["--eval", "chr2:1-100,000"], "missing --train"),
    (["--train", "chr2:1-100,000", "--eval", "chr2:50,001-150,000"], "overlap"),
])
def test_dna_study_bad_arguments_are_one_line_errors(tmp_path, args, message):
    from tests.conftest import shared_genome

    fasta = shared_genome(DNA_FASTA)
    out = tmp_path / "dna"
    result = runner.invoke(app, ["demo", "--fasta", str(fasta), "--out", str(out), *args, *FAST_DNA])
    assert result.exit_code == 1 and result.output.startswith("error:") and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (out / "run").exists()
    assert not (out / "dataset" / "manifest.json").exists()


def test_dna_study_needs_its_fasta(tmp_path):
    result = runner.invoke(app, ["demo", "--fasta", str(tmp_path / "none.fa"), "--train", "chr1", "--eval", "chr2"])
    assert result.exit_code == 1 and "none.fa: no such FASTA file" in result.output


def test_an_error_message_is_printed_as_it_is(capsys):
    """A variant key (1:100:A>T) is no emoji code, and [brackets] are no markup."""
    from genome_lm.cli.base import fail

    with pytest.raises(typer.Exit) as stop:
        fail("variant 1:100:A>T in [bold]x.vcf[/bold] :smile:")
    assert stop.value.exit_code == 1
    assert capsys.readouterr().err.strip() == "error: variant 1:100:A>T in [bold]x.vcf[/bold] :smile:"


def test_help_lists_the_commands_in_the_order_of_a_study():
    """The demo first, then the study's stages; every command has its place in that order."""
    from genome_lm.cli.base import STUDY_ORDER

    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    listed = [line.split()[1] for line in result.output.splitlines() if line.startswith("│ ") and
              len(line.split()) > 1 and line.split()[1] in STUDY_ORDER]
    assert listed == STUDY_ORDER
    assert {c[0] for c in _commands(app)} == set(STUDY_ORDER)
