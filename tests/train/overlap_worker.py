"""One rank of the overlapped-gradient-reduction check (run by test_overlap.py as a subprocess).

    python tests/train/overlap_worker.py RANK WORLD PORT JSON

JSON: {"sets": config overrides for ``demo-cpu``, "out": a file for rank 0's result}. The rank
trains with ``train()``; every dispatch of a gradient bucket's reduction
(megatron-core's ``_ParamAndGradBucketGroup.start_grad_sync``) is recorded with whether autograd
was running a backward pass at the time. Rank 0 writes {"history": the step metrics,
"dispatches": [[step, inside backward], ...]} to OUT.
"""

import json
import os
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
from megatron.core.distributed import param_and_grad_buffer  # noqa: E402

from genome_lm.config import load_config  # noqa: E402
from genome_lm.train import trainer  # noqa: E402


def main(rank: int, world: int, port: int, spec: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dispatches, step = [], [0]
    start = param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync

    def recorded(self, *args, **kwargs):
        dispatches.append([step[0], torch._C._current_graph_task_id() != -1])
        return start(self, *args, **kwargs)

    param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync = recorded
    take_step = trainer.Trainer.step

    def counted(self, i):
        step[0] = i
        return take_step(self, i)

    trainer.Trainer.step = counted
    result = trainer.train(load_config("demo-cpu", spec["sets"]), progress=False)
    if rank == 0:
        history = [{k: v for k, v in vars(m).items() if isinstance(v, (int, float)) and k != "seconds"}
                   for m in result.history]
        with open(spec["out"], "w") as f:
            json.dump({"history": history, "dispatches": dispatches}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
