"""Tensor, expert and context parallel over two gloo processes give the single-process loss and
gradients, and a checkpoint loaded into a split model exports back bit for bit."""

from pathlib import Path

import pytest
import torch

from genome_lm.checkpoint.huggingface import HFCheckpoint
from genome_lm.engine.context_parallel import heads_per_rank, zigzag_merge, zigzag_split
from tests.workers import run_workers

from .hf_oracle import SPLIT_TEXT, make_checkpoint

pytestmark = pytest.mark.slow  # two gloo processes per test, 4-14 s each

WORKER = Path(__file__).with_name("dist_worker.py")
TEXT = SPLIT_TEXT


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    ckpt = make_checkpoint(root / "hf", text=TEXT, seed=9)
    ids = torch.randint(4, 9, (2, 150), generator=torch.Generator().manual_seed(3))
    torch.save(ids, root / "ids.pt")
    # context parallel needs T divisible by 2 * cp: 201 ids -> 200 inputs (not a multiple of 64)
    torch.save(torch.randint(4, 9, (2, 201), generator=torch.Generator().manual_seed(4)), root / "ids-cp.pt")
    return root, ckpt


def _run(root, ckpt, world, sizes, name, indexer_loss="off", export=None, ids="ids", absorbed=False,
         query_chunk=None, lora=None):
    spec = {"hf": str(ckpt), "sizes": sizes, "ids": str(root / f"{ids}.pt"), "out": str(root / f"{name}.pt"),
            "indexer_loss": indexer_loss, "export": str(export) if export else None, "absorbed": absorbed,
            "query_chunk": query_chunk, "lora": lora}
    run_workers(WORKER, world, spec)
    return _merge_stages(root / f"{name}.pt", sizes.get("pp", 1))


def _merge_stages(out, stages):
    """The stages' results (``OUT.stage<s>``, see dist_worker.py) as one: the gradients together,
    the loss parts (LM and each stage's indexer losses) summed, the last stage's logits."""
    parts = [torch.load(f"{out}.stage{s}") for s in range(stages)]
    grads = {k: v for part in parts for k, v in part["grads"].items()}
    return {"loss": sum(part["loss"] for part in parts), "logits": parts[-1]["logits"], "grads": grads,
            "selections": [idx for part in parts for idx in part["selections"]]}


def _one_process(root, ckpt, indexer_loss, ids="ids", query_chunk=None, lora=None):
    """The single-process reference, computed once per (ids, indexer loss, query chunk, LoRA) in this module."""
    name = f"one-{ids}-{indexer_loss}" + (f"-chunk{query_chunk}" if query_chunk else "") + ("-lora" if lora else "")
    if (root / f"{name}.pt.stage0").exists():
        return _merge_stages(root / f"{name}.pt", 1)
    return _run(root, ckpt, 1, {}, name, indexer_loss, ids=ids, query_chunk=query_chunk, lora=lora)


def _assert_same(one, two):
    """Equal loss and DSA selections; every gradient equal relative to its largest entry;
    returns the errors."""
    assert len(one["selections"]) == len(two["selections"]) > 0
    for a, b in zip(one["selections"], two["selections"]):
        dp = a.shape[0] // b.shape[0]  # rank 0's data-parallel replica holds rows 0, dp, ...
        assert torch.equal(a[::dp], b)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert one["grads"].keys() == two["grads"].keys()
    errs = {}
    for key, g in one["grads"].items():
        errs[key] = float((g - two["grads"][key]).abs().max() / g.abs().max().clamp_min(1e-8))
        assert errs[key] < 1e-4, (key, errs[key])
    return errs


@pytest.mark.parametrize("sizes,indexer_loss", [
    pytest.param({"tp": 2}, "sparse", id="tp2-sparse-indexer-loss"),
    pytest.param({"ep": 2}, "off", id="ep2"),
    pytest.param({"tp": 2, "etp": 2}, "dense", id="tp2-etp2-dense-indexer-loss"),
])
def test_split_model_matches_one_process(setup, sizes, indexer_loss):
    root, ckpt = setup
    name = "-".join(f"{k}{v}" for k, v in sizes.items())
    one = _one_process(root, ckpt, indexer_loss)
    two = _run(root, ckpt, 2, sizes, name, indexer_loss)
    _assert_same(one, two)


@pytest.mark.parametrize("sizes,indexer_loss", [
    pytest.param({"cp": 2}, "sparse", id="cp2-sparse-indexer-loss"),
    pytest.param({"cp": 2}, "dense", id="cp2-dense-indexer-loss"),
    pytest.param({"cp": 2, "ep": 2}, "off", id="cp2-ep2"),
    pytest.param({"tp": 2, "cp": 2}, "sparse", id="tp2-cp2-sparse-indexer-loss"),  # 4 processes
])
def test_context_parallel_matches_one_process(setup, sizes, indexer_loss):
    """Zigzag-split tokens in, zigzag-merged logits out: loss, logits, the DSA selections and
    every gradient (after the data+context parallel sum) equal one process's."""
    root, ckpt = setup
    name = "-".join(f"{k}{v}" for k, v in sizes.items()) + f"-{indexer_loss}"
    one = _one_process(root, ckpt, indexer_loss, ids="ids-cp")
    world = sizes.get("tp", 1) * sizes["cp"]
    two = _run(root, ckpt, world, sizes, name, indexer_loss, ids="ids-cp")
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)
    _assert_same(one, two)


@pytest.mark.parametrize("sizes,indexer_loss,chunk", [
    # 200 queries in blocks of 24: 9 blocks over 4 ranks (runs of 1 or 2 blocks, the last short)
    pytest.param({"tp": 2, "cp": 2}, "sparse", 24, id="tp2-cp2-sparse-chunk24"),
    pytest.param({"tp": 2, "cp": 2}, "dense", 24, id="tp2-cp2-dense-chunk24"),
    # 200 queries in blocks of 64: 4 blocks over 4 ranks, one each
    pytest.param({"tp": 2, "cp": 2, "split_dsa_selection": False}, "sparse", None, id="tp2-cp2-replicated"),
    # 149 queries in blocks of 128: 2 blocks, rank 1 of 2 takes the second (short) one
    pytest.param({"tp": 2}, "dense", 128, id="tp2-dense-chunk128"),
])
def test_dsa_selection_shared_over_tp_cp(setup, sizes, indexer_loss, chunk):
    """The DSA selection and the indexer loss shared out over the TP x CP ranks by query blocks
    (uneven shares), and the published layout's (every rank the whole sequence): the
    one-process selections bit for bit, loss, logits and gradients."""
    root, ckpt = setup
    ids = "ids-cp" if sizes.get("cp", 1) > 1 else "ids"
    name = "-".join(f"{k}{v}" for k, v in sizes.items()) + f"-{indexer_loss}-chunk{chunk}"
    one = _one_process(root, ckpt, indexer_loss, ids=ids, query_chunk=chunk)
    world = sizes.get("tp", 1) * sizes.get("cp", 1)
    two = _run(root, ckpt, world, sizes, name, indexer_loss, ids=ids, query_chunk=chunk)
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)
    _assert_same(one, two)


@pytest.mark.parametrize("sizes,indexer_loss,ids", [
    # 149 positions: padded by one row to two slices of 75
    pytest.param({"tp": 2, "sequence_parallel": True}, "sparse", "ids", id="tp2-sp-sparse-indexer-loss"),
    pytest.param({"tp": 2, "sequence_parallel": True}, "dense", "ids-even", id="tp2-sp-even-length"),
    pytest.param({"tp": 2, "etp": 2, "sequence_parallel": True}, "off", "ids", id="tp2-etp2-sp"),
    # 4 processes; 100 local positions per CP rank
    pytest.param({"tp": 2, "cp": 2, "sequence_parallel": True}, "sparse", "ids-cp", id="tp2-cp2-sp"),
])
def test_sequence_parallel_matches_one_process(setup, sizes, indexer_loss, ids):
    """The residual streams split over the TP ranks: loss, logits and every gradient (the mHC and
    norm gradients summed over the slices) equal one process's."""
    root, ckpt = setup
    if not (root / "ids-even.pt").exists():
        torch.save(torch.load(root / "ids.pt")[:, :149], root / "ids-even.pt")  # 148 inputs
    name = "-".join(f"{k}{v}" for k, v in sizes.items()) + f"-{indexer_loss}-{ids}"
    one = _one_process(root, ckpt, indexer_loss, ids=ids)
    world = sizes["tp"] * sizes.get("cp", 1)
    two = _run(root, ckpt, world, sizes, name, indexer_loss, ids=ids)
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)
    _assert_same(one, two)


@pytest.mark.parametrize("sizes,ids", [
    pytest.param({}, "ids", id="one-process"),
    pytest.param({"tp": 2}, "ids", id="tp2"),
    pytest.param({"cp": 2}, "ids-cp", id="cp2"),
    pytest.param({"tp": 2, "cp": 2, "sequence_parallel": True}, "ids-cp", id="tp2-cp2-sp"),  # 4 processes
])
def test_absorbed_mla_matches_per_head_attention(setup, sizes, ids):
    """The DSA layers attending over the shared latent with absorbed queries (the GPU backends'
    layout): the per-head single-process loss (LM + sparse indexer loss), logits and gradients,
    also with the latent replicated over tensor parallel and gathered over context parallel."""
    root, ckpt = setup
    name = "absorbed-" + ("-".join(f"{k}{v}" for k, v in sizes.items()) or "one")
    one = _one_process(root, ckpt, "sparse", ids=ids)
    world = sizes.get("tp", 1) * sizes.get("cp", 1)
    two = _run(root, ckpt, world, sizes, name, "sparse", ids=ids, absorbed=True)
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)
    _assert_same(one, two)


def test_context_parallel_shared_indexer_softplus_gate(setup, tmp_path):
    """A DSA layer that reuses the previous layer's whole-sequence selection, the softplus decay
    and a short convolution of 3, under CP 2."""
    root, _ = setup
    layers = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
    text = {**TEXT, "layer_types": layers, "indexer_types": ["full", "full", "shared", "full"],
            "linear_lower_bound": None, "linear_conv_kernel_dim": 3}
    ckpt = make_checkpoint(tmp_path / "hf", text=text, seed=11)
    (tmp_path / "ids-cp.pt").write_bytes((root / "ids-cp.pt").read_bytes())
    one = _one_process(tmp_path, ckpt, "sparse", ids="ids-cp")
    two = _run(tmp_path, ckpt, 2, {"cp": 2}, "cp2", "sparse", ids="ids-cp")
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)
    _assert_same(one, two)


def test_zigzag_split_and_merge():
    x = torch.arange(2 * 16).view(2, 16)
    parts = [zigzag_split(x, 2, r) for r in range(2)]
    assert parts[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # chunks 0 and 3 of 4
    assert parts[1][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2
    assert torch.equal(zigzag_merge(parts), x)
    with pytest.raises(ValueError, match="divisible by 2 \\* context parallel = 4"):
        zigzag_split(torch.zeros(1, 150), 2, 0)
    with pytest.raises(ValueError, match="tensor parallel x context parallel"):
        heads_per_rank(6, 2, 2, "linear_num_heads")


@pytest.mark.parametrize("sizes", [{"tp": 2}, {"ep": 2}, {"tp": 2, "etp": 2}], ids=["tp2", "ep2", "tp2-etp2"])
def test_checkpoint_round_trip_through_a_split_model(setup, sizes):
    root, ckpt = setup
    out = root / ("export-" + "-".join(sizes))
    _run(root, ckpt, 2, sizes, "export", export=out)
    _assert_same_text_weights(ckpt, out)


def _assert_same_text_weights(ckpt, out):
    """``out`` holds exactly the checkpoint's text tensors, bit for bit."""
    src, dst = HFCheckpoint(ckpt), HFCheckpoint(out)
    keys = [k for k in src.weight_map if "visual" not in k]
    assert sorted(keys) == sorted(dst.weight_map)
    for key in keys:
        assert torch.equal(src.get(key), dst.get(key)), key


# DSA layers (with their indexer losses) and MoE layers on both stages of a 2-stage split
PIPELINE_TEXT = {**TEXT, "layer_types": ["linear_attention", "indexed_attention", "linear_attention",
                                         "indexed_attention"]}


@pytest.fixture(scope="module")
def pipeline_setup(setup):
    """Its own folder (the one-process results are cached by file name) with the same ids."""
    root = setup[0] / "pipeline"
    root.mkdir(exist_ok=True)
    for ids in ("ids", "ids-cp"):
        (root / f"{ids}.pt").write_bytes((setup[0] / f"{ids}.pt").read_bytes())
    return root, make_checkpoint(root / "hf", text=PIPELINE_TEXT, seed=12)


@pytest.mark.parametrize("sizes,indexer_loss", [
    pytest.param({"pp": 2}, "sparse", id="pp2-sparse-indexer-loss"),
    pytest.param({"pp": 2, "tp": 2, "sequence_parallel": True}, "sparse", id="pp2-tp2-sp"),  # 4 processes
    pytest.param({"pp": 2, "ep": 2}, "off", id="pp2-ep2"),  # 4 processes, 2 data-parallel replicas
    pytest.param({"pp": 2, "cp": 2}, "sparse", id="pp2-cp2"),  # 4 processes, 100 positions per CP rank
])
def test_pipeline_parallel_matches_one_process(pipeline_setup, sizes, indexer_loss):
    """Two stages, each sequence of the batch one micro-batch through genome-lm's 1F1B schedule
    (warm-up, steady and cool-down phases on the first stage): the loss (LM and both stages'
    indexer losses), the logits and every gradient equal one process's."""
    root, ckpt = pipeline_setup
    name = "-".join(f"{k}{v}" for k, v in sizes.items()) + f"-{indexer_loss}"
    ids = "ids-cp" if "cp" in sizes else "ids"  # 200 inputs: divisible by 2 * cp
    one = _one_process(root, ckpt, indexer_loss, ids=ids)
    world = sizes["pp"] * sizes.get("tp", 1) * sizes.get("ep", 1) * sizes.get("cp", 1)
    two = _run(root, ckpt, world, sizes, name, indexer_loss, ids=ids)
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)
    # each stage's selections come one micro-batch (one sequence of the replica's batch) at a time
    sel = two["selections"]
    per = len(sel) // len(one["selections"])
    two["selections"] = [torch.cat(sel[i : i + per]) for i in range(0, len(sel), per)]
    _assert_same(one, two)


def test_checkpoint_round_trip_through_pipeline_stages(pipeline_setup):
    """A checkpoint loaded into a PP 2 x TP 2 model (each stage gathers its tensors over TP and
    sends them to rank 0) exports back bit for bit."""
    root, ckpt = pipeline_setup
    out = root / "export-pp2-tp2"
    _run(root, ckpt, 4, {"pp": 2, "tp": 2}, "export", export=out)
    _assert_same_text_weights(ckpt, out)


# the default targets, the DSA indexer's query projection, and trained whole the routers and one
# routed expert's fc2, named by its index in the whole model (under EP 2 another rank's local 1)
LORA = {"targets": ["*.self_attention.[qkvo]_proj", "*.self_attention.q_b_proj", "*.linear_fc1", "*.linear_fc2",
                    "*.indexer.wq_b"],
        "train": ["*.router.weight", "layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]}


@pytest.mark.parametrize("sizes,ids", [
    # under TP the attention and dense layers' adapters enter / leave the tensor-parallel region
    # and the MoE layer's shared expert (the one sequence-parallel layer) gathers / scatters
    pytest.param({"tp": 2, "sequence_parallel": True}, "ids", id="tp2-sp"),
    pytest.param({"ep": 2}, "ids", id="ep2"),
    pytest.param({"tp": 2, "etp": 2}, "ids", id="tp2-etp2"),
    pytest.param({"cp": 2}, "ids-cp", id="cp2"),
    pytest.param({"pp": 2}, "ids", id="pp2"),
])
def test_lora_matches_one_process(setup, pipeline_setup, sizes, ids):
    """Non-zero adapters on every targeted projection (KDA, MLA, the indexer, dense, shared and
    routed experts) and the routers trained whole: the loss (LM + sparse indexer loss), logits and
    every gradient (adapters, routers; zero for the frozen base) equal one process's."""
    root, ckpt = pipeline_setup if "pp" in sizes else setup
    name = "lora-" + "-".join(f"{k}{v}" for k, v in sizes.items())
    one = _one_process(root, ckpt, "sparse", ids=ids, lora=LORA)
    world = sizes.get("pp", 1) * sizes.get("tp", 1) * sizes.get("ep", 1) * sizes.get("cp", 1)
    two = _run(root, ckpt, world, sizes, name, "sparse", ids=ids, lora=LORA)
    torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-5, atol=1e-6)
    sel = two["selections"]
    per = len(sel) // len(one["selections"])
    two["selections"] = [torch.cat(sel[i : i + per]) for i in range(0, len(sel), per)]
    errs = _assert_same(one, two)
    trained = [k for k in one["grads"] if ".lora_" in k or k.endswith("router.weight")
               or k == "layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]
    assert any(".local_experts." in k for k in trained) and any("indexer.wq_b" in k for k in trained)
    moved = {k for k in trained if one["grads"][k].abs().max() > 0}
    # every adapter but those of routed experts no token chose (the random router picks few here)
    assert {k for k in trained if ".local_experts." not in k} <= moved
    assert any(".local_experts." in k for k in moved)
    assert all(one["grads"][k].abs().max() == 0 for k in one["grads"] if k not in trained)
    assert max(errs.values()) < 1e-4
