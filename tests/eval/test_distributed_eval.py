"""`genome-lm eval` over two ranks (torchrun, and Ray workers; gloo): tensor, context, expert and
data parallel give the one-process report of the same checkpoint (per-bucket losses within 1e-5
relative, the same intervals), rank 0 alone writes it, and a re-run after a kill scores only the
windows that were not in the cache yet."""

import json
import os
import subprocess
import sys

import pytest

from genome_lm.engine.parallel import free_port
from genome_lm.eval.evaluate import EvalRequest, eval_on_ray, evaluate

pytestmark = pytest.mark.slow  # a local Ray cluster and two workers per run


def _request(demo_run, out, **extra):
    return EvalRequest(model=str(demo_run / "run"), out=out, chrom="22", chunk=None, max_windows=4, resamples=200,
                       tracking=False, **extra)


@pytest.fixture(scope="module")
def one_process(demo_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-one")
    return evaluate(_request(demo_run, out, max_contexts=[300]), progress=False).to_json()  # as eval.json holds it


def _assert_same_report(one, two):
    assert two["data"]["windows"] == one["data"]["windows"] and two["data"]["tokens"] == one["data"]["tokens"]
    for name, entry in one["results"].items():
        for a, b in zip(entry["buckets"], two["results"][name]["buckets"], strict=True):
            assert b["tokens"] == a["tokens"]
            if a["nats"] is None:
                continue
            assert b["nats"] == pytest.approx(a["nats"], rel=1e-5), (name, a["from"])
            assert b["nats_ci"] == pytest.approx(a["nats_ci"], rel=1e-5), (name, a["from"])
        assert two["results"][name]["all"]["nats"] == pytest.approx(entry["all"]["nats"], rel=1e-5)


def _torchrun_eval(demo_run, out, sets: list[str], *extra, ranks: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node RANKS -m genome_lm eval ...` on the demo run's 4 chr22 windows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "genome_lm", "eval", "--model", str(demo_run / "run"),
           "--chrom", "22", "--chunk", "0", "--max-windows", "4", "--resamples", "200", "--no-tracking", "--quiet",
           "--out", str(out), *(a for s in sets for a in ("--set", s)), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "COLUMNS": "200"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"cp": 2}, {"ep": 2}, {"pp": 2}, {"tp": 2, "sequence_parallel": True},
                                    {}],
                         ids=["tp2", "cp2", "ep2", "pp2", "tp2-sp", "dp2"])
def test_two_ranks_give_the_one_process_report(demo_run, one_process, tmp_path, layout):
    out = tmp_path / "eval"
    full = {"tp": 1, "cp": 1, "ep": 1, "etp": 1, "pp": 1, "sequence_parallel": False, "split_dsa_selection": True,
            "moe_shared_expert_overlap": False,
            **layout}
    sets = [f"parallel.{k}={v}" for k, v in full.items()]
    run = _torchrun_eval(demo_run, out, sets, "--max-context", "300")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.count("bits per base:") == 1  # rank 0 reports, once
    two = json.loads((out / "eval.json").read_text())
    assert two["settings"]["ranks"] == 2 and two["settings"]["layout"] == full
    _assert_same_report(one_process, two)
    # the context ablation (segments of 300 as rows of one batch, the ragged last one alone)
    for a, b in zip(one_process["ablation"]["cuts"][0]["buckets"], two["ablation"]["cuts"][0]["buckets"], strict=True):
        if a["delta"] is not None:
            assert b["delta"] == pytest.approx(a["delta"], rel=1e-4, abs=1e-6)
    assert (out / "loss_by_context.png").stat().st_size > 0


@pytest.mark.parametrize("layout", [{"tp": 2, "pp": 2}, {"cp": 2}], ids=["tp2-pp2", "cp2-dp2"])
def test_four_ranks_give_the_one_process_report(demo_run, one_process, tmp_path, layout):
    """Four ranks: the model split two ways at once, or two context-parallel groups that share
    out the windows."""
    out = tmp_path / "eval"
    full = {"tp": 1, "cp": 1, "ep": 1, "etp": 1, "pp": 1, "sequence_parallel": False, "split_dsa_selection": True,
            "moe_shared_expert_overlap": False,
            **layout}
    run = _torchrun_eval(demo_run, out, [f"parallel.{k}={v}" for k, v in full.items()], ranks=4)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    two = json.loads((out / "eval.json").read_text())
    assert two["settings"]["ranks"] == 4 and two["settings"]["layout"] == full
    one = {**one_process, "results": {k: v for k, v in one_process["results"].items() if "cut" not in k}}
    _assert_same_report(one, two)


def test_a_killed_distributed_eval_rerun_scores_only_what_is_missing(demo_run, one_process, tmp_path):
    """On Ray workers. Two windows' scores lost, as if the run had been killed before them, and a
    third damaged on disk: the re-run scores those three on every rank (a damaged file taken as
    there by rank 0 and re-scored by it alone hung the split model's collectives; issue 54,
    defect 2), reads the last back untouched, and gives the same report."""
    out = tmp_path / "eval"
    layout = {"tp": 2, "cp": 1, "ep": 1, "etp": 1, "pp": 1, "sequence_parallel": False}
    eval_on_ray(_request(demo_run, out, layout=layout), address="local", workers=2, progress=False)
    (folder,) = (out / ".scores").iterdir()
    files = sorted(folder.glob("window-*.npy"))
    assert len(files) == 4
    kept = {f.name: f.stat().st_mtime_ns for f in files[:1]}
    files[1].write_bytes(files[1].read_bytes()[:100])  # damaged: a truncated array
    for f in files[2:]:
        f.unlink()
    (out / "eval.json").unlink()
    again = eval_on_ray(_request(demo_run, out, layout=layout), address="local", workers=2, progress=False).to_json()
    assert sorted(f.name for f in folder.glob("window-*.npy")) == [f.name for f in files]
    assert {name: (folder / name).stat().st_mtime_ns for name in kept} == kept  # read back, not rewritten
    _assert_same_report(one_process, again)


def test_a_layout_the_workers_cannot_hold_is_one_line(demo_run, tmp_path):
    from genome_lm.errors import GenomeLMError

    layout = {"tp": 4, "cp": 1, "ep": 1, "etp": 1, "pp": 1, "sequence_parallel": False}
    with pytest.raises(GenomeLMError, match="world size 2 is not a multiple of tp\\*cp\\*pp = 4"):
        eval_on_ray(_request(demo_run, tmp_path / "x", layout=layout), address="local", workers=2, progress=False)
    with pytest.raises(GenomeLMError, match="world size 2 is not a multiple of tp\\*cp\\*pp = 4"):
        eval_on_ray(_request(demo_run, tmp_path / "x", layout={**layout, "tp": 2, "pp": 2}), address="local",
                    workers=2, progress=False)
    assert not (tmp_path / "x").exists()
