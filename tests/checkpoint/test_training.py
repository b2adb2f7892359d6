import json

import pytest
import torch

from genome_lm.checkpoint import CheckpointCorrupt, latest_checkpoint, load_checkpoint, save_checkpoint, verify
from genome_lm.errors import GenomeLMError


def _model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_restores_model_optimizer_rng_and_state(tmp_path):
    model, opt = _model_and_opt(0)
    folder = save_checkpoint(tmp_path, 7, model, opt, {"data": {"epoch": 1, "position": 5}})
    expected_next = torch.rand(4)
    assert latest_checkpoint(tmp_path) == folder and folder.name == "step-000007"
    other, other_opt = _model_and_opt(1)
    state = load_checkpoint(folder, other, other_opt)
    assert state == {"data": {"epoch": 1, "position": 5}}
    assert torch.equal(torch.rand(4), expected_next)  # RNG continues where the saved run was
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict(), other_opt.state_dict()
    for key in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa["state"][key][name]), torch.as_tensor(sb["state"][key][name]))


def test_truncated_or_altered_files_are_named_and_the_previous_checkpoint_stays(tmp_path):
    model, opt = _model_and_opt(0)
    first = save_checkpoint(tmp_path, 1, model, opt, {})
    second = save_checkpoint(tmp_path, 2, model, opt, {})
    weights = second / "model-r00000.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-10])
    with pytest.raises(CheckpointCorrupt, match="model-r00000.safetensors: .* bytes, expected"):
        load_checkpoint(second, model, opt)
    third = save_checkpoint(tmp_path, 3, model, opt, {})
    optim = third / "optim-r00000.safetensors"
    data = bytearray(optim.read_bytes())
    data[-20] ^= 0xFF
    optim.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="optim-r00000.safetensors: checksum mismatch"):
        load_checkpoint(third, model, opt)
    weights.write_bytes(original)
    (second / "state-r00000.json").unlink()
    with pytest.raises(CheckpointCorrupt, match="state-r00000.json: missing"):
        verify(second)
    assert verify(first)["step"] == 1  # the earlier checkpoint is untouched


def test_interrupted_save_leaves_latest_alone(tmp_path, monkeypatch):
    model, opt = _model_and_opt(0)
    save_checkpoint(tmp_path, 1, model, opt, {})
    import genome_lm.checkpoint.training as ckpt

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "write_pieces", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt, {})
    assert latest_checkpoint(tmp_path).name == "step-000001"
    assert not (tmp_path / "checkpoints" / "step-000002").exists()


def _legacy_checkpoint(folder, model, opt, world: int, layout: dict | None = None):
    """A checkpoint as genome-lm wrote them before format 2: the rank's own tensors under its own
    names, the optimizer's torch state dict, no piece index."""
    import hashlib

    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(weights, str(folder / "model-r00000.safetensors"))
    torch.save(opt.state_dict(), folder / "optim-r00000.pt")
    from genome_lm.checkpoint import rng_state

    (folder / "state-r00000.json").write_text(json.dumps({"step": 4, "rng": rng_state()}))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(folder.iterdir())}
    meta = {"step": 4, "world_size": world, "files": files, **({"layout": layout} if layout else {})}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_optimizer_state_is_loaded_without_unpickling_objects(tmp_path):
    """A .pt file (the per-rank optimizer state of megatron-core's distributed optimizer, or of an
    earlier checkpoint) carrying an arbitrary object is refused (weights_only=True)."""
    model, opt = _model_and_opt(0)
    folder = _legacy_checkpoint(tmp_path / "legacy", model, opt, 1)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"state": Evil()}, folder / "optim-r00000.pt")
    meta = json.loads((folder / "meta.json").read_text())
    import hashlib

    blob = (folder / "optim-r00000.pt").read_bytes()
    meta["files"]["optim-r00000.pt"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        load_checkpoint(folder, model, opt)


def test_the_new_format_unpickles_nothing(tmp_path):
    """Weights and AdamW's state are safetensors pieces, the rest JSON: no .pt file at all."""
    model, opt = _model_and_opt(0)
    folder = save_checkpoint(tmp_path, 3, model, opt, {})
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "model-r00000.safetensors",
                                                        "optim-r00000.safetensors", "state-r00000.json"]
    assert json.loads((folder / "meta.json").read_text())["optimizer"] == "pieces"


def test_earlier_format_one_rank_still_loads(tmp_path):
    """A format-1 checkpoint written by one process: weights and optimizer state load as before."""
    model, opt = _model_and_opt(0)
    folder = _legacy_checkpoint(tmp_path / "legacy", model, opt, 1)
    other, other_opt = _model_and_opt(1)
    assert load_checkpoint(folder, other, other_opt) == {"step": 4}
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    for key, value in opt.state_dict()["state"].items():
        assert torch.equal(value["exp_avg"], other_opt.state_dict()["state"][key]["exp_avg"])


def test_earlier_format_from_several_ranks_needs_its_layout(tmp_path):
    model, opt = _model_and_opt(0)
    folder = _legacy_checkpoint(tmp_path / "legacy", model, opt, 8)
    with pytest.raises(GenomeLMError, match="written by 8 ranks, this run has 1 .*earlier per-rank format"):
        load_checkpoint(folder, model, opt)
    saved = {"tp": 2, "cp": 1, "ep": 1, "etp": 1, "pp": 1, "sequence_parallel": False}
    folder = _legacy_checkpoint(tmp_path / "legacy2", model, opt, 1, saved)
    with pytest.raises(GenomeLMError, match="optimizer state .* resumes only under the layout that wrote it .*'tp': 2"):
        load_checkpoint(folder, model, opt, layout={**saved, "tp": 1, "pp": 2})
    assert load_checkpoint(folder, model, opt, layout=dict(saved)) == {"step": 4}
    assert load_checkpoint(folder, model, None, layout={**saved, "tp": 1, "pp": 2}) == {"step": 4}  # weights only


def test_per_rank_optimizer_state_needs_its_layout_and_weights_do_not(tmp_path):
    """megatron-core's distributed optimizer keeps its state per rank: another layout is refused
    with what to do instead, and the weights of the same checkpoint load alone."""
    from genome_lm.train.optim import MegatronOptimizer

    model, _ = _model_and_opt(0)
    saved = {"tp": 2, "cp": 1, "ep": 1, "etp": 1, "pp": 1, "sequence_parallel": False}
    optim = MegatronOptimizer(_Chained([_ShardedAdam(list(model.parameters()), 1)]))
    folder = save_checkpoint(tmp_path, 4, model, optim, {}, {"layout": saved})
    assert json.loads((folder / "meta.json").read_text())["optimizer"] == "per-rank"
    with pytest.raises(GenomeLMError, match="optimizer state .* resumes only under the layout that wrote it"):
        load_checkpoint(folder, model, optim, layout={**saved, "tp": 1, "pp": 2})
    other, _ = _model_and_opt(1)
    assert load_checkpoint(folder, other, None, layout={**saved, "tp": 1, "pp": 2}) == {}
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


class _ShardedAdam:
    """Stands in for megatron-core's ``DistributedOptimizer`` (which needs a GPU to build): its
    own packing and unpacking of the parameter-state shard run unchanged on fake buckets, and
    ``state_dict()`` leaves the Adam moments out, as the real one does."""

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as _D

    get_parameter_state_dp_reshardable = _D.get_parameter_state_dp_reshardable
    load_parameter_state_from_dp_reshardable = _D.load_parameter_state_from_dp_reshardable

    def __init__(self, params, seed):
        from megatron.core.optimizer.distrib_optimizer import Range

        g = torch.Generator().manual_seed(seed)
        self.states = {p: {"param": torch.randn(p.numel(), generator=g), "exp_avg": torch.randn(p.numel(), generator=g),
                           "exp_avg_sq": torch.rand(p.numel(), generator=g)} for p in params}
        sizes = [p.numel() for p in params]
        self.per_bucket_numel = {(0, torch.float32): [sum(sizes)]}
        self.per_bucket_numel_unpadded = {(0, torch.float32): [sum(sizes)]}
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.gbuf_ranges = [{torch.float32: [{"param_map": {
            p: {"gbuf_local": Range(a, a + n)} for p, a, n in zip(params, starts, sizes)}}]}]
        self.step_count = seed

    @property
    def state(self):  # megatron-core's optimizers promote their torch optimizer's state
        return self.states

    def _get_main_param_and_optimizer_states(self, param):
        return dict(self.states[param])

    def _set_main_param_and_optimizer_states(self, param, tensors):
        for key, value in self.states[param].items():
            value.copy_(tensors[key])

    def state_dict(self):  # like megatron-core's: no moments, no main parameters
        return {"step": self.step_count}

    def load_state_dict(self, state):
        self.step_count = state["step"]


class _Chained:
    def __init__(self, parts):
        self.chained_optimizers = parts

    def state_dict(self):
        return [p.state_dict() for p in self.chained_optimizers]

    def load_state_dict(self, state):
        for part, s in zip(self.chained_optimizers, state):
            part.load_state_dict(s)


def test_distributed_optimizer_shards_survive_a_checkpoint(tmp_path):
    """The GPU path's optimizer wrapper saves each distributed optimizer's shard of main
    parameters and Adam moments (megatron-core's state_dict() alone would restart Adam) and
    loads it back through megatron-core's own loader, with weights_only=True."""
    from genome_lm.train.optim import MegatronOptimizer

    model, _ = _model_and_opt(0)
    dense, expert = list(model[0].parameters()), list(model[1].parameters())
    saved = MegatronOptimizer(_Chained([_ShardedAdam(dense, 1), _ShardedAdam(expert, 2)]))
    folder = save_checkpoint(tmp_path, 3, model, saved, {})
    fresh = MegatronOptimizer(_Chained([_ShardedAdam(dense, 7), _ShardedAdam(expert, 8)]))
    load_checkpoint(folder, model, fresh)
    for a, b in zip(saved.optimizer.chained_optimizers, fresh.optimizer.chained_optimizers):
        assert a.step_count == b.step_count
        for p in a.states:
            for key in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a.states[p][key], b.states[p][key]), key
    other_layout = MegatronOptimizer(_Chained([_ShardedAdam(dense + expert, 9)]))
    with pytest.raises(GenomeLMError, match="optimizer has 2 parts, this run's 1"):
        load_checkpoint(folder, model, other_layout)


def test_a_resave_of_the_same_step_stopped_between_renames_keeps_the_old_copy(tmp_path, monkeypatch):
    """Re-saving an existing step (issue 54, defect 6): the old copy was removed before the new
    one was renamed in, so a crash between the two left ``latest`` pointing at nothing. Now the
    old copy is moved aside and comes back when ``latest`` is read; a finished re-save replaces it,
    and every file and folder is flushed (fsync) before its rename."""
    import genome_lm.checkpoint.training as ckpt

    model, opt = _model_and_opt(0)
    save_checkpoint(tmp_path, 5, model, opt, {"n": 1})
    real_replace, synced = ckpt.os.replace, []

    def crash_on_the_second_rename(src, dst):
        if str(src).endswith(".partial"):
            raise KeyboardInterrupt  # the machine stops: the old copy is aside, the new one not in place
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 5, model, opt, {"n": 2})
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    folder = latest_checkpoint(tmp_path)
    assert folder.name == "step-000005" and json.loads((folder / "state-r00000.json").read_text())["n"] == 1
    assert verify(folder)["step"] == 5

    real_fsync = ckpt.fsync_path
    monkeypatch.setattr(ckpt, "fsync_path", lambda p: synced.append(p.name) or real_fsync(p))
    save_checkpoint(tmp_path, 5, model, opt, {"n": 3})
    folder = latest_checkpoint(tmp_path)
    assert json.loads((folder / "state-r00000.json").read_text())["n"] == 3
    assert not (tmp_path / "checkpoints" / "step-000005.old").exists()
    assert {"meta.json", "model-r00000.safetensors", "state-r00000.json", "step-000005.partial",
            "checkpoints", f".{ckpt.LATEST}.tmp"} <= set(synced)


def test_verify_reads_each_file_once_until_it_changes(tmp_path, monkeypatch):
    """Resume verified a checkpoint and then verified it again at load, reading every file twice
    (issue 54, defect 5, in part): a file is hashed once per process while its size, time and
    inode stay; one changed after that is read again and caught."""
    import genome_lm.checkpoint.training as ckpt

    model, opt = _model_and_opt(0)
    folder = save_checkpoint(tmp_path, 1, model, opt, {})
    read = []
    real = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda p: read.append(p.name) or real(p))
    verify(folder)
    first = sorted(read)
    verify(folder)
    assert sorted(read) == first and len(first) == len(json.loads((folder / "meta.json").read_text())["files"])
    weights = folder / "model-r00000.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        verify(folder)
