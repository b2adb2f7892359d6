"""The command line: every command explains itself, sizes parse, the demo runs every stage."""

import pytest
import typer
from typer.testing import CliRunner

from genome_lm.cli import app, parse_size

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


@pytest.mark.parametrize("text,value", [("524288", 524_288), ("512k", 524_288), ("1M", 1_048_576), ("32K", 32_768), ("2m", 2 << 20)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "k", "1.5k", "-3", "0", "12q"])
def test_parse_size_rejects(text):
    with pytest.raises(typer.BadParameter):
        parse_size(text)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("genome-lm ")


FAST_DEMO = ["--window", "8k", "--quiet", "--set", "train.steps=2", "--set", "data.seq_len=1024",
             "--set", "train.indexer_dense_steps=0", "--eval-windows", "1"]


def test_demo_runs_every_stage(tmp_path):
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo"), *FAST_DEMO])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "demo" / "genome.planted.json").exists()
    assert (tmp_path / "demo" / "dataset" / "manifest.json").exists()
    assert (tmp_path / "demo" / "run" / "checkpoints" / "step-000002" / "meta.json").exists()
    assert (tmp_path / "demo" / "run" / "mlflow.db").exists()
    assert "fine-tuning in" in result.output and "by preceding context" in result.output
    assert "overall after fine-tuning" in result.output
    again = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo"), *FAST_DEMO])
    assert "already up to date" in again.output
