"""`memory.offload_activations = true` really engages in a training step: torch's save_on_cpu
saved-tensor hooks (genome_lm.train.memory.offload_saved_tensors) are entered for every
micro-batch, their pack hook runs in forward and their unpack hook in backward, and the host cache
is released once per step, after the step's micro-batches. Without the switch the hooks are never
entered, and the losses are the same either way."""

import pytest
import torch

import genome_lm.model.recompute_memo as recompute_memo
import genome_lm.train.memory as memory
from genome_lm.config import load_config
from genome_lm.train.trainer import train

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")

STEPS = 2
MICRO = 2  # global batch 2, micro-batch 1, one data-parallel rank


def _config(dataset, out, offload):
    return load_config("demo-cpu", [f"data.dataset={dataset}", f"train.out_dir={out}", f"train.steps={STEPS}",
                                    "data.seq_len=128", "train.global_batch_size=2", "train.micro_batch_size=1",
                                    "train.warmup_steps=1", "train.indexer_dense_steps=1", "train.save_every=0",
                                    "model.kernel_backend=torch", f"memory.offload_activations={offload}"])


@pytest.fixture
def spies(monkeypatch):
    calls = {"enter": 0, "exit": 0, "pack": 0, "unpack": 0, "pin": [], "on_host": 0, "release": [],
             "pack_per_enter": []}
    real = torch.autograd.graph.save_on_cpu

    class SpySaveOnCpu(real):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            calls["pin"].append(pin_memory)
            pack, unpack = self.pack_hook, self.unpack_hook

            def counting_pack(tensor):
                calls["pack"] += 1
                calls["pack_per_enter"][-1] += 1
                return pack(tensor)

            def counting_unpack(packed):
                calls["unpack"] += 1
                return unpack(packed)

            self.pack_hook, self.unpack_hook = counting_pack, counting_unpack

        def __enter__(self):
            calls["enter"] += 1
            calls["pack_per_enter"].append(0)
            return super().__enter__()

        def __exit__(self, *exc):
            calls["exit"] += 1
            return super().__exit__(*exc)

    real_on_host = recompute_memo.on_host

    def spy_on_host(*args, **kwargs):
        calls["on_host"] += 1
        return real_on_host(*args, **kwargs)

    real_release = memory.release_host_cache

    def spy_release():
        calls["release"].append(calls["enter"])  # how many offload contexts had been entered by then
        return real_release()

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", SpySaveOnCpu)
    monkeypatch.setattr(recompute_memo, "on_host", spy_on_host)
    monkeypatch.setattr(memory, "release_host_cache", spy_release)
    return calls


def test_offload_hooks_run_in_every_training_step(small_dataset, tmp_path, spies):
    result = train(_config(small_dataset, tmp_path / "run", "true"), progress=False)
    assert result.steps_done == STEPS
    # one save_on_cpu context per micro-batch, around its forward and backward
    assert spies["enter"] == spies["exit"] == STEPS * MICRO
    assert spies["pin"] == [torch.cuda.is_available()] * (STEPS * MICRO)  # offload_pinned defaults to true
    assert spies["on_host"] == STEPS * MICRO
    # saved activations went through the pack hook in each micro-batch's forward, and came back in backward
    assert all(n > 0 for n in spies["pack_per_enter"]), spies["pack_per_enter"]
    assert spies["pack"] > 0 and spies["unpack"] > 0
    # the host cache is released once per step, after that step's micro-batches
    assert spies["release"] == [MICRO * (s + 1) for s in range(STEPS)]


def test_without_the_switch_no_hooks_and_the_same_losses(small_dataset, tmp_path, spies):
    plain = train(_config(small_dataset, tmp_path / "plain", "false"), progress=False)
    assert spies["enter"] == 0 and spies["pack"] == 0 and spies["on_host"] == 0
    assert spies["release"] == [0] * STEPS  # released after every step all the same
    offloaded = train(_config(small_dataset, tmp_path / "offload", "true"), progress=False)
    assert spies["enter"] == STEPS * MICRO
    assert [m.loss for m in offloaded.history] == [m.loss for m in plain.history]
    assert [m.grad_norm for m in offloaded.history] == [m.grad_norm for m in plain.history]
