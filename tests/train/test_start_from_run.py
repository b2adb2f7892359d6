"""A new fine-tune started from an earlier genome-lm run (``model.checkpoint`` = one of its checkpoint
folders, or the run folder for its ``checkpoints/latest``): exactly the saved weights, step 0, a
fresh learning-rate schedule and the new run's own seeding; a different model preset or parallel
layout, or a corrupt checkpoint, is refused with a one-line error naming the folder or file."""

import json
import shutil

import pytest
import torch

from genome_lm.checkpoint import CheckpointCorrupt, build, read_weights, rng_state
from genome_lm.config import load_config
from genome_lm.errors import GenomeLMError
from genome_lm.train.trainer import train

SEQ = 128
WEIGHTS = "model-r00000.safetensors"


def _config(dataset, out, *extra, steps=2):
    return load_config("demo-cpu", [f"data.dataset={dataset}", f"train.out_dir={out}", f"train.steps={steps}",
                                    f"data.seq_len={SEQ}", "train.global_batch_size=2", "train.warmup_steps=1",
                                    "train.indexer_dense_steps=1", "train.save_every=2", "train.lr=1e-2",
                                    "model.kernel_backend=torch", *extra])


@pytest.fixture(scope="module")
def first_run(small_dataset, tmp_path_factory):
    """A finished 2-step run (seed 0) with its checkpoint step-000002 = latest."""
    out = tmp_path_factory.mktemp("first") / "run"
    result = train(_config(small_dataset, out), progress=False)
    assert result.steps_done == 2 and result.checkpoint == out / "checkpoints" / "step-000002"
    return out


def _build(cfg, then=None):
    """``checkpoint.build`` as ``train`` calls it (seeded, inside the run's process groups); returns the
    model's tensors, the random generators' state right after, and ``then(model)``."""
    from genome_lm.engine.parallel import ParallelSizes, parallel_context

    sizes = ParallelSizes()  # the one-process layout of these runs
    with parallel_context(sizes) as pg:
        torch.manual_seed(cfg.train.seed)
        model = build(cfg, pg, sizes)
        rng = rng_state()
        tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
        tensors.update({n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
        extra = then(model) if then is not None else None
    return tensors, rng, extra


def _one_line_error(excinfo, *names):
    text = str(excinfo.value)
    assert "\n" not in text, text
    for name in names:
        assert str(name) in text, text
    return text


@pytest.mark.parametrize("where", ["checkpoint folder", "run folder"])
def test_build_loads_exactly_the_saved_weights_and_keeps_its_own_seeding(first_run, small_dataset, tmp_path, where):
    folder = first_run / "checkpoints" / "step-000002"
    source = folder if where == "checkpoint folder" else first_run
    # seed 1: the checkpoint's saved generators (a seed-0 run's) differ from this run's
    tensors, rng, _ = _build(_config(small_dataset, tmp_path / "new", f"model.checkpoint={source}",
                                     "train.seed=1"))
    saved = read_weights(folder)
    assert tensors.keys() == saved.keys()
    different = [name for name in saved if not torch.equal(tensors[name], saved[name])]
    assert not different, different[:5]
    fresh, fresh_rng, _ = _build(_config(small_dataset, tmp_path / "fresh", "train.seed=1"))
    assert any(not torch.equal(fresh[name], saved[name]) for name in saved)  # the weights came from the checkpoint
    assert rng == fresh_rng  # as a random initialisation leaves them: not the checkpoint's saved states
    saved_rng = json.loads((folder / "state-r00000.json").read_text())["rng"]
    assert saved_rng["torch"] != rng["torch"]


def test_new_run_starts_at_step_0_with_the_saved_weights_loss(first_run, small_dataset, tmp_path):
    from genome_lm.data.loader import TrainLoader
    from genome_lm.train.optim import learning_rate

    out = tmp_path / "finetune"
    cfg = _config(small_dataset, out, f"model.checkpoint={first_run}", steps=1)

    def first_batch_loss(model):
        """The saved weights (copied in from the checkpoint's file) and their weighted cross-entropy on
        the new run's first global batch (two micro-batches of the loader ``train`` makes, dense
        indexer step)."""
        saved = read_weights(first_run / "checkpoints" / "step-000002")
        own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with torch.no_grad():
            for name, value in saved.items():
                own[name].copy_(value)
        loader = TrainLoader(cfg.data.dataset, cfg.data.train_split, seq_len=SEQ, micro_batch_size=1,
                             softmask_weight=cfg.data.softmask_weight, reverse_complement=cfg.data.reverse_complement,
                             max_n_fraction=cfg.data.max_n_fraction, seed=cfg.train.seed)
        total, weight = 0.0, 0.0
        with torch.no_grad():
            for _ in range(2):
                batch = loader.next_batch()
                logits = model(batch.tokens, gather_logits=False, indexer_loss="dense").logits
                ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                       batch.labels.clamp_min(0).flatten(), reduction="none")
                total += float((ce * batch.loss_weight.flatten()).sum())
                weight += float(batch.loss_weight.sum())
        return total / weight

    _, _, expected = _build(_config(small_dataset, out, steps=1), then=first_batch_loss)  # random init + file
    result = train(cfg, progress=False)
    assert result.steps_done == 1 and [m.step for m in result.history] == [1]
    assert result.history[0].lm_loss == pytest.approx(expected, rel=1e-5)
    assert result.history[0].lr == learning_rate(0, cfg.train)  # a fresh schedule (warm-up from step 0)
    assert result.checkpoint == out / "checkpoints" / "step-000001"
    assert json.loads((result.checkpoint / "meta.json").read_text())["step"] == 1


def test_a_different_model_preset_is_refused(first_run, small_dataset, tmp_path):
    folder = first_run / "checkpoints" / "step-000002"
    cfg = _config(small_dataset, tmp_path / "new", f"model.checkpoint={first_run}", "model.preset=glm-5.3-flash-4layer")
    with pytest.raises(GenomeLMError) as excinfo:
        _build(cfg)
    assert "preset" in _one_line_error(excinfo, folder, "tiny", "glm-5.3-flash-4layer")


@pytest.mark.parametrize("change", ["tp", "world_size"])
def test_an_earlier_format_checkpoint_of_another_layout_is_refused(first_run, small_dataset, tmp_path, change):
    """Format 1 (each rank's own tensors) written by two ranks: only its own layout can read it."""
    folder = tmp_path / "run" / "checkpoints" / "step-000002"
    shutil.copytree(first_run / "checkpoints" / "step-000002", folder)
    meta = json.loads((folder / "meta.json").read_text())
    del meta["format"], meta["tensors"]
    meta["world_size"] = 2
    if change == "tp":
        meta["layout"]["tp"] = 2
    (folder / "meta.json").write_text(json.dumps(meta))  # meta.json itself carries no checksum
    with pytest.raises(GenomeLMError) as excinfo:
        _build(_config(small_dataset, tmp_path / "new", f"model.checkpoint={folder}"))
    _one_line_error(excinfo, folder, "genome-lm export", f"{change}=2" if change == "tp" else "on 2 rank(s)")


def test_a_corrupt_checkpoint_is_refused_naming_the_file(first_run, small_dataset, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(first_run / "checkpoints", run / "checkpoints")
    bad = run / "checkpoints" / "step-000002" / WEIGHTS
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01  # one byte of tensor data, the size unchanged
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt) as excinfo:
        _build(_config(small_dataset, tmp_path / "new", f"model.checkpoint={run}"))
    assert "checksum" in _one_line_error(excinfo, bad)
