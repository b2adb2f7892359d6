"""The backend profile: one place decides the GPU and CPU paths, and the code follows it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from genome_lm.engine.backend import BackendProfile, current, profile


def test_cpu_profile():
    cpu = profile(gpu=False)
    assert (cpu.device, cpu.process_groups, cpu.transformer_impl, cpu.moe_dispatcher, cpu.optimizer,
            cpu.kernel_backend.name) == ("cpu", "gloo", "local", "allgather", "cpu-adamw", "torch")
    assert cpu.cpu_initialization and not cpu.batch_p2p and not cpu.pinned_host_memory
    assert not cpu.distributed_optimizer


@pytest.mark.parametrize("te", [True, False])
def test_gpu_profile_as_values(te):
    """The GPU path's choices, read without a GPU."""
    gpu = profile(gpu=True, transformer_engine=te)
    assert (gpu.device, gpu.process_groups, gpu.moe_dispatcher, gpu.optimizer, gpu.kernel_backend.name) == (
        "cuda", "nccl", "alltoall", "megatron-distributed", "triton")
    assert gpu.transformer_impl == ("transformer_engine" if te else "local")
    assert gpu.batch_p2p and gpu.pinned_host_memory and gpu.distributed_optimizer and not gpu.cpu_initialization
    assert gpu.resolve_impl("auto") == gpu.transformer_impl and gpu.resolve_impl("local") == "local"
    assert "nccl" in gpu.describe() and gpu.as_params()["backend.profile"] == "gpu"


def test_profiles_differ_in_every_choice_but_the_name():
    cpu, gpu = profile(gpu=False), profile(gpu=True, transformer_engine=True)
    same = [f.name for f in dataclasses.fields(BackendProfile) if getattr(cpu, f.name) == getattr(gpu, f.name)]
    assert same == []


def test_this_machine_runs_the_profile_of_its_device():
    assert current() == profile(gpu=torch.cuda.is_available())


@pytest.mark.parametrize("gpu", [False, True])
def test_megatron_config_follows_the_profile(monkeypatch, gpu):
    """megatron-core's config takes the dispatcher, initialisation and p2p mode from the profile."""
    from genome_lm.engine import backend
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.model import get_preset
    from genome_lm.model.common import BuildOptions, megatron_config

    chosen = profile(gpu=gpu, transformer_engine=False)
    monkeypatch.setattr(backend, "current", lambda: chosen)
    tf = megatron_config(get_preset("tiny"), ParallelSizes(), BuildOptions())
    assert tf.moe_token_dispatcher_type == chosen.moe_dispatcher
    assert tf.use_cpu_initialization == chosen.cpu_initialization
    assert tf.batch_p2p_comm == chosen.batch_p2p


@pytest.mark.parametrize("gpu", [False, True])
def test_optimizer_follows_the_profile(monkeypatch, gpu):
    """CPUAdamW on the CPU profile; megatron-core's optimizer factory on the GPU one (called, not run)."""
    import megatron.core.optimizer as mcore_optimizer

    from genome_lm.config import load_config
    from genome_lm.train.optim import CPUAdamW, make_optimizer

    made = []
    monkeypatch.setattr(CPUAdamW, "__init__", lambda self, *a: made.append("cpu-adamw"))
    monkeypatch.setattr(mcore_optimizer, "get_megatron_optimizer",
                        lambda *a, **k: made.append("megatron-distributed") or type("O", (), {"param_groups": []})())

    class DDP:
        module = type("M", (), {"options": type("O", (), {"dtype": torch.float32})()})()

    make_optimizer(load_config("demo-cpu", []), DDP(), None, profile(gpu=gpu, transformer_engine=False))
    assert made == [profile(gpu=gpu, transformer_engine=False).optimizer]


def test_the_model_reads_auto_from_the_profile(monkeypatch):
    """``build_model(kernel_backend="auto")`` takes the profile's backend, resolves it once, and
    every layer passes that one object to the ops."""
    from genome_lm.engine import backend
    from genome_lm.engine.parallel import ParallelSizes, parallel_context
    from genome_lm.model import get_preset
    from genome_lm.model.model import build_model
    from genome_lm_kernels import resolve_backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    chosen = dataclasses.replace(profile(gpu=False), kernel_backend=resolve_backend("triton-fp32", "cpu"))
    monkeypatch.setattr(backend, "current", lambda: chosen)
    with parallel_context() as pg:
        model = build_model(get_preset("tiny"), pg, ParallelSizes(), kernel_backend="auto")
    resolved = model.options.kernel_backend
    assert resolved.name == "triton-fp32" and model.options.absorbed_mla
    layers = [m for m in model.modules() if hasattr(m, "backend")]
    assert layers and all(m.backend is resolved for m in layers)


def test_the_profile_says_whether_the_c_kernels_run():
    """The CPU profile's kernels are the torch path with the C kernels of this install (the
    backend resolution decides; the description and the MLflow parameter say so)."""
    from genome_lm_kernels.cpu import native

    cpu = profile(gpu=False)
    assert cpu.kernel_backend.native == native.available()
    expected = f"torch with C kernels ({native.level()} build)" if native.available() else "torch"
    assert f"kernels: {expected})" in cpu.describe()
    assert cpu.as_params()["backend.kernels"] == expected
