"""Checkpoints: training checkpoints (save, verify, load), what a path names, and the model a run
configuration names with its weights.

    training.py   the checkpoint format: weights and optimizer state in pieces, RNG and loader state,
                  a verified meta.json, written atomically (``save_checkpoint``, ``verify``,
                  ``load_checkpoint``, ``read_weights``)
    sharded.py    layout-free pieces: each tensor stored once, placed in the whole tensor, read back
                  under any parallel layout
    paths.py      run folder / checkpoint folder / Hugging Face folder (``resolve``), the run
                  folder's checkpoints, and where a resumed run starts
    huggingface.py  the Hugging Face glm5_next format: parameter <-> tensor names, load and export
                  under any parallel layout (the collectives are ``genome_lm.engine.layout``'s)
    models.py     the model a RunConfig builds, with weights (``build``) and its token map
"""

from .models import build, token_map  # noqa: F401
from .paths import ModelPath, check_run_folder, existing_checkpoints, resolve, resume_point, training_checkpoint  # noqa: F401
from .training import (  # noqa: F401
                    CheckpointCorrupt,
                    latest_checkpoint,
                    load_checkpoint,
                    load_weights,
                    read_weights,
                    rng_state,
                    save_checkpoint,
                    set_rng_state,
                    verify,
                    weight_layout,
)
