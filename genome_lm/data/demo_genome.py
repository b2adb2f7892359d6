"""A seeded synthetic "demo genome" with known long-range structure, generated from code.

The CPU demo trains and evaluates on this genome, so it ships as code rather than as a data
file. ``generate_demo_genome(seed, scale)`` is deterministic: the same (seed, scale) gives
byte-identical records on any machine (numpy's PCG64 integer and uniform draws, plus scalar
exp/log for log-uniform sizes), and a different seed gives a different genome. numpy does
not promise identical ``Generator`` streams across its own versions, so pin numpy if the
bytes must never change.

Records, in this order, with lengths multiplied by ``scale`` (rounded):
``chr1`` 4,000,000 bp, ``chr2`` 3,000,000 bp, ``chr22`` 2,000,000 bp. Letters are
``ACGTN``; lowercase marks soft-masked repeats (N is always uppercase).

Each chromosome is built in this order, each step overwriting what came before (nothing
is written after step 5):

1. Isochores: segments of 100-300 kbp, each with a GC fraction drawn uniformly from
   0.35-0.55; bases are independent within a segment.
2. Interspersed repeats (lowercase), laid out without overlapping each other, each copy in
   either orientation (1/2 each) and mutated from its family consensus at a per-copy rate
   of 0.5-1.5x the family divergence. Families share their consensus across chromosomes:

   ====== ============ ==== ========== ====================== =============
   family consensus    GC   divergence copies                 genome share
   ====== ============ ==== ========== ====================== =============
   Alu    300 bp       0.55 8%         full, 3' end cut 0-30  12%
   L1     6,000 bp     0.40 12%        5'-truncated, 300-6000 20%
   MIR    260 bp       0.45 28%        any 100-260 bp piece   5%
   ====== ============ ==== ========== ====================== =============

   plus microsatellites (lowercase): a random 1-6 bp unit repeated to 20-200 bp, 0-2%
   substituted, 3% of the genome. About 40% of the bases are lowercase in all.
3. CpG depletion: each CG dinucleotide is mutated with probability 0.8, half to TG and
   half to CA (methyl-cytosine deamination on either strand), so observed/expected CpG
   is about 0.25.
4. N gaps: 2-5 internal gaps per chromosome, each 1-50 kbp (log-uniform, at most 2% of
   the chromosome, at least one base apart), plus a leading N run of 10% of chr22 (hg38's
   chr22 starts with ~10 Mbp of N).
5. Planted copies, the long-range signal (``CopyPlan``'s defaults; other plans change the
   count, lengths, distances and inversion share): 50 events per Mbp (at least 3 per chromosome;
   200/150/100 at scale 1). Each copies a source segment of 300-3000 bp (log-uniform,
   at most the distance) to a later destination, ``distance = dst_start - src_start``
   log-uniform from 1 kbp to min(500 kbp, half the chromosome after its leading N). Half
   are forward duplications, half inversions (reverse complement, soft-mask reversed).
   Each copy then gets floor(rate x length) substitutions at distinct positions, with rate
   drawn uniformly from 0-1% (``divergence`` records the fraction applied). Copies use the
   final sequence, so a destination equals its source apart from those substitutions.
   Sources, destinations and N gaps never overlap each other, and nothing is written after
   this step, so a model that uses long context should have lower loss on destinations.

``write_demo_genome`` writes the FASTA (60 bases a line) and a ``.planted.json`` sidecar
listing every planted copy (0-based, half-open coordinates).
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from genome_lm.errors import GenomeLMError

CHROM_LENGTHS = {"chr1": 4_000_000, "chr2": 3_000_000, "chr22": 2_000_000}
LEADING_N_FRACTION = {"chr22": 0.10}
SCHEMA = "genome-lm.demo-planted/1"
MIN_CHROM_BP = 10_000
ISOCHORE_BP, ISOCHORE_GC = (100_000, 300_000), (0.35, 0.55)
CPG_LOSS = 0.8
STR_FRACTION, STR_UNIT_BP, STR_BP, STR_DIVERGENCE = 0.03, (1, 6), (20, 200), 0.02
GAP_COUNT, GAP_BP, GAP_MAX_FRACTION = (2, 5), (1_000, 50_000), 0.02
EVENTS_PER_MBP, MIN_EVENTS = 50, 3
COPY_BP, DISTANCE_BP, MAX_COPY_DIVERGENCE = (300, 3_000), (1_000, 500_000), 0.01



@dataclass(frozen=True)
class CopyPlan:
    """How the planted copies (step 5) are drawn. The defaults are the demo genome's; a
    long-context recipe asks for more copies at distances inside its training crop.

    ``per_mbp`` events per Mbp (at least ``MIN_EVENTS`` per chromosome); copy lengths
    log-uniform in ``length_bp`` (at most the distance); distances log-uniform in
    ``distance_bp`` (the upper end capped at half the chromosome after its leading N);
    ``inversions``: the fraction that are reverse complements."""

    per_mbp: float = EVENTS_PER_MBP
    length_bp: tuple[int, int] = COPY_BP
    distance_bp: tuple[int, int] = DISTANCE_BP
    inversions: float = 0.5

    def __post_init__(self) -> None:
        (lo, hi), (dlo, dhi) = self.length_bp, self.distance_bp
        if not (math.isfinite(self.per_mbp) and self.per_mbp >= 0):
            raise GenomeLMError(f"demo genome: copies per Mbp must be >= 0, got {self.per_mbp}")
        if not 1 <= lo <= hi:
            raise GenomeLMError(f"demo genome: copy lengths must be 1 <= low <= high, got {lo}-{hi}")
        if not 1 <= dlo <= dhi:
            raise GenomeLMError(f"demo genome: copy distances must be 1 <= low <= high, got {dlo}-{dhi}")
        if not 0 <= self.inversions <= 1:
            raise GenomeLMError(f"demo genome: the inversion fraction must be in [0, 1], got {self.inversions}")

    def describe(self) -> str:
        """One sentence for the sidecar's ``description``."""
        kinds = ("Forward duplications and inversions (reverse complement)" if 0 < self.inversions < 1 else
                 "Inversions (reverse complement)" if self.inversions == 1 else "Forward duplications")
        return (f"{kinds} of {self.length_bp[0]}-{self.length_bp[1]} bp segments, {self.per_mbp:g} per Mbp, "
                f"distance dst_start - src_start log-uniform {self.distance_bp[0]:,} to {self.distance_bp[1]:,} bp, "
                f"0-1% substitutions; sources, destinations and N gaps do not overlap. "
                f"Coordinates are 0-based, half-open.")


N_CODE = 4  # base codes: A=0 C=1 G=2 T=3, so the complement of x is 3 - x
_LETTERS = np.frombuffer(b"ACGTNacgtn", dtype=np.uint8)  # index: code + 5 * soft-masked


@dataclass(frozen=True)
class _Family:
    name: str
    length: int  # consensus length, bp
    gc: float
    divergence: float  # mean per-copy substitution rate
    fraction: float  # share of the chromosome covered by copies
    fragment: Literal["full", "5prime", "any"]
    min_bp: int  # shortest copy, bp (bounds how many copies can be needed)


FAMILIES = (
    _Family("Alu", 300, 0.55, 0.08, 0.12, "full", 270),
    _Family("L1", 6_000, 0.40, 0.12, 0.20, "5prime", 300),
    _Family("MIR", 260, 0.45, 0.28, 0.05, "any", 100),
)


@dataclass(frozen=True)
class PlantedCopy:
    """One planted copy; coordinates are 0-based, half-open, in bases on ``chrom``.

    ``dst`` holds a copy of ``src`` (``kind == "inversion"``: its reverse complement) with
    ``divergence`` = substituted bases / copy length actually applied (0 to 0.01).
    """

    chrom: str
    kind: Literal["duplication", "inversion"]
    src_start: int
    src_end: int
    dst_start: int
    dst_end: int
    distance: int  # dst_start - src_start, bp (always > 0)
    divergence: float

    def to_json(self) -> dict:
        """A JSON-ready dict; ``PlantedCopy(**d)`` rebuilds the copy."""
        return asdict(self)


@dataclass
class DemoGenome:
    """``records``: name -> ASCII sequence (``ACGTN``, lowercase = soft-masked), in order
    chr1, chr2, chr22; ``planted``: every planted copy, per chromosome by ``src_start``."""

    records: dict[str, bytes]
    planted: list[PlantedCopy]
    seed: int
    scale: float


def _loguniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    # Scalar libm exp/log (not numpy's SIMD loops) so the integer result matches across CPUs.
    return int(lo * math.exp(rng.random() * math.log(hi / lo)))


def _random_bases(rng: np.random.Generator, gc: np.ndarray | float, n: int) -> np.ndarray:
    """(n,) uint8 base codes, each G or C with probability ``gc``, else A or T."""
    strong, coin = rng.random(n) < gc, rng.random(n) < 0.5
    return np.where(strong, 1 + coin, 3 * coin).astype(np.uint8)


def _background(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n,) base codes made of isochores with different GC content."""
    lengths = [int(rng.integers(ISOCHORE_BP[0], ISOCHORE_BP[1] + 1))]
    while sum(lengths) < n:
        lengths.append(int(rng.integers(ISOCHORE_BP[0], ISOCHORE_BP[1] + 1)))
    gc = ISOCHORE_GC[0] + (ISOCHORE_GC[1] - ISOCHORE_GC[0]) * rng.random(len(lengths))
    return _random_bases(rng, np.repeat(gc, lengths)[:n], n)


def _concat_index(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items of ``lengths`` laid end to end: each position's item and offset in it."""
    item = np.repeat(np.arange(len(lengths)), lengths)
    return item, np.arange(len(item)) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _substitute(rng: np.random.Generator, bases: np.ndarray, rate: np.ndarray) -> None:
    """Replace each of ``bases`` (codes, in place) with probability ``rate`` by another."""
    hit = rng.random(len(bases)) < rate
    bases[hit] = (bases[hit] + rng.integers(1, 4, int(hit.sum()))) % 4


def _fragments(rng: np.random.Generator, fam: _Family, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(start in consensus, length) of ``k`` copies of ``fam``."""
    if fam.fragment == "full":
        lengths = fam.length - rng.integers(0, fam.length - fam.min_bp + 1, k)
        return np.zeros(k, dtype=np.int64), lengths
    if fam.fragment == "5prime":  # retrotransposition often stops early: keep the 3' end
        lengths = (fam.min_bp + (fam.length - fam.min_bp) * rng.random(k) ** 3).astype(np.int64)
        return fam.length - lengths, lengths
    lengths = rng.integers(fam.min_bp, fam.length + 1, k)
    return (rng.random(k) * (fam.length - lengths + 1)).astype(np.int64), lengths


def _microsatellites(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tandem repeats covering STR_FRACTION of ``n`` bp: (sequences end to end, lengths, rates)."""
    lengths = rng.integers(STR_BP[0], STR_BP[1] + 1, int(STR_FRACTION * n / STR_BP[0]) + 1)
    lengths = lengths[np.cumsum(lengths) <= STR_FRACTION * n]
    units = rng.integers(0, 4, (len(lengths), STR_UNIT_BP[1]))
    unit_bp = rng.integers(STR_UNIT_BP[0], STR_UNIT_BP[1] + 1, len(lengths))
    item, at = _concat_index(lengths)
    sequences = units[item, at % unit_bp[item]].astype(np.uint8)
    return sequences, lengths, STR_DIVERGENCE * rng.random(len(lengths))


def _repeat_items(rng: np.random.Generator, n: int, consensus: list[np.ndarray]):
    """All repeat copies for a chromosome of ``n`` bp, in random order.

    Returns ``library`` (every consensus, then every microsatellite, end to end) and, per
    copy, its start in ``library``, length, reverse-strand flag and substitution rate.
    """
    library, src, lengths, rates = [], [], [], []
    for fam, seq in zip(FAMILIES, consensus):
        # Enough candidates to cover the family's share even if all are the shortest.
        start, length = _fragments(rng, fam, int(fam.fraction * n / fam.min_bp) + 1)
        keep = np.cumsum(length) <= fam.fraction * n
        src.append(start[keep] + sum(len(x) for x in library))
        lengths.append(length[keep])
        rates.append(fam.divergence * (0.5 + rng.random(int(keep.sum()))))
        library.append(seq)
    str_seq, str_lengths, str_rates = _microsatellites(rng, n)
    src.append(sum(len(x) for x in library) + np.cumsum(str_lengths) - str_lengths)
    lengths.append(str_lengths)
    rates.append(str_rates)
    library.append(str_seq)
    order = rng.permutation(sum(len(x) for x in lengths))
    src, lengths, rates = (np.concatenate(x)[order] for x in (src, lengths, rates))
    return np.concatenate(library), src, lengths, rng.random(len(order)) < 0.5, rates


def _paint_repeats(rng, codes, mask, library, src, lengths, reverse, rates) -> None:
    """Overwrite ``codes`` (and set ``mask``) with the copies from :func:`_repeat_items`."""
    # Random non-overlapping layout: sorted offsets into the free bases, then each copy
    # shifted right by the lengths of the copies before it.
    free = len(codes) - int(lengths.sum())
    starts = np.sort(rng.integers(0, free + 1, len(lengths))) + np.cumsum(lengths) - lengths
    item, at = _concat_index(lengths)
    rev = reverse[item]
    bases = library[np.where(rev, src[item] + lengths[item] - 1 - at, src[item] + at)]
    bases = np.where(rev, 3 - bases, bases).astype(np.uint8)
    _substitute(rng, bases, rates[item])
    codes[starts[item] + at] = bases
    mask[starts[item] + at] = True


def _deplete_cpg(rng: np.random.Generator, codes: np.ndarray) -> None:
    # Neither CG->TG nor CG->CA can create a new CG, so one pass is enough.
    at = np.flatnonzero((codes[:-1] == 1) & (codes[1:] == 2))
    hit, on_c = rng.random(len(at)) < CPG_LOSS, rng.random(len(at)) < 0.5
    codes[at[hit & on_c]] = 3
    codes[at[hit & ~on_c] + 1] = 0


def _plan_gaps(rng: np.random.Generator, chrom: str, occupied: np.ndarray) -> list[tuple[int, int]]:
    """N gap intervals; marks them in ``occupied`` (one free base kept between gaps)."""
    n = len(occupied)
    lead = round(LEADING_N_FRACTION.get(chrom, 0.0) * n)
    gaps = [(0, lead)] if lead else []
    occupied[:lead] = True
    for _ in range(int(rng.integers(GAP_COUNT[0], GAP_COUNT[1] + 1))):
        length = min(_loguniform(rng, *GAP_BP), int(GAP_MAX_FRACTION * n))
        for _attempt in range(100):
            start = int(rng.integers(lead, n - length + 1))
            if not occupied[max(start - 1, 0) : start + length + 1].any():
                occupied[start : start + length] = True
                gaps.append((start, start + length))
                break
    return sorted(gaps)


def n_events(length: int, per_mbp: float = EVENTS_PER_MBP) -> int:
    """How many planted copies a chromosome of ``length`` bp is given."""
    return max(MIN_EVENTS, round(per_mbp * length / 1e6))


def plan_copies(rng: np.random.Generator, chrom: str, occupied: np.ndarray, count: int,
                plan: CopyPlan = CopyPlan()) -> list[PlantedCopy]:
    """Choose up to ``count`` non-overlapping copy events on a chromosome.

    ``occupied``: (chromosome length,) bool, True where nothing may be planted (N gaps); the
    chosen sources and destinations are marked in it. ``divergence`` of the result is the
    target substitution rate; :func:`_plant` replaces it with the rate applied.
    """
    n = len(occupied)
    lo = int(np.argmin(occupied)) if occupied[0] else 0  # first base after a leading N run
    max_distance = min(plan.distance_bp[1], (n - lo) // 2)
    if max_distance < plan.distance_bp[0]:
        return []
    planned = []
    for _attempt in range(50 * count):
        if len(planned) == count:
            break
        distance = _loguniform(rng, plan.distance_bp[0], max_distance)
        length = min(_loguniform(rng, *plan.length_bp), distance)  # source ends before the copy
        src = int(rng.integers(lo, n - distance - length + 1))
        dst = src + distance
        if occupied[src : src + length].any() or occupied[dst : dst + length].any():
            continue
        occupied[src : src + length] = occupied[dst : dst + length] = True
        kind = "inversion" if rng.random() < plan.inversions else "duplication"
        rate = MAX_COPY_DIVERGENCE * rng.random()
        planned.append(PlantedCopy(chrom, kind, src, src + length, dst, dst + length, distance, rate))
    return sorted(planned, key=lambda c: c.src_start)


def _plant(rng: np.random.Generator, codes: np.ndarray, mask: np.ndarray, copy: PlantedCopy) -> PlantedCopy:
    """Write ``copy`` into ``codes``/``mask``; the copy with its applied divergence."""
    bases, masked = codes[copy.src_start : copy.src_end].copy(), mask[copy.src_start : copy.src_end]
    if copy.kind == "inversion":
        bases, masked = 3 - bases[::-1], masked[::-1]
    # An exact count at distinct positions (not a Bernoulli draw per base), so that short
    # copies stay within the stated maximum divergence.
    hit = rng.permutation(len(bases))[: int(copy.divergence * len(bases))]
    bases[hit] = (bases[hit] + rng.integers(1, 4, len(hit))) % 4
    codes[copy.dst_start : copy.dst_end], mask[copy.dst_start : copy.dst_end] = bases, masked
    return replace(copy, divergence=len(hit) / len(bases))


def _chromosome(
    rng: np.random.Generator, chrom: str, n: int, consensus: list[np.ndarray], plan: CopyPlan
) -> tuple[bytes, list[PlantedCopy]]:
    """One chromosome of ``n`` bp: its ASCII sequence and its planted copies."""
    codes = _background(rng, n)
    mask = np.zeros(n, dtype=bool)
    _paint_repeats(rng, codes, mask, *_repeat_items(rng, n, consensus))
    _deplete_cpg(rng, codes)
    occupied = np.zeros(n, dtype=bool)
    for start, end in _plan_gaps(rng, chrom, occupied):
        codes[start:end], mask[start:end] = N_CODE, False
    # Last step, on the final sequence: nothing may overwrite a source or destination.
    planted = [_plant(rng, codes, mask, c) for c in plan_copies(rng, chrom, occupied, n_events(n, plan.per_mbp), plan)]
    return _LETTERS[codes + 5 * mask].tobytes(), planted


DRILL_RECORD = "drill"
DRILL_GAP_BP, DRILL_COPY_BP = (16, 256), (32, 512)
DRILL_UNIT_BP, DRILL_ARRAY_BP, DRILL_TANDEM = (16, 128), (256, 2048), 0.3


def copy_drill(rng: np.random.Generator, n: int, distance_bp: tuple[int, int] = (64, 16_384)) -> np.ndarray:
    """(n,) base codes of the *copy drill*: uniform random bases where most of the sequence
    repeats something before it, the dense signal a small model needs to start copying (the
    tiny model learns to copy from the demo genome's planted copies, a few percent of its bases,
    not at all, and from arrays of a repeated unit within a few hundred steps).

    From the start: a random gap of 16-256 bases, then an event, again until ``n``. An event
    is, with probability 0.3, a tandem array (a random unit of 16-128 bases repeated over
    256-2048 bases, like a minisatellite), else a dispersed copy (32-512 bases copied from
    ``distance_bp`` bases back, at most as far back as the sequence goes). Sizes are
    log-uniform; each repeat of a unit and each copy gets 0-1% substitutions. About half the
    bases are in arrays and a quarter in dispersed copies."""
    codes = np.empty(n, dtype=np.uint8)
    pos = 0
    while pos < n:
        gap = _loguniform(rng, *DRILL_GAP_BP)
        codes[pos:pos + gap] = rng.integers(0, 4, len(codes[pos:pos + gap]))
        pos += gap
        if pos >= n:
            break
        if rng.random() < DRILL_TANDEM or pos <= distance_bp[0]:
            unit = rng.integers(0, 4, _loguniform(rng, *DRILL_UNIT_BP)).astype(np.uint8)
            copies = [unit.copy() for _ in range(-(-_loguniform(rng, *DRILL_ARRAY_BP) // len(unit)))]
        else:
            distance = _loguniform(rng, distance_bp[0], min(distance_bp[1], pos))
            length = min(_loguniform(rng, *DRILL_COPY_BP), distance)
            copies = [codes[pos - distance:pos - distance + length].copy()]
        for piece in copies:
            hit = rng.permutation(len(piece))[: int(MAX_COPY_DIVERGENCE * rng.random() * len(piece))]
            piece[hit] = (piece[hit] + rng.integers(1, 4, len(hit))) % 4
            end = min(pos + len(piece), n)
            codes[pos:end] = piece[: end - pos]
            pos = end
    return codes


def chrom_lengths(scale: float = 1.0) -> dict[str, int]:
    """Record name -> length in bp at ``scale``; raises GenomeLMError for a bad scale."""
    if not (math.isfinite(scale) and scale > 0):
        raise GenomeLMError(f"demo genome: scale must be a positive number, got {scale}")
    lengths = {name: round(bp * scale) for name, bp in CHROM_LENGTHS.items()}
    if min(lengths.values()) < MIN_CHROM_BP:
        lowest = MIN_CHROM_BP / min(CHROM_LENGTHS.values())
        raise GenomeLMError(f"demo genome: scale {scale} is too small; use at least {lowest}")
    return lengths


def generate_demo_genome(seed: int = 0, scale: float = 1.0, copies: CopyPlan = CopyPlan(),
                         drill_bp: int = 0) -> DemoGenome:
    """The demo genome for ``seed`` (>= 0) with chromosome lengths multiplied by ``scale`` and
    its planted copies drawn by ``copies``; ``drill_bp`` > 0 adds a last record ``drill`` of
    that length (``copy_drill``, copies up to ``copies.distance_bp[1]`` back; its copies are
    not listed among the planted ones)."""
    if drill_bp < 0:
        raise GenomeLMError(f"demo genome: the drill length must be >= 0, got {drill_bp}")
    if seed < 0:
        raise GenomeLMError(f"demo genome: seed must be >= 0, got {seed}")
    lengths = chrom_lengths(scale)
    # Independent streams: repeat consensus (genome-wide), then one per chromosome.
    family_rng = np.random.default_rng([seed, 0])
    consensus = [_random_bases(family_rng, fam.gc, fam.length) for fam in FAMILIES]
    records, planted = {}, []
    for index, (chrom, n) in enumerate(lengths.items(), start=1):
        records[chrom], events = _chromosome(np.random.default_rng([seed, index]), chrom, n, consensus, copies)
        planted.extend(events)
    if drill_bp:
        drill = copy_drill(np.random.default_rng([seed, len(lengths) + 1]), drill_bp,
                           (DRILL_COPY_BP[0] * 2, max(DRILL_COPY_BP[0] * 2, copies.distance_bp[1])))
        records[DRILL_RECORD] = _LETTERS[drill].tobytes()
    return DemoGenome(records=records, planted=planted, seed=seed, scale=scale)


def write_drill(path: Path, drill_bp: int, seed: int = 0, distance_bp: tuple[int, int] = (64, 16_384)) -> Path:
    """A FASTA of one record, ``drill``: ``drill_bp`` bases of the copy drill (``copy_drill``,
    dispersed copies up to ``distance_bp[1]`` back), to mix into another genome's training
    (``data.mix``). Written whole or not at all."""
    if drill_bp < 1:
        raise GenomeLMError(f"copy drill: the length must be >= 1, got {drill_bp}")
    drill = copy_drill(np.random.default_rng([seed, 99]), drill_bp, distance_bp)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{path}.fai").unlink(missing_ok=True)
    _atomic_write(path, _fasta({DRILL_RECORD: _LETTERS[drill].tobytes()}))
    return path


def planted_json_path(fasta: Path) -> Path:
    """Where :func:`write_demo_genome` puts the sidecar: ``demo.fa`` -> ``demo.planted.json``."""
    return Path(fasta).with_suffix(".planted.json")


def _atomic_write(path: Path, data: bytes) -> None:
    # A temp file in the same folder, then os.replace: readers see the old file or the new
    # one, never a partial one, even if the process is killed mid-write.
    # (Not tempfile.mkstemp: its files are mode 0600; "xb" honours the umask like any file.)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fasta(records: dict[str, bytes], width: int = 60) -> bytes:
    parts = []
    for name, seq in records.items():
        parts.append(b">" + name.encode() + b"\n")
        parts.extend(seq[i : i + width] + b"\n" for i in range(0, len(seq), width))
    return b"".join(parts)


def write_demo_genome(path: Path, seed: int = 0, scale: float = 1.0, copies: CopyPlan = CopyPlan(),
                      drill_bp: int = 0) -> Path:
    """Write the demo genome as FASTA at ``path`` and its planted copies next to it."""
    path = Path(path)
    genome = generate_demo_genome(seed, scale, copies, drill_bp)
    sidecar = {
        "schema": SCHEMA,
        "seed": seed,
        "scale": scale,
        "records": {name: len(seq) for name, seq in genome.records.items()},
        "planted": [copy.to_json() for copy in genome.planted],
        "copies": asdict(copies),
        "description": copies.describe(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A .fai left from an earlier genome at this path would describe the wrong records.
        Path(f"{path}.fai").unlink(missing_ok=True)
        _atomic_write(path, _fasta(genome.records))
        _atomic_write(planted_json_path(path), (json.dumps(sidecar, indent=1) + "\n").encode())
    except OSError as exc:
        raise GenomeLMError(f"{path}: cannot write the demo genome: {exc.strerror or exc}") from exc
    return path
