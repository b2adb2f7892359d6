"""The planner under pipeline parallel: each stage's parameters, the micro-batches in flight on it
(against genome-lm's own 1F1B schedule), and each stage's peak against a measured two-process
pipeline step on this CPU."""

import pytest
import torch

from genome_lm.config import load_config
from genome_lm.errors import GenomeLMError
from genome_lm.model import PRESETS
from genome_lm.plan.memory_model import Hardware, in_flight, parameter_split, stage_plans
from tests.train.test_pipeline_schedule import _Comm, _Group


def _run(pp: int, micro_batches: int, *changes: str):
    return load_config("demo-cpu", [f"parallel.pp={pp}", f"train.global_batch_size={micro_batches}", *changes])


def _schedule_in_flight(stage: int, stages: int, n_micro: int) -> int:
    """Most micro-batches forwarded and not yet backwarded at once on ``stage`` under run_1f1b."""
    from types import SimpleNamespace

    from genome_lm.train.pipeline import run_1f1b

    w = torch.randn(3, requires_grad=True)
    alive, most = [0], [0]

    def on_backward(grad):
        alive[0] -= 1
        return grad

    w.register_hook(on_backward)  # once per micro-batch's backward

    def forward(i, received):
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        x = w * (i + 1) if received is None else received * w
        return (None, x.sum()) if stage == stages - 1 else (x, None)

    model = SimpleNamespace(pg=SimpleNamespace(pp=_Group(stage, stages)))
    run_1f1b(model, n_micro, (3,), forward, _Comm([torch.randn(3) for _ in range(n_micro)], []))
    assert alive[0] == 0
    return most[0]


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("n_micro", [1, 3, 8])
def test_micro_batches_in_flight_are_the_schedules(stages, n_micro):
    run = _run(stages, n_micro)
    for stage in range(stages):
        # one data-parallel replica: every micro-batch of the global batch goes through each stage
        assert in_flight(run, stages, stage) == _schedule_in_flight(stage, stages, n_micro), (stage, n_micro)


@pytest.mark.parametrize("preset, stages", [("tiny", 2), ("tiny", 4), ("glm-5.3-flash", 5), ("glm-5.3-flash", 9)])
def test_stage_parameters_add_up_to_the_model(preset, stages):
    cfg = PRESETS[preset]
    per = cfg.num_hidden_layers // stages
    parts = [parameter_split(cfg, range(s * per, (s + 1) * per), s == 0, s == stages - 1) for s in range(stages)]
    whole = parameter_split(cfg)
    for kind in whole:
        assert sum(part[kind] for part in parts) == whole[kind]
    # the first stage adds the embedding to its layers, the last the output layer and final norm
    head = cfg.vocab_size * cfg.hidden_size
    first_layers = parameter_split(cfg, range(0, per), False, False)
    last_layers = parameter_split(cfg, range(cfg.num_hidden_layers - per, cfg.num_hidden_layers), False, False)
    assert {k: parts[0][k] - first_layers[k] for k in whole} == {"tensor": head, "replicated": 0, "expert": 0}
    assert {k: parts[-1][k] - last_layers[k] for k in whole} == {"tensor": head, "replicated": cfg.hidden_size,
                                                                  "expert": 0}


def test_stage_plans_split_the_layers_and_hold_more_in_flight_first():
    plans = stage_plans(_run(2, 4), Hardware(device="cpu", gpus=2))
    assert [(p.stage, p.layers, p.in_flight) for p in plans] == [(0, range(0, 2), 2), (1, range(2, 4), 1)]
    assert [i.name for i in plans[1].activations][-1] == "loss head"
    assert "loss head" not in [i.name for i in plans[0].activations]
    with pytest.raises(GenomeLMError, match="pipeline parallel 3 cannot split the 4 layers"):
        stage_plans(_run(3, 3), Hardware(device="cpu", gpus=3))


@pytest.mark.slow
def test_stage_peaks_within_15_percent_of_a_measured_pipeline_step():
    """Two gloo processes run the 1F1B schedule over 4 micro-batches of 4k tokens: the first
    stage holds two micro-batches' activations at once, the last one."""
    from genome_lm.plan.measure import measure_pipeline_step

    run = _run(2, 4, "data.seq_len=4096")
    measured = measure_pipeline_step(run)
    plans = stage_plans(run, Hardware(device="cpu", gpus=2))
    for plan, got in zip(plans, measured, strict=True):
        want = sum(i.bytes for i in plan.device if i.name.startswith(("gradients", "activations")))
        line = (f"stage {plan.stage}: predicted {want / 2**20:.0f} MiB, measured {got.peak_bytes / 2**20:.0f} MiB, "
                f"x{want / got.peak_bytes:.2f}")
        print(line)
        assert want == pytest.approx(got.peak_bytes, rel=0.15), line
