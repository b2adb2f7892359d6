"""``genome-lm generate``: DNA from a prompt (``genome_lm.eval.generate``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from genome_lm.data.regions import parse_region, split_regions
from genome_lm.engine import quiet_megatron_import
from genome_lm.errors import GenomeLMError
from genome_lm.progress import progress_bar

from .base import app, console, size


def read_prompts(prompt: str | None, fasta: Path | None, regions: str, prompts: Path | None) -> list:
    """(name, genome-lm ids) of every prompt: ``--prompt``, the ``--regions`` of ``--fasta``, and
    the records of ``--prompts``, in that order; at least one."""
    from genome_lm.eval.generate import prompt_tokens

    found = []
    if prompt is not None:
        found.append(("prompt", prompt_tokens("--prompt", prompt)))
    if regions and fasta is None:
        raise GenomeLMError("--regions reads its prompts from --fasta: give --fasta FILE")
    if fasta is not None:
        if not regions:
            raise GenomeLMError("--fasta takes its prompts from --regions (chr2:1,000,001-1,032,768, ...)")
        from genome_lm.data.fasta import fetch_bytes, open_fasta
        from genome_lm.data.prepare import default_cache_dir

        with tempfile.TemporaryDirectory() as work:
            source = open_fasta(Path(fasta), Path(work), default_cache_dir())
            handle = source.handle.open()
            for text in split_regions(regions):
                region = parse_region(text, source.names())
                if region.name not in source.names():
                    raise GenomeLMError(f"{fasta}: no record {region.name!r}")
                region = region.bounded(source.length(region.name), str(fasta))
                found.append((str(region), prompt_tokens(str(region), fetch_bytes(handle, source.handle, region.name,
                                                                                  region.start, region.end))))
    if prompts is not None:
        found += _fasta_records(prompts)
    if not found:
        raise GenomeLMError("no prompt: give --prompt SEQUENCE, --fasta FILE --regions R, or --prompts FILE")
    return found


def _fasta_records(path: Path) -> list:
    """Every record of a small FASTA file of prompts, read whole."""
    from genome_lm.eval.generate import prompt_tokens

    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise GenomeLMError(f"{path}: cannot read ({exc.strerror})") from None
    records, name, parts = [], None, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith(b">"):
            if name is not None:
                records.append((name, prompt_tokens(f"{path}:{name}", b"".join(parts))))
            name, parts = line[1:].split()[0].decode() if line[1:].split() else f"record{len(records) + 1}", []
        elif line.strip():
            if name is None:
                raise GenomeLMError(f"{path}:{number}: sequence before the first '>' header: not FASTA")
            parts.append(line.strip())
    if name is not None:
        records.append((name, prompt_tokens(f"{path}:{name}", b"".join(parts))))
    if not records:
        raise GenomeLMError(f"{path}: no FASTA records")
    return records


@app.command("generate")
def generate_command(
    model: Annotated[str, typer.Option(help="The model: a training run folder, a checkpoint folder, a Hugging Face "
                                            "glm5_next folder, or builtin:tiny-long.")],
    out: Annotated[Path, typer.Option(help="The FASTA to write: one record per prompt, the settings in its header.")],
    n_tokens: Annotated[int, typer.Option("--n-tokens", help="Bases to generate after each prompt.")],
    prompt: Annotated[Optional[str], typer.Option(help="A prompt sequence (A, C, G, T, N, IUPAC codes).",
                                                  show_default=False)] = None,
    fasta: Annotated[Optional[Path], typer.Option(help="A genome FASTA to take prompts from (--regions).",
                                                  show_default=False)] = None,
    regions: Annotated[str, typer.Option(help="With --fasta: the prompts, as regions, comma-separated, 1-based "
                                              "inclusive (chr2:1,000,001-1,032,768).")] = "",
    prompts: Annotated[Optional[Path], typer.Option(help="A FASTA file whose records are prompts.",
                                                    show_default=False)] = None,
    temperature: Annotated[float, typer.Option(help="Divides the bases' logits before sampling.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely bases (0: all four).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample among the fewest most likely bases whose probability "
                                              "reaches p, in (0, 1].")] = 1.0,
    greedy: Annotated[bool, typer.Option("--greedy", help="Always the most likely base (no sampling).")] = False,
    seed: Annotated[int, typer.Option(help="The sampler's seed: the same seed, prompts and model give the same "
                                           "sequences.")] = 0,
    logprobs: Annotated[Optional[Path], typer.Option(help="Also a TSV of each generated base's log-probability "
                                                          "under the model (name, position, base, logprob).",
                                                     show_default=False)] = None,
    chunk: Annotated[str, typer.Option(help="Prompt tokens per prefill chunk.")] = "32k",
    batch: Annotated[int, typer.Option(help="Prompts of the same length generated together.", min=1)] = 8,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Generate DNA after prompts: each prompt is read once through chunked prefill, then each new
    base is one step against the model's caches (KDA states, DSA latents), so a base costs about the
    same whatever the prompt's length. Only A, C, G and T are emitted (the vocabulary's other tokens
    are masked); --temperature, --top-k and --top-p shape the draw, --greedy takes the most likely
    base. One process."""
    from genome_lm.eval.generate import Sampling

    sampling = Sampling(n_tokens=n_tokens, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                        seed=seed)
    sampling.check()
    found = read_prompts(prompt, fasta, regions, prompts)
    chunk_tokens = size(chunk, "--chunk")
    with quiet_megatron_import():
        made = _run(model, found, sampling, chunk_tokens, batch, quiet)
    _write_fasta(out, made, sampling, model)
    if logprobs is not None:
        from genome_lm.eval.report import atomic_write  # (imports torch: not at --help)

        rows = ["name\tposition\tbase\tlogprob"] + [f"{g.name}\t{g.prompt_length + k + 1}\t{base}\t{lp:.6f}"
                                                   for g in made for k, (base, lp) in enumerate(zip(g.sequence,
                                                                                                    g.logprob))]
        atomic_write(Path(logprobs), ("\n".join(rows) + "\n").encode())
    console.print(f"wrote {sum(len(g.sequence) for g in made):,} bases after {len(made)} prompt"
                  f"{'s' if len(made) > 1 else ''} to {out} ({sampling.words()})", highlight=False, soft_wrap=True)


def _run(model: str, found: list, sampling, chunk: int, batch: int, quiet: bool):
    from genome_lm.engine.parallel import parallel_context
    from genome_lm.eval.generate import generate
    from genome_lm.eval.models import load_model

    with parallel_context() as pg, progress_bar(quiet=quiet) as bar:
        loaded = load_model(model, pg)
        task = bar.add_task("generate", total=len(found) * sampling.n_tokens, unit="bp")
        return generate(loaded.model.eval(), found, sampling, chunk=chunk, token_map=loaded.token_map, batch=batch,
                        on_token=lambda n: bar.advance(task, n))


def _write_fasta(out: Path, made: list, sampling, model: str) -> None:
    from genome_lm.eval.report import atomic_write  # (imports torch: not at --help)

    lines = []
    for g in made:
        lines.append(f">{g.name}+generated prompt_length={g.prompt_length} {sampling.words()} model={model}")
        lines += [g.sequence[i:i + 60] for i in range(0, len(g.sequence), 60)]
    atomic_write(Path(out), ("\n".join(lines) + "\n").encode())
