"""One rank of the split-model count (run by test_activations.py as a subprocess).

    python tests/plan/split_worker.py RANK WORLD PORT '{"tp": 2}' T OUT
Rank 0 writes {"layer,piece": bytes} of what its forward saves (``saved.saved_by_piece``)."""

import json
import os
import sys

os.environ["TORCHDYNAMO_DISABLE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from saved import saved_by_piece  # noqa: E402

from genome_lm.engine.context_parallel import zigzag_split  # noqa: E402
from genome_lm.engine.parallel import ParallelSizes, init_distributed, parallel_context  # noqa: E402
from genome_lm.model import PRESETS  # noqa: E402
from genome_lm.model.model import build_model  # noqa: E402


def main(rank: int, world: int, port: int, sizes: dict, T: int, out: str) -> None:
    init_distributed(rank, world, init_method=f"tcp://127.0.0.1:{port}")
    sizes = ParallelSizes(**sizes)
    with parallel_context(sizes) as pg:
        torch.manual_seed(0)
        model = build_model(PRESETS["tiny"], pg, sizes, kernel_backend="torch")
        ids = torch.randint(4, 8, (1, T + 1), generator=torch.Generator().manual_seed(1))
        # the CP rank's zigzag part of inputs and targets
        inputs = zigzag_split(ids[:, :-1], sizes.cp, pg.cp.rank())
        targets = zigzag_split(ids[:, 1:], sizes.cp, pg.cp.rank())
        counts = saved_by_piece(model, torch.cat([inputs, targets[:, -1:]], dim=1))
        # saved_by_piece shifts ids by one for targets; under CP the targets are not a shift of the
        # inputs, but only their count matters for what is saved
        if rank == 0:
            with open(out, "w") as f:
                json.dump({f"{k[0]},{k[1]}" if isinstance(k, tuple) else k: v for k, v in counts.items()}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
