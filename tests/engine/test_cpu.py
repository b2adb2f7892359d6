"""The CPU redirections for megatron-core: still needed, and still enough.

Each check runs in a fresh process with its own single-rank gloo group, so megatron-core's
process-wide state never leaks between tests.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")

MOE = textwrap.dedent(
    """
    import os, socket, warnings
    warnings.simplefilter("ignore")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch, torch.distributed as dist
    from genome_lm.engine.cpu import enable_cpu_megatron
    if {redirect}:
        assert enable_cpu_megatron()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, add_bias_linear=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False, num_moe_experts=4, moe_router_topk=2,
        moe_ffn_hidden_size=16, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=16, moe_router_dtype="fp32",
        moe_token_dispatcher_type="allgather", gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    moe = get_moe_module_spec(use_te=False, num_experts=4)(config=config)
    x = torch.randn(8, 2, 32, requires_grad=True)
    out, _ = moe(x)
    out.square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    print("OK")
    """
)


DDP = textwrap.dedent(
    """
    import os, socket, warnings
    warnings.simplefilter("ignore")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch, torch.distributed as dist
    from genome_lm.engine import cpu
    if {redirect}:
        assert cpu.enable_cpu_megatron()
    else:  # only the stream redirection is left out
        cpu._state["current_device"] = torch.cuda.current_device
        torch.cuda.current_device = cpu._cpu_device
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                               add_bias_linear=False, gradient_accumulation_fusion=False)
    module = ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.normal_, bias=False)
    module.config = config
    pg = ProcessGroupCollection.use_mpu_process_groups()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), module, pg_collection=pg)
    ddp(torch.randn(4, 8))[0].square().sum().backward()
    finalize_model_grads([ddp], pg_collection=pg)
    assert module.weight.main_grad.abs().sum() > 0
    print("OK")
    """
)


def _run(redirect: bool, script: str = MOE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script.format(redirect=redirect)], capture_output=True, text=True,
                          timeout=300)


def test_megatron_ddp_gradient_sync_runs_on_cpu_with_the_redirection():
    result = _run(redirect=True, script=DDP)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


@pytest.mark.slow
def test_the_stream_redirection_is_still_needed():
    """If this fails, megatron-core's gradient buffers no longer ask for the current CUDA stream."""
    result = _run(redirect=False, script=DDP)
    assert result.returncode != 0 and "current_stream" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_megatron_moe_runs_on_cpu_with_the_redirection():
    result = _run(redirect=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


@pytest.mark.slow
def test_the_redirection_is_still_needed():
    """If this fails, megatron-core no longer calls torch.cuda.current_device here: drop the redirection."""
    result = _run(redirect=False)
    assert result.returncode != 0 and "NVIDIA driver" in result.stderr, result.stderr[-3000:]


def test_enable_is_idempotent_and_undoable():
    from genome_lm.engine import cpu

    was_enabled = cpu._state["enabled"]  # model tests in this process may have enabled it already
    cpu.disable_cpu_megatron()
    original = torch.cuda.current_device
    try:
        assert cpu.enable_cpu_megatron() is True
        assert cpu.enable_cpu_megatron() is False
        assert torch.cuda.current_device() == torch.device("cpu")
    finally:
        cpu.disable_cpu_megatron()
    assert torch.cuda.current_device is original
    if was_enabled:
        cpu.enable_cpu_megatron()


IMPORT_ONLY = textwrap.dedent(
    """
    import importlib, pkgutil, warnings
    warnings.simplefilter("ignore")
    import torch
    device, stream = torch.cuda.current_device, torch.cuda.current_stream
    import genome_lm
    names = [m.name for m in pkgutil.walk_packages(genome_lm.__path__, "genome_lm.")
             if not m.name.endswith("__main__")]
    for name in names:
        importlib.import_module(name)
    from genome_lm.engine import cpu
    assert len(names) > 40, names
    assert not cpu._state["enabled"]
    assert torch.cuda.current_device is device and torch.cuda.current_stream is stream
    print("OK", len(names))
    """
)


@pytest.mark.slow
def test_importing_genome_lm_redirects_nothing():
    """Importing every genome-lm module (the CLI, the model, the trainer, eval, plan) applies
    none of the redirections: only building megatron-core modules does."""
    result = subprocess.run([sys.executable, "-c", IMPORT_ONLY], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_a_layout_the_ranks_cannot_hold_is_a_one_line_error():
    """e.g. `genome-lm finetune --set parallel.pp=2` in one process: an error the CLI prints in one line."""
    from genome_lm.engine.parallel import ParallelSizes
    from genome_lm.errors import GenomeLMError

    for sizes, message in ((ParallelSizes(pp=2), "tp\\*cp\\*pp = 2"), (ParallelSizes(ep=2), "ep\\*etp\\*pp = 2")):
        with pytest.raises(GenomeLMError, match=f"world size 1 is not a multiple of {message}") as info:
            sizes.check(1)
        assert "\n" not in str(info.value)
