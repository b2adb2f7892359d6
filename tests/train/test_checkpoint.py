import json

import pytest
import torch

from genome_lm.errors import GenomeLMError
from genome_lm.checkpoint import (CheckpointCorrupt, latest_checkpoint, load_checkpoint, save_checkpoint,
                                        verify)


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
    optim = third / "optim-r00000.pt"
    data = bytearray(optim.read_bytes())
    data[-20] ^= 0xFF
    optim.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="optim-r00000.pt: checksum mismatch"):
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

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt, {})
    assert latest_checkpoint(tmp_path).name == "step-000001"
    assert not (tmp_path / "checkpoints" / "step-000002").exists()


def test_optimizer_state_is_loaded_without_unpickling_objects(tmp_path):
    """A .pt file carrying an arbitrary object is refused (weights_only=True)."""
    model, opt = _model_and_opt(0)
    folder = save_checkpoint(tmp_path, 3, model, opt, {})

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


def test_layout_mismatch_is_explained(tmp_path):
    model, opt = _model_and_opt(0)
    folder = save_checkpoint(tmp_path, 4, model, opt, {})
    meta = json.loads((folder / "meta.json").read_text())
    meta["world_size"] = 8
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(GenomeLMError, match="written by 8 ranks"):
        load_checkpoint(folder, model, opt)


def test_same_world_other_layout_is_explained(tmp_path):
    """Two ranks as TP 2 or as two pipeline stages: same world size, other shards in each file."""
    model, opt = _model_and_opt(0)
    saved = {"tp": 2, "cp": 1, "ep": 1, "etp": 1, "pp": 1, "sequence_parallel": False}
    folder = save_checkpoint(tmp_path, 4, model, opt, {}, {"layout": saved})
    with pytest.raises(GenomeLMError, match="written with parallel layout .*'tp': 2.* this run has .*'pp': 2"):
        load_checkpoint(folder, model, opt, layout={**saved, "tp": 1, "pp": 2})
    assert load_checkpoint(folder, model, opt, layout=dict(saved)) == {}


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
