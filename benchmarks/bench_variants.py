"""Variants per second of `genome-lm variants`' shared-context scoring against scoring both full
windows of every variant, and against the field notebooks' way (both full windows, a site's
reference window scored once), on the same variants and model, in the same process.

The variants are the first sites of the Findlay BRCA1 set (../shared/data/variants; three SNVs
at most sites), the model builtin:tiny-long, the window the field's 8,192 bases (4,096 before
the variant, the variant, 4,095 after). Both ways give the same scores up to rounding (checked here: under 1e-5 nats a
position; tests/variants/test_score.py); the ratio is what sharing the preceding context buys.

    .venv/bin/python benchmarks/bench_variants.py [--sites 40] [--left 4096] [--right 4095]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "variants"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sites", type=int, default=40)
    parser.add_argument("--left", type=int, default=4096)
    parser.add_argument("--right", type=int, default=4095)
    args = parser.parse_args()

    import torch

    from genome_lm.data.tokenizer import tokenize
    from genome_lm.engine import quiet_megatron_import
    from genome_lm.engine.parallel import parallel_context
    from genome_lm.eval.models import load_model
    from genome_lm.variants.run import score_model, sites
    from genome_lm.variants.score import full_window_logprobs
    from genome_lm.variants.vcf import Reference, read_variants, windows

    torch.set_num_threads(2)
    found = read_variants(SHARED / "findlay2018_brca1_sge.vcf.gz", SHARED / "brca1_hg19.fa.gz", left=args.left,
                          right=args.right)
    chosen = {(s.contig, s.position) for s in sites(found.variants, "+")[:args.sites]}
    variants = [v for v in found.variants if (v.contig, v.start) in chosen]
    with Reference(SHARED / "brca1_hg19.fa.gz") as fasta, quiet_megatron_import(), parallel_context() as pg:
        lm = load_model("builtin:tiny-long", pg)
        score_model(lm, variants[:3], fasta, left=args.left, right=args.right)  # warm-up

        t0 = time.perf_counter()
        shared, _ = score_model(lm, variants, fasta, left=args.left, right=args.right)
        t_shared = time.perf_counter() - t0

        def both_windows(ref_once: bool) -> tuple[np.ndarray, float]:
            t0 = time.perf_counter()
            out = np.empty(len(variants))
            ref_scores: dict[tuple, float] = {}
            for i, v in enumerate(variants):
                ref, alt, offset = windows(v, fasta, args.left, args.right)
                key = (v.contig, v.start, v.end) if ref_once else i
                if key not in ref_scores:
                    ref_scores[key] = full_window_logprobs(lm.model, tokenize(ref.encode()))[offset - 1:].sum()
                out[i] = full_window_logprobs(lm.model, tokenize(alt.encode()))[offset - 1:].sum() - ref_scores[key]
            return out, time.perf_counter() - t0

        full, t_full = both_windows(ref_once=False)
        field_way, t_field = both_windows(ref_once=True)
    # rounding only: the prefill's absorbed attention reassociates the products (under 1e-5 nats a position)
    assert np.array_equal(full, field_way)
    per_position = np.abs(shared - full).max() / (args.right + 1)
    assert per_position < 1e-5, per_position
    n = len(variants)
    print(f"{n} variants at {len(chosen)} sites, window {args.left:,} + variant + {args.right:,}, builtin:tiny-long, "
          f"{torch.get_num_threads()} threads")
    print(f"both full windows of every variant   : {t_full:7.2f} s  {n / t_full:6.2f} variants/s")
    print(f"  ... a site's reference window once : {t_field:7.2f} s  {n / t_field:6.2f} variants/s")
    print(f"shared context (genome-lm variants)  : {t_shared:7.2f} s  {n / t_shared:6.2f} variants/s")
    print(f"ratio: x{t_full / t_shared:.2f} against both full windows, x{t_field / t_shared:.2f} against the reference "
          f"window once per site (largest difference {np.abs(shared - full).max():.1e} nats over "
          f"{args.right + 1:,} positions)")


if __name__ == "__main__":
    main()
