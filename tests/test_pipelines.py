"""The pipeline scripts hold only CLI calls: each `genome-lm` call names a command that exists and
only options that command takes (read from its --help), so a renamed option fails here rather
than hours into a cluster run."""

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "pipelines").glob("*.sh"))


def _calls(script: Path) -> list[list[str]]:
    """Every `genome-lm ...` command of a shell script, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    calls = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("genome-lm "):
            calls.append(shlex.split(line, comments=True)[1:])
    return calls


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_call_uses_existing_commands_and_options(script):
    calls = _calls(script)
    assert calls, f"{script.name}: no genome-lm call"
    runner = CliRunner()
    for args in calls:
        command = args[0]
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "300"})
        assert result.exit_code == 0, f"{script.name}: genome-lm {command}: {result.output[-500:]}"
        for option in (a for a in args[1:] if a.startswith("--")):
            assert option.split("=")[0] in result.output, f"{script.name}: genome-lm {command} has no {option}"
