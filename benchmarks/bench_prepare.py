"""Benchmark `genome-lm prepare` against two baselines on the same FASTA, in one run.

Baselines (each writes the token stream to one file, and nothing else):
  dict  per-window pyfaidx fetch + per-character dictionary look-up (how HyenaDNA-style
        loaders tokenize)
  lut   per-window pyfaidx fetch + a numpy look-up table

genome-lm does the full job on top: validation and SHA-256 of the whole file, soft-mask and
ambiguity flags, N-window skipping, the Megatron .bin/.idx per split and the manifest. Every
method runs in its own process; wall time and the peak RSS of the largest process in its tree
(wait4's ru_maxrss) are reported, with the ratio of each baseline's time to genome-lm's.

    python benchmarks/bench_prepare.py                 # hg38-sized chr1, chr2, chr22 (541 Mbp)
    python benchmarks/bench_prepare.py --scale 0.1     # a quick run
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HG38 = {"chr1": 248_956_422, "chr2": 242_193_529, "chr22": 50_818_468}


def make_fasta(path: Path, scale: float, seed: int = 0) -> None:
    """Random bases with hg38-like soft-masking (~50% lowercase) and N runs, 60 per line."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        for name, full in HG38.items():
            length = int(full * scale)
            out.write(f">{name}\n".encode())
            block = 6_000_000  # a multiple of 60
            for start in range(0, length, block):
                n = min(block, length - start)
                seq = rng.choice(np.frombuffer(b"ACGT", dtype=np.uint8), size=n)
                lower = np.repeat(rng.random(n // 300 + 1) < 0.5, 300)[:n]
                seq[lower] |= 32
                if start == 0 and name == "chr22":
                    seq[: n // 5] = ord("N")  # chr22's leading N run
                lines = np.full((n + 59) // 60 * 61, ord("\n"), dtype=np.uint8)
                body = lines.reshape(-1, 61)
                flat = np.zeros(body.shape[0] * 60, dtype=np.uint8)
                flat[:n] = seq
                body[:, :60] = flat.reshape(-1, 60)
                text = body.reshape(-1)
                if n % 60:
                    text = np.concatenate([text[: (n // 60) * 61], flat[(n // 60) * 60 : n],
                                           [ord("\n")]]).astype(np.uint8)
                out.write(text.tobytes())


def baseline(method: str, fasta: str, window: int, out: str) -> None:
    import pyfaidx

    fa = pyfaidx.Fasta(fasta, as_raw=True, sequence_always_upper=False)
    vocab = {c: i for i, c in enumerate("ACGTN", start=4)}
    vocab |= {c.lower(): i for c, i in vocab.items()}
    lut = np.full(256, 255, dtype=np.uint8)
    for c, i in vocab.items():
        lut[ord(c)] = i
    with open(out, "wb") as sink:
        for name in HG38:
            length = len(fa[name])
            for start in range(0, length - window + 1, window):
                seq = fa[name][start : start + window]
                if method == "dict":
                    tokens = np.array([vocab[c] for c in seq], dtype=np.uint8)
                else:
                    tokens = lut[np.frombuffer(seq.encode("ascii"), dtype=np.uint8)]
                tokens.tofile(sink)


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB of the largest process in the tree).

    Linux keeps a process's peak RSS across fork and exec, so the parent must stay small."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"failed ({status}): {' '.join(cmd)}")
    return elapsed, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of hg38's chr1/chr2/chr22 lengths")
    parser.add_argument("--window", type=int, default=524_288)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/genome-lm-bench"))
    parser.add_argument("--skip-dict", action="store_true", help="skip the slow per-character baseline")
    parser.add_argument("--baseline", choices=["dict", "lut"], help=argparse.SUPPRESS)
    parser.add_argument("--fasta", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:  # child process
        baseline(args.baseline, args.fasta, args.window, args.out)
        return
    if args.make:  # child process, so that the parent's peak RSS (inherited by children) stays small
        make_fasta(Path(args.fasta), args.scale)
        return

    args.workdir.mkdir(parents=True, exist_ok=True)
    fasta = args.workdir / f"genome-{args.scale}.fa"
    if not fasta.exists():
        print(f"writing {fasta} ...", flush=True)
        subprocess.run([sys.executable, __file__, "--make", "--scale", str(args.scale), "--fasta", str(fasta)],
                       check=True)
        # the .fai, shared by all methods and not timed
        subprocess.run([sys.executable, "-c", f"import pyfaidx; pyfaidx.Fasta({str(fasta)!r})"], check=True)
    bases = sum(int(v * args.scale) for v in HG38.values())
    me = [sys.executable, __file__, "--window", str(args.window), "--fasta", str(fasta)]
    cli = Path(sys.executable).with_name("genome-lm")
    runs = {}
    for workers in ("1", str(len(os.sched_getaffinity(0)))):
        out = args.workdir / f"prepared-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        runs[f"genome-lm prepare --workers {workers}"] = timed(
            [str(cli), "prepare", "--fasta", str(fasta), "--out", str(out), "--window", str(args.window),
             "--workers", workers, "--quiet", "--force"]
        )
    runs["baseline: pyfaidx + numpy LUT"] = timed(me + ["--baseline", "lut", "--out", str(args.workdir / "lut.bin")])
    if not args.skip_dict:
        runs["baseline: pyfaidx + per-char dict"] = timed(me + ["--baseline", "dict", "--out",
                                                                str(args.workdir / "dict.bin")])

    ours = min(t for name, (t, _) in runs.items() if name.startswith("genome-lm"))
    print(f"\n{bases / 1e6:.0f} Mbp in chr1+chr2+chr22, window {args.window:,}, {os.cpu_count()} cores")
    print(f"{'method':40} {'seconds':>8} {'Mbp/s':>7} {'peak RSS':>9} {'time / genome-lm':>17}")
    for name, (seconds, rss) in runs.items():
        print(f"{name:40} {seconds:8.2f} {bases / 1e6 / seconds:7.1f} {rss:7.0f}Mi {seconds / ours:16.2f}x")


if __name__ == "__main__":
    main()
