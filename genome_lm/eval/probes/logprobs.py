"""`genome-lm check-logprobs`: the training forward against independent inference paths.

For each length T, one sequence of T tokens (random DNA, seeded, or the start of a dataset's
evaluation window) is scored by the training forward (``model(ids)``, the path the trainer
differentiates) and by each inference path; the per-token log-probability of the realised next
token is compared: mean and max |delta logprob| over the T - 1 positions. Paths:

- ``prefill``: genome-lm's chunked prefill (``genome_lm.model.prefill``: carried KDA state,
  cached MLA latents, absorbed attention). Always run.
- ``transformers``: transformers' glm5_next on the same Hugging Face checkpoint, when the model
  is one and transformers has glm5_next (flash-linear-attention hidden from it on a CPU machine,
  as `genome-lm parity` does). A training checkpoint: export it first (`genome-lm export`).
- ``vllm``: vLLM on the same Hugging Face checkpoint, when vLLM is installed and a GPU is
  present (prompt log-probabilities; not exercised on the CPU machines this was written on).

A path fails when its max |delta| exceeds the threshold (default 1e-4 for fp32 models; the
published check saw means of 0.04-0.07 in bf16 at 128k-1M, and SkyRL's threshold is 0.1).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from genome_lm.engine import quiet_megatron_import
from genome_lm.engine.backend import on_gpu
from genome_lm.errors import GenomeLMError

BASES = (4, 5, 6, 7)  # A C G T in genome-lm's tokenizer


@dataclass
class LogprobRow:
    path: str
    length: int
    mean_abs: float | None
    max_abs: float | None
    passed: bool | None  # None: not run
    note: str = ""


def realised_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> np.ndarray:
    """log p(ids[t + 1] | ids[:t + 1]) for t < T - 1 of batch row 0: float64 [T - 1]."""
    lp = torch.log_softmax(logits_BTV[0, :-1].float(), dim=-1)
    return lp.gather(-1, ids_BT[0, 1:, None])[:, 0].double().cpu().numpy()


def _tokens(length: int, seed: int, dataset: Path | None, token_map) -> torch.Tensor:
    if dataset is not None:
        from genome_lm.data.loader import SplitReader

        reader = SplitReader(dataset, "eval")
        longest = int(np.argmax(reader.lengths))
        if reader.lengths[longest] < length:
            raise GenomeLMError(f"{dataset}: its longest evaluation window has {reader.lengths[longest]:,} tokens, "
                                f"fewer than --lengths {length:,}")
        ids = torch.from_numpy(reader.tokens(longest, 0, length).astype(np.int64))
    else:
        gen = torch.Generator().manual_seed(seed + length)
        ids = torch.tensor(BASES)[torch.randint(len(BASES), (length,), generator=gen)]
    return (token_map[ids] if token_map is not None else ids)[None]


def _transformers_logprobs(hf_dir: Path, ids: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    from genome_lm.compare.parity import _import_transformers_model

    model = _import_transformers_model().from_pretrained(hf_dir, dtype=dtype).eval().to(ids.device)
    with torch.no_grad():
        return realised_logprobs(model(input_ids=ids).logits, ids)


def _vllm_logprobs(hf_dir: Path, ids: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(hf_dir), dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
              max_model_len=ids.shape[1] + 1, enforce_eager=True)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    tokens = ids[0].tolist()
    result = llm.generate([{"prompt_token_ids": tokens}], params)[0]
    # prompt_logprobs[t] holds log p(token t | tokens before it), always including token t itself
    return np.array([result.prompt_logprobs[t][tokens[t]].logprob for t in range(1, len(tokens))], dtype=np.float64)


def _path_available(path: str, hf_dir: Path | None) -> str:
    """'' when the path can run, else why not."""
    if path == "prefill":
        return ""
    if hf_dir is None:
        return "the model is not a Hugging Face folder (export it with `genome-lm export`)"
    if path == "transformers":
        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed"
        from genome_lm.compare.parity import _import_transformers_model

        try:  # hides flash-linear-attention from transformers on a CPU machine before importing it
            _import_transformers_model()
        except GenomeLMError:
            return "this transformers has no glm5_next (needs >= 5.16.1)"
        return ""
    if path == "vllm":
        if not on_gpu():
            return "no GPU"
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed"
        return ""
    raise GenomeLMError(f"unknown path {path!r}; choose from prefill, transformers, vllm")


def check_logprobs(model_spec: str, lengths: list[int], *, chunk: int = 4096, threshold: float | None = None,
                   seed: int = 0, dataset: Path | None = None, paths=("prefill", "transformers", "vllm"),
                   progress=None) -> tuple[list[LogprobRow], float]:
    """Rows per (path, length) and the threshold applied. ``model_spec``: a run, checkpoint or
    Hugging Face folder (``eval.models``), or ``preset:NAME`` for fresh weights seeded by ``seed``."""
    from genome_lm.engine.parallel import parallel_context
    from genome_lm.model.prefill import chunked_logits

    from ..models import load_model
    from ..score import model_device

    rows: list[LogprobRow] = []
    with quiet_megatron_import(), parallel_context() as pg:
        lm = load_model(model_spec, pg, seed=seed)
        model, token_map = lm.model, lm.token_map
        hf_dir = Path(lm.info.path) if lm.info.kind == "huggingface" else None
        dtype = next(model.parameters()).dtype
        if threshold is None:
            threshold = 1e-4 if dtype == torch.float32 else 0.1
        skip = {p: _path_available(p, hf_dir) for p in paths}
        for length in lengths:
            if length < 2:
                raise GenomeLMError(f"--lengths {length}: need at least 2 tokens (one prediction)")
            ids = _tokens(length, seed, dataset, token_map).to(model_device(model))
            with torch.no_grad():
                reference = realised_logprobs(model(ids).logits, ids)
            for path in paths:
                if skip[path]:
                    rows.append(LogprobRow(path, length, None, None, None, f"not run: {skip[path]}"))
                    continue
                if path == "prefill":
                    logits = torch.cat([lg for _, lg in chunked_logits(model, ids, chunk)], 1)
                    other = realised_logprobs(logits, ids)
                elif path == "transformers":
                    other = _transformers_logprobs(hf_dir, ids, dtype)
                else:
                    other = _vllm_logprobs(hf_dir, ids, dtype)
                delta = np.abs(other - reference)
                finite = bool(np.isfinite(delta).all())
                row = LogprobRow(path, length, float(delta.mean()), float(delta.max()),
                                 finite and float(delta.max()) <= threshold,
                                 f"chunk {chunk:,}" if path == "prefill" else "")
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows, threshold
