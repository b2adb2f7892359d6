"""`genome-lm score` against eval on the same windows, in the same run: tokens/s of eval's per-window
scorer (``eval.score.token_nll``: the NLL of each base), of score's (``eval.tracks.score_segment``:
the log-likelihood, entropy and A/C/G/T probabilities of each base) and of score's with the
embeddings of one layer written to Zarr. The three alternate window by window, so machine noise
hits them alike (each goes first in turn); the median over the windows is shown, with each
ratio to eval (above 1: faster than eval).

With --memory also the peak RSS of ``genome-lm score --embeddings final`` (a fresh process each)
over a region and one four times as long: bounded memory means the same peak.

    .venv/bin/python benchmarks/bench_score.py --windows 6 --window 32k --memory
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
GENOME = REPO.parent / "shared" / "data" / "genomes" / "hg38_chr2_1-2333275.fa.gz"


def _windows(n: int, window: int) -> list[np.ndarray]:
    """``n`` windows of real DNA from the shared chr2 piece (random bases when it is absent)."""
    from genome_lm.data.tokenizer import tokenize

    if GENOME.is_file():
        import pyfaidx

        with tempfile.TemporaryDirectory() as tmp:
            plain = Path(tmp) / "g.fa"
            subprocess.run(f"gzip -dc {GENOME} > {plain}", shell=True, check=True)
            seq = str(pyfaidx.Fasta(str(plain))[0][500_000:500_000 + n * window])
        return [tokenize(seq[i * window:(i + 1) * window].encode()) for i in range(n)]
    rng = np.random.default_rng(0)
    return [tokenize(bytes(rng.choice(list(b"ACGT"), window))) for _ in range(n)]


def throughput(n: int, window: int, chunk: int) -> None:
    from genome_lm.data.regions import Region
    from genome_lm.engine.parallel import parallel_context
    from genome_lm.eval.embeddings import EmbeddingSpec, EmbeddingStore, LayerTaps
    from genome_lm.eval.models import load_model
    from genome_lm.eval.score import token_nll
    from genome_lm.eval.tracks import Segment, score_segment

    windows = _windows(n, window)
    times = {"eval (NLL)": [], "score (tracks)": [], "score (tracks + embeddings)": []}
    with parallel_context() as pg, tempfile.TemporaryDirectory() as tmp:
        model = load_model("builtin:tiny-long", pg).model.eval()
        token_nll(model, windows[0][:4096], chunk=chunk)  # warm up (the first window of each is timed too)
        score_segment(model, windows[0][:4096], Segment(0, 1, 4096), chunk=chunk)
        seg = Segment(0, 1, window)
        for k, tokens in enumerate(windows):
            store = EmbeddingStore(Path(tmp) / f"e{k}.zarr", [Region("w", 0, window)], EmbeddingSpec(("final",)),
                                   model.cfg.hidden_size, window)
            runs = {"eval (NLL)": lambda: token_nll(model, tokens, chunk=chunk),
                    "score (tracks)": lambda: score_segment(model, tokens, seg, chunk=chunk)}
            with LayerTaps(model, ("final",)) as taps:
                def tapped():
                    score_segment(model, tokens, Segment(0, 0, window), chunk=chunk, taps=taps,
                                  rows=store.segment(0, 0))
                runs["score (tracks + embeddings)"] = tapped
                order = list(runs.items())
                for name, fn in order[k % 3:] + order[:k % 3]:  # each scorer first in turn
                    start = time.perf_counter()
                    with torch.no_grad():
                        fn()
                    times[name].append(time.perf_counter() - start)
    base = statistics.median(times["eval (NLL)"])
    print(f"{n} windows of {window:,} tokens, chunk {chunk:,}, builtin:tiny-long, {torch.get_num_threads()} threads")
    print(f"{'scorer':<30} {'median s':>9} {'tokens/s':>10} {'/ eval':>7}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<30} {med:>9.2f} {window / med:>10,.0f} {base / med:>7.3f}")


def peak_rss(region: str, fasta: Path, out: Path, window: str) -> tuple[float, int]:
    """(seconds, peak RSS kB) of one ``genome-lm score --embeddings final``, a child of this
    process: call it once per process (RUSAGE_CHILDREN keeps the largest child's peak)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "genome_lm", "score", "--model", "builtin:tiny-long", "--fasta",
                           str(fasta), "--regions", region, "--window", window, "--context", "8k",
                           "--embeddings", "final", "--quiet", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if done.returncode:
        raise SystemExit(done.stdout + done.stderr)
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


def fresh_peak(region: str, out: Path, window: str) -> tuple[float, int]:
    """``peak_rss`` in a Python process of its own."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.bench_score import peak_rss, GENOME; "
            f"from pathlib import Path; s, kb = peak_rss({region!r}, GENOME, Path({str(out)!r}), {window!r}); "
            "print(s, kb)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, kb = done.stdout.split()
    return float(seconds), int(kb)


def memory(window: str) -> None:
    if not GENOME.is_file():
        raise SystemExit(f"{GENOME}: absent; --memory reads the shared chr2 piece")
    with tempfile.TemporaryDirectory() as tmp:
        short_s, short_kb = fresh_peak("chr2:400,001-500,000", Path(tmp) / "short", window)
        long_s, long_kb = fresh_peak("chr2:400,001-800,000", Path(tmp) / "long", window)
    print(f"score --embeddings final, window {window}, context 8k: 100 kbp {short_s:.1f} s, peak {short_kb:,} kB; "
          f"400 kbp {long_s:.1f} s, peak {long_kb:,} kB; ratio {long_kb / short_kb:.3f}")


def main() -> None:
    from genome_lm.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--window", default="32k")
    parser.add_argument("--chunk", default="32k")
    parser.add_argument("--memory", action="store_true")
    opts = parser.parse_args()
    throughput(opts.windows, parse_size(opts.window), parse_size(opts.chunk))
    if opts.memory:
        memory(opts.window)


if __name__ == "__main__":
    main()
