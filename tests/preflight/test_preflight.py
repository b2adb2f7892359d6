"""`genome-lm preflight` in its CPU mode: every section runs at tiny shapes (kernels under Triton's
interpreter), the report is complete and honest about what it skipped, and the command degrades
clearly without mlflow and ray (the lent GPU machine has neither)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from genome_lm.preflight import SECTIONS, Context
from genome_lm.preflight import environment as env_section


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("preflight") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command sets it itself
    proc = subprocess.run([sys.executable, "-m", "genome_lm", "preflight", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=1800)
    return proc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("preflight")  # one worker runs the 2-minute command for both
def test_cpu_preflight_runs_every_section(cpu_report):
    proc, report = cpu_report
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Triton's interpreter" in proc.stdout
    assert report["profile"].startswith("cpu") and report["ok"] is True
    sections = {s["name"]: s for s in report["sections"]}
    assert list(sections) == list(SECTIONS)
    assert all(s["status"] == "ok" for s in sections.values()), {n: (s["status"], s["note"]) for n,
                                                                 s in sections.items()}


@pytest.mark.slow
@pytest.mark.xdist_group("preflight")
def test_cpu_preflight_figures(cpu_report):
    _, report = cpu_report
    sections = {s["name"]: s for s in report["sections"]}
    parity = {(r["op"], r["backend"]): r for r in sections["parity"]["rows"]}
    for key in [("kda", "triton"), ("kda", "triton-fp32"), ("sparse mla", "triton"), ("sparse mla", "triton-fp32"),
                ("indexer scores", "triton"), ("indexer selection", "triton")]:
        assert parity[key]["ok"] is True and parity[key]["rel_err"] <= parity[key]["bound"], parity[key]
    assert parity[("kda", "triton-fp32")]["rel_err"] < 1e-5 < parity[("kda", "triton")]["rel_err"]
    assert "need a GPU" in parity[("kda", "fla")]["note"]  # skipped, and says why
    model = parity[("model (bf16, decisions replayed)", "triton")]  # issue 27: the whole model, not only each kernel
    assert model["ok"] is True and 0 < model["rel_err"] <= model["bound"], model
    assert model["shape"] == "tiny-long T130" and model["decisions"] > 0
    assert model["max_abs_logprob"] <= model["max_abs_logprob_bound"]
    compiled = sections["compile"]["rows"]
    assert len(compiled) >= 10 and all(r["ok"] and r["spill_stores"] == r["spill_loads"] == r["stack_bytes"] == 0
                                          for r in compiled)
    speed = sections["speed"]["rows"]
    timed = {(r["impl"], r["mode"]) for r in speed if "ms" in r}
    assert {("triton", "forward+backward"), ("genome-lm triton", "forward+backward"),
            ("torch SDPA math", "forward+backward")} <= timed
    assert "not GPU figures" in sections["speed"]["note"]
    (peak,) = sections["slice"]["rows"]
    assert abs(peak["measured_over_plan"] - 1) <= 0.15
    # the step's time beside its FLOPs at this CPU's matmul rate: never faster than that
    assert peak["measured_s"] > peak["predicted_s"] > 0
    assert peak["measured_over_predicted_s"] == peak["measured_s"] / peak["predicted_s"]
    resume = sections["resume"]
    assert resume["note"].startswith("bit-exact")
    assert all(r["loss_straight"] == r["loss_resumed"] for r in resume["rows"])


def test_environment_names_what_a_missing_package_turns_off(monkeypatch, tmp_path):
    real = env_section._version
    monkeypatch.setattr(env_section, "_version",
                        lambda d: None if d in ("mlflow", "ray", "transformer-engine") else real(d))
    rows, note = env_section.environment(Context(gpu=False, device="cpu", target="sm_90", work_dir=tmp_path))
    by = {r["item"]: r for r in rows}
    assert by["mlflow"]["value"] == "absent" and "tracking" in by["mlflow"]["note"]
    assert by["ray"]["value"] == "absent" and "Ray cluster" in by["ray"]["note"]
    assert "local (torch) spec" in by["transformer-engine"]["note"]
    assert not any(r.get("ok") is False for r in rows) and note == ""
    monkeypatch.setattr(env_section, "_version", lambda d: None if d == "megatron-core" else real(d))
    rows, note = env_section.environment(Context(gpu=False, device="cpu", target="sm_90", work_dir=tmp_path))
    assert "megatron-core" in note and any(r.get("ok") is False for r in rows)


@pytest.mark.slow
def test_resume_check_runs_without_mlflow_and_ray(tmp_path):
    """The lent GPU machine has neither: training still runs (tracking off, said once)."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["mlflow"] = None  # import mlflow -> ImportError
        sys.modules["ray"] = None
        from genome_lm.cli import run
        sys.argv = ["genome-lm", "preflight", "--only", "environment,resume", "--out", {str(tmp_path / 'r.json')!r}]
        run()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert [s["status"] for s in report["sections"]] == ["ok", "ok"]
    assert "mlflow" in (proc.stdout + proc.stderr).lower()  # the tracker says tracking is off


def test_unknown_section_and_bad_dataset_are_one_line_errors(tmp_path):
    for args, words in ((["--only", "speed,warp"], "unknown section warp"),
                        (["--dataset", str(tmp_path)], "not a prepared dataset")):
        proc = subprocess.run([sys.executable, "-m", "genome_lm", "preflight", *args, "--out",
                               str(tmp_path / "x.json")],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and words in proc.stderr, proc.stderr
        assert not (tmp_path / "x.json").exists()
