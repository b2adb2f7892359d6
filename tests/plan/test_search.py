"""``genome-lm plan --search`` (genome_lm.plan.search): the ranking against an exhaustive one, the
published setting among the candidates, the written config, and the shipped searched configs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from genome_lm.cli import app
from genome_lm.config import load_config
from genome_lm.plan import search as S
from genome_lm.plan.memory_model import Hardware, busiest, with_changes
from genome_lm.plan.time_model import estimate_time, gpu_spec

SLICE = "glm-5.3-flash-4layer-1gpu"


def _slice_run():
    return with_changes(load_config(SLICE, ["model.checkpoint=null"]), data={"seq_len": 131072},
                        train={"global_batch_size": 2, "micro_batch_size": 1})


def test_the_pruned_search_finds_the_exhaustive_best():
    """Skipping the combinations that turn on more switches than one that already fits loses
    nothing: the best of every (layout, memory) combination that fits, sized and timed one by
    one, is the search's best. On the 4-layer slice, 8 H200 with a 70 GB cap (so that some
    combinations do not fit)."""
    run, gpu = _slice_run(), gpu_spec("H200")
    hw = Hardware(gpu_name="H200", gpu_bytes=70e9, gpus=8)
    found = S.search(run, hw, gpu)
    ours = [c for c in found if not c.label]
    assert ours and all(c.fits for c in ours)
    assert [c.tokens_per_s for c in found] == sorted((c.tokens_per_s for c in found), reverse=True)
    best = 0.0
    sized = fitting = 0
    for layout in S.layouts(run, hw):
        for _, changes in S.memory_settings(run):
            candidate = with_changes(run, parallel=layout, memory=changes)
            sized += 1
            if busiest(candidate, hw).fits:
                fitting += 1
                best = max(best, estimate_time(candidate, hw, gpu).tokens_per_s)
    assert ours[0].tokens_per_s == pytest.approx(best)
    assert 0 < fitting < sized  # the cap leaves some out, so the pruning had something to skip
    assert len(ours) < fitting


def test_layouts_split_the_model_and_the_batch():
    run = load_config("glm-5.3-flash-1m-64xb200")
    for layout in S.layouts(run, Hardware(gpus=64)):
        replica = layout["tp"] * layout["cp"] * layout["pp"]
        assert 64 % replica == 0 and 4 % (64 // replica) == 0  # 4 sequences a step over the replicas
        assert layout["tp"] <= 8 and 45 % layout["pp"] == 0 and 256 % layout["ep"] == 0
        assert 64 % (layout["ep"] * layout["etp"] * layout["pp"]) == 0
        assert layout["sequence_parallel"] == (layout["tp"] > 1)


@pytest.mark.parametrize("config,seq_len,published", [
    ("glm-5.3-flash-1m-64xb200-searched", None, 13700),
    ("glm-5.3-flash-256k-64xb200-searched", None, 24900),
])
def test_the_shipped_searched_configs_beat_the_published_run(config, seq_len, published):
    """The configs `plan --search` wrote (and genome-lm ships): at 1M at least 1.5 x the published
    13,700 tokens/s, at 256k above the published 24,900, both fitting 180 GB B200s, with the
    time model that predicts the published setting within its stated error."""
    run = load_config(config)
    hw = Hardware(gpus=64)
    assert busiest(run, hw).fits
    tokens = estimate_time(run, hw).tokens_per_s
    assert tokens >= (1.5 if published == 13700 else 1.0) * published, tokens


def test_the_search_writes_its_best_as_a_config(tmp_path):
    """`plan --search --write`: a config that loads, is the best row's layout and switches, and
    predicts the best row's tokens/s; the published setting is in the table."""
    out = tmp_path / "best.yaml"
    result = CliRunner().invoke(app, ["plan", "--config", "glm-5.3-flash-512k-64xb200", "--seq-len", "256k",
                                      "--gpus", "64", "--search", "--top", "3", "--write", str(out), "--json"])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.output[result.output.index("{"):])
    best = report["candidates"][0]
    assert best["fits"] and best["label"] == ""
    assert any(c["label"] == "published" for c in report["candidates"])
    written = load_config(str(out))
    assert written.data.seq_len == 262144
    assert written.parallel.model_dump() == best["parallel"]
    assert estimate_time(written, Hardware(gpus=64)).tokens_per_s == pytest.approx(best["tokens_per_s"])
    assert out.read_text().startswith("# Written by `genome-lm plan")


@pytest.mark.parametrize("args,message", [
    (["--search", "--set", "parallel.gpus=null"], "--search needs --gpus"),  # nor does the config state them
    (["--write", "x.yaml"], "--write goes with --search"),
    (["--search", "--gpus", "64", "--top", "0"], "--top 0"),
    (["--search", "--gpus", "64", "--device", "cpu"], "time model"),
    (["--search", "--gpus", "64", "--write", "/no/such/dir/x.yaml"], "no folder"),
])
def test_search_refuses_bad_options(args, message):
    result = CliRunner().invoke(app, ["plan", "--config", "glm-5.3-flash-1m-64xb200", *args])
    assert result.exit_code == 1
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_layouts_vary_ep_and_etp_whatever_the_config_says():
    """The config's ep 32 x etp 2 does not split 8 GPUs; the search lays out its own: ep any
    divisor of the 288 experts, etp 1 or 2, ep x etp x pp dividing the GPUs. On a power-of-two
    cluster that is the powers of two it tried before; on 24 GPUs EP 24 (12 experts a rank) too."""
    run = load_config("glm-5.3-flash-512k-64xb200")
    eight = list(S.layouts(run, Hardware(gpus=8)))
    assert {(x["ep"], x["etp"]) for x in eight} == {(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2)}
    before = {(x["tp"], x["cp"], x["pp"], ep, etp) for x in S.layouts(run, Hardware(gpus=64))
              for ep, etp in [(x["ep"], x["etp"])]}
    powers = {(tp, cp, pp, ep, etp) for tp, cp, pp, _, _ in before for ep in S.TWOS for etp in (1, 2)
              if 288 % ep == 0 and 64 % (ep * etp * pp) == 0}
    assert before == powers
    wide = with_changes(run, train={"global_batch_size": 24})
    assert any(x["ep"] == 24 for x in S.layouts(wide, Hardware(gpus=24)))


def test_the_shipped_lora_config_fits_one_node():
    run = load_config("glm-5.3-flash-512k-8xb200-lora")
    assert run.peft.method == "lora" and run.parallel.gpus == 8
    plan = busiest(run, Hardware())
    assert plan.gpus == 8 and plan.fits
    # trained whole, the same layout is far over a B200
    assert not busiest(with_changes(run, peft={"method": "none"}), Hardware()).fits


@pytest.mark.slow
def test_the_8_gpu_lora_search_fits_and_writes_its_peft(tmp_path):
    """`plan --search --gpus 8 --gpu B200 --seq-len 512k --peft lora` on the published 512k config
    (whose EP 32 x ETP 2 does not split 8 GPUs): a layout that fits, the published setting named
    as not splitting them, and --write a config with the peft section that plans the best row;
    the shipped glm-5.3-flash-512k-8xb200-lora is that config."""
    out = tmp_path / "lora.yaml"
    result = CliRunner().invoke(app, ["plan", "--config", "glm-5.3-flash-512k-64xb200", "--seq-len", "512k",
                                      "--gpus", "8", "--gpu", "B200", "--peft", "lora", "--search", "--write",
                                      str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "LoRA rank 8 on a frozen base" in result.output
    assert "its layout (TP 8 x CP 1, EP 32 x ETP 2) does not split 8 GPUs" in result.output
    written, shipped = load_config(str(out)), load_config("glm-5.3-flash-512k-8xb200-lora")
    assert written.peft == shipped.peft and written.peft.method == "lora"
    assert written.parallel == shipped.parallel and written.memory == shipped.memory
    assert busiest(written, Hardware()).fits
    assert f"{estimate_time(written, Hardware()).tokens_per_s:,.0f} tokens/s predicted" in out.read_text()
    assert "--peft lora --search" in out.read_text()
