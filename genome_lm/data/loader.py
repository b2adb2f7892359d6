"""The training and evaluation data loader: prepared windows -> batches of fixed-length examples.

It never tokenizes: it reads the ``.bin``/``.idx`` files `prepare` wrote (through numpy memory
maps; tests hold the reader equal to megatron-core's ``IndexedDataset``) and turns them into

=============  ================  ===========================================================
field          shape, dtype      meaning
=============  ================  ===========================================================
tokens         [B, L] int64      input ids; <pad> (0) after the end of a short crop
labels         [B, L] int64      the next token; ``IGNORE`` (-100) where there is none (the
                                 last base of a window, padding)
loss_weight    [B, L] float32    0 where the label is N or absent, ``softmask_weight`` where
                                 the label base is soft-masked (lowercase), 1 otherwise
window         [B] int64         the document (window index in the split's manifest)
offset         [B] int64         window offset of ``tokens[:, 0]``
reverse        [B] bool          reverse-complemented: token i is the complement of window
                                 offset ``offset - i`` instead of ``offset + i``
length         [B] int64         real (non-padding) tokens in the row
=============  ================  ===========================================================

``Manifest.locate(split, window, offset + i)`` (``offset - i`` when reversed) gives a token's
chromosome and position; :meth:`Batch.token_offsets` does the arithmetic for a whole batch.

Choices, and why:

* **Crops.** A window of W tokens is cut into ``ceil((W - 1) / L)`` consecutive crops of
  ``L = seq_len`` input tokens; crop c reads tokens ``[c*L, c*L + L + 1)`` (one more, for the
  last label), so every base after the first of a window is a label in exactly one crop per
  epoch. A short last crop is padded with <pad> (weight 0) to L: every batch has the same
  shape, which keeps batching simple and context parallelism's ``L % (2 * cp) == 0`` a property
  of the config rather than of the data. ``seq_len`` above the dataset's window length is an
  error (it would be mostly padding).
* **Reverse complement** happens per crop, after reading: the crop's tokens are reversed and
  complemented (A<->T, C<->G; N and specials stay), its soft-mask bits reversed with it, then
  labels and weights are computed from the augmented sequence exactly as for a forward crop.
* **Order.** Items are the (window, crop) pairs of the windows kept. Epoch e visits them in
  the permutation ``default_rng([seed, e])`` draws, and decides each item's reverse complement
  from ``default_rng([seed, e, 1])``: both depend only on (seed, epoch), so the loader's whole
  state is ``{epoch, position, seed, seq_len}`` plus a fingerprint of the dataset. Items form
  one endless stream; a global batch may span two epochs, and nothing is dropped.
* **Data parallelism.** A call to :meth:`TrainLoader.next_batch` consumes one global micro
  batch of ``micro_batch_size * world_size`` consecutive items; rank r takes items
  ``[r * mbs, (r + 1) * mbs)`` of it. Every rank holds the same state, and a checkpoint
  resumes on any world size.
* **Changing seq_len** (the seq_len warm-up) changes the items; a change mid-epoch starts the
  next epoch from its beginning (the rest of the old epoch is not seen).
* **Windows mostly N** (``n_frac`` in the manifest above ``max_n_fraction``) are skipped and
  counted in ``skipped_windows``; their N bases would be weight-0 labels anyway.
* **Mixing** (``data.mix``): other prepared splits join the stream as a fraction of it. With
  fractions f_s, an epoch holds every item of the main split once (N of them) and
  ``round(f_s / (1 - sum f) * N)`` items of mixed split s, drawn without replacement from its
  items by ``default_rng([seed, epoch, 2, s])`` (with replacement only when it has fewer), all
  in one permutation. ``Batch.source`` says where each row came from (0: the main split, s:
  the s-th mixed one); ``window`` and ``offset`` refer to that source's manifest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from genome_lm.data.indexed import IndexedReader
from genome_lm.data.manifest import Manifest, Window
from genome_lm.data.shards import unpack_softmask
from genome_lm.data.tokenizer import PAD, A, C, G, N, T
from genome_lm.data.windows import MAX_N_FRACTION, too_many_n
from genome_lm.errors import GenomeLMError

IGNORE = -100  # label of positions without a target (torch's default ignore_index)

# Token id -> id of its complement. Specials and N map to themselves.
COMPLEMENT = np.arange(N + 1, dtype=np.uint8)
COMPLEMENT[[A, C, G, T]] = [T, G, C, A]
COMPLEMENT.flags.writeable = False


# --------------------------------------------------------------------------- reading


class SplitReader:
    """The tokens and soft-mask of one split of a prepared dataset, read without megatron-core.

    ``windows[i]`` is document i's manifest entry; :meth:`tokens` and :meth:`softmask` read any
    range of it. Raises :class:`GenomeLMError` naming the path when the folder has no manifest,
    the split does not exist, or its files are missing or disagree with the manifest.
    """

    def __init__(self, dataset: str | Path, split: str):
        self.manifest = Manifest.load(Path(dataset))
        self.split = split
        self.windows: tuple[Window, ...] = self.manifest.split(split).windows
        self._tokens = IndexedReader(self.manifest.path_prefix(split))
        self._soft = IndexedReader(self.manifest.softmask_prefix(split))
        self.lengths = np.array([w.length for w in self.windows], dtype=np.int64)
        expected_sizes = (("tokens", self._tokens, self.lengths), ("soft-mask", self._soft, (self.lengths + 7) // 8))
        for name, data, expected in expected_sizes:
            if len(data) != len(self.windows) or not np.array_equal(data.sizes, expected):
                raise GenomeLMError(f"{data.path}: its {name} items do not match the {len(self.windows)} windows "
                                    f"of split {split!r} in {self.manifest.folder / 'manifest.json'}")

    def __len__(self) -> int:
        return len(self.windows)

    def tokens(self, window: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """``[stop - start]`` uint8 token ids of ``window`` (``stop`` is clipped to its end)."""
        return self._tokens.read(window, start, stop)

    def softmask(self, window: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """``[stop - start]`` bool soft-mask bits of ``window``, unpacked."""
        stop = int(self.lengths[window]) if stop is None else min(stop, int(self.lengths[window]))
        packed = self._soft.read(window, start // 8, (stop + 7) // 8)
        return unpack_softmask(packed, max(stop - start, 0), start % 8)


# --------------------------------------------------------------------------- one example


def reverse_complement(tokens: np.ndarray, soft: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``tokens [L]`` uint8 and ``soft [L]`` bool, reverse-complemented (an involution)."""
    return COMPLEMENT[tokens[::-1]], soft[::-1].copy()


def label_weights(labels: np.ndarray, label_soft: np.ndarray, softmask_weight: float) -> np.ndarray:
    """``[L]`` float32 loss weights of the labels: 0 at N, ``softmask_weight`` at soft-masked bases, else 1."""
    weight = np.where(label_soft, np.float32(softmask_weight), np.float32(1.0)).astype(np.float32)
    weight[labels == N] = 0.0
    return weight


def make_example(span: np.ndarray, soft: np.ndarray, seq_len: int, softmask_weight: float,
                 has_last_label: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One row from the ``span`` of tokens a crop reads (inputs and, after them, the labels).

    ``span [S]`` uint8 and ``soft [S]`` bool; inputs are ``span[:n]`` with ``n = min(S, seq_len)``
    and the labels ``span[1:n + 1]``. ``has_last_label`` is False when ``span`` ends its window
    and holds no token after the last input, whose label is then ``IGNORE``.
    Returns ``(tokens [seq_len] int64, labels [seq_len] int64, weight [seq_len] float32, n)``.
    """
    n = len(span) - 1 if has_last_label else len(span)
    if not 0 < n <= seq_len:
        raise ValueError(f"span of {len(span)} tokens does not make an example of {seq_len}")
    tokens = np.full(seq_len, PAD, dtype=np.int64)
    labels = np.full(seq_len, IGNORE, dtype=np.int64)
    weight = np.zeros(seq_len, dtype=np.float32)
    tokens[:n] = span[:n]
    m = len(span) - 1  # inputs that have a label
    labels[:m] = span[1:]
    weight[:m] = label_weights(span[1:], soft[1:], softmask_weight)
    return tokens, labels, weight, n


@dataclass
class Batch:
    """A batch of examples; see the module docstring for the fields."""

    tokens: torch.Tensor  # [B, L] int64
    labels: torch.Tensor  # [B, L] int64, IGNORE where no target
    loss_weight: torch.Tensor  # [B, L] float32
    window: torch.Tensor  # [B] int64
    offset: torch.Tensor  # [B] int64
    reverse: torch.Tensor  # [B] bool
    length: torch.Tensor  # [B] int64
    source: torch.Tensor | None = None  # [B] int64: 0 the main split, s the s-th mixed one (``data.mix``)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def token_offsets(self) -> torch.Tensor:
        """``[B, L]`` int64: the window offset of each input token, -1 on padding."""
        i = torch.arange(self.tokens.shape[1])
        step = torch.where(self.reverse, -1, 1)[:, None]
        pos = self.offset[:, None] + step * i
        return torch.where(i[None, :] < self.length[:, None], pos, torch.full_like(pos, -1))


# --------------------------------------------------------------------------- items and batches


def _crop_items(lengths: np.ndarray, keep: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(window, start)`` int64 arrays: every crop of every kept window, in window order."""
    n_crops = np.where(keep & (lengths >= 2), (lengths - 2) // seq_len + 1, 0)  # ceil((W - 1) / L)
    window = np.repeat(np.arange(lengths.size, dtype=np.int64), n_crops)
    first = np.repeat(np.cumsum(n_crops) - n_crops, n_crops)
    start = (np.arange(window.size, dtype=np.int64) - first) * seq_len
    return window, start


class _Crops:
    """The (window, crop) items of a split for one ``seq_len``, and how to build their examples."""

    def __init__(self, reader: SplitReader, seq_len: int, softmask_weight: float, max_n_fraction: float):
        if seq_len < 1:
            raise GenomeLMError(f"seq_len must be >= 1, got {seq_len}")
        planned = int(reader.manifest.data["windows"]["window"])
        if seq_len > planned:
            raise GenomeLMError(f"seq_len {seq_len} is longer than the windows ({planned}) of "
                                f"{reader.manifest.folder}; prepare it with --window {seq_len} or more")
        self.reader, self.seq_len, self.softmask_weight = reader, seq_len, softmask_weight
        self.keep = np.array([not too_many_n(w.n_frac, max_n_fraction) for w in reader.windows], dtype=bool)
        self.window, self.start = _crop_items(reader.lengths, self.keep, seq_len)
        if self.window.size == 0:
            raise GenomeLMError(f"{reader.manifest.folder}: split {reader.split!r} has no window to train on "
                                f"({int((~self.keep).sum())} of {len(reader)} skipped for "
                                f"N fraction > {max_n_fraction})")

    def __len__(self) -> int:
        return self.window.size

    def batch(self, items: np.ndarray, reverse: np.ndarray) -> Batch:
        return _batch([self._row(int(i), bool(r)) for i, r in zip(items, reverse)])

    def _row(self, item: int, reverse: bool):
        window, start = int(self.window[item]), int(self.start[item])
        stop = min(start + self.seq_len + 1, int(self.reader.lengths[window]))
        span, soft = self.reader.tokens(window, start, stop), self.reader.softmask(window, start, stop)
        has_last_label = len(span) == self.seq_len + 1
        offset = start
        if reverse:
            span, soft = reverse_complement(span, soft)
            offset = stop - 1
        tokens, labels, weight, n = make_example(span, soft, self.seq_len, self.softmask_weight, has_last_label)
        return tokens, labels, weight, window, offset, reverse, n


def _batch(rows: list, sources: list[int] | None = None) -> Batch:
    tokens, labels, weight, window, offset, flags, length = zip(*rows)
    return Batch(tokens=torch.from_numpy(np.stack(tokens)), labels=torch.from_numpy(np.stack(labels)),
                 loss_weight=torch.from_numpy(np.stack(weight)), window=torch.tensor(window, dtype=torch.int64),
                 offset=torch.tensor(offset, dtype=torch.int64), reverse=torch.tensor(flags, dtype=torch.bool),
                 length=torch.tensor(length, dtype=torch.int64),
                 source=None if sources is None else torch.tensor(sources, dtype=torch.int64))


class TrainLoader:
    """Endless, shuffled, resumable batches of one split for one data-parallel rank.

    ``TrainLoader(dataset, split, seq_len=..., micro_batch_size=1, softmask_weight=0.1,
    reverse_complement=0.0, max_n_fraction=0.5, seed=0, rank=0, world_size=1, shuffle=True,
    mix=())``. :meth:`next_batch` returns this rank's ``micro_batch_size`` rows of the next
    global micro batch; :meth:`state_dict` / :meth:`load_state_dict` save and restore the
    position (a small JSON-able dict); :meth:`set_seq_len` switches the crop length (a new epoch
    unless at the start of one). ``skipped_windows`` counts the main split's windows left out
    for their N fraction. ``mix``: (dataset, split, fraction) of other splits mixed into the
    stream (module docstring, "Mixing").
    """

    def __init__(self, dataset: str | Path, split: str, *, seq_len: int, micro_batch_size: int = 1,
                 softmask_weight: float = 0.1, reverse_complement: float = 0.0, max_n_fraction: float = MAX_N_FRACTION,
                 seed: int = 0, rank: int = 0, world_size: int = 1, shuffle: bool = True,
                 mix: Sequence[tuple[str | Path, str, float]] = ()):
        if micro_batch_size < 1:
            raise GenomeLMError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= rank < world_size:
            raise GenomeLMError(f"rank {rank} outside world_size {world_size}")
        if not 0.0 <= reverse_complement <= 1.0:
            raise GenomeLMError(f"reverse_complement is a probability, got {reverse_complement}")
        if any(not 0 < f < 1 for *_, f in mix) or sum(f for *_, f in mix) >= 1:
            raise GenomeLMError(f"data.mix: each fraction must be in (0, 1) and their sum below 1, got "
                                f"{[f for *_, f in mix]}")
        self.reader = SplitReader(dataset, split)
        self.mixed = [(SplitReader(path, name), float(fraction)) for path, name, fraction in mix]
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.softmask_weight, self.reverse_complement = softmask_weight, reverse_complement
        self.max_n_fraction, self.seed, self.shuffle = max_n_fraction, int(seed), shuffle
        self.epoch, self.position = 0, 0
        self._set_crops(seq_len)

    def _set_crops(self, seq_len: int) -> None:
        self._crops = _Crops(self.reader, seq_len, self.softmask_weight, self.max_n_fraction)
        self._mixed = [_Crops(reader, seq_len, self.softmask_weight, self.max_n_fraction) for reader, _ in self.mixed]
        self._order: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None  # epoch, sources, items, reverse

    @property
    def seq_len(self) -> int:
        return self._crops.seq_len

    @property
    def skipped_windows(self) -> int:
        """Windows left out because their N fraction is above ``max_n_fraction``."""
        return int((~self._crops.keep).sum())

    def _mixed_counts(self) -> list[int]:
        """Items of each mixed split per epoch."""
        rest = 1.0 - sum(f for _, f in self.mixed)
        return [max(1, round(f / rest * len(self._crops))) for _, f in self.mixed]

    @property
    def items_per_epoch(self) -> int:
        return len(self._crops) + sum(self._mixed_counts())

    def set_seq_len(self, seq_len: int) -> None:
        """Crop to ``seq_len`` from now on; mid-epoch, a change moves to the start of the next epoch."""
        if seq_len == self.seq_len:
            return
        self._set_crops(seq_len)
        if self.position:
            self.epoch, self.position = self.epoch + 1, 0

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, item, reverse flag) of every item of ``epoch``, in the order they are served."""
        if self._order is None or self._order[0] != epoch:
            sources, items = [np.zeros(len(self._crops), dtype=np.int64)], [np.arange(len(self._crops))]
            for s, (crops, count) in enumerate(zip(self._mixed, self._mixed_counts()), start=1):
                rng = np.random.default_rng([self.seed, epoch, 2, s])
                sources.append(np.full(count, s, dtype=np.int64))
                items.append(rng.choice(len(crops), count, replace=count > len(crops)))
            source, item = np.concatenate(sources), np.concatenate(items)
            n = source.size
            perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            reverse = np.random.default_rng([self.seed, epoch, 1]).random(n) < self.reverse_complement
            self._order = (epoch, source[perm], item[perm], reverse)
        return self._order[1], self._order[2], self._order[3]

    def _take(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next ``count`` items of the stream (sources, items, reverse flags); advances the state."""
        parts = []
        while count:
            source, item, reverse = self._epoch_order(self.epoch)
            k = min(count, item.size - self.position)
            window = slice(self.position, self.position + k)
            parts.append((source[window], item[window], reverse[window]))
            self.position += k
            count -= k
            if self.position == item.size:
                self.epoch, self.position = self.epoch + 1, 0
        return tuple(np.concatenate(column) for column in zip(*parts))

    def next_batch(self) -> Batch:
        """This rank's slice of the next global micro batch (``micro_batch_size`` rows)."""
        source, items, reverse = self._take(self.micro_batch_size * self.world_size)
        mine = slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)
        if not self.mixed:
            return self._crops.batch(items[mine], reverse[mine])
        crops = [self._crops, *self._mixed]
        rows = [crops[s]._row(int(i), bool(r)) for s, i, r in zip(source[mine], items[mine], reverse[mine])]
        return _batch(rows, [int(s) for s in source[mine]])

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def _fingerprint(self) -> dict:
        out = {"dataset": self.reader.manifest.request_key, "split": self.reader.split,
               "max_n_fraction": self.max_n_fraction, "shuffle": self.shuffle}
        if self.mixed:  # absent without mixing: states saved before mixing existed still load
            out["mix"] = [[reader.manifest.request_key, reader.split, fraction] for reader, fraction in self.mixed]
        return out

    def state_dict(self) -> dict:
        """``{epoch, position, seed, seq_len}`` and what must match on resume; JSON-serialisable."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "items_per_epoch": self.items_per_epoch, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next batches are those the saving loader would have given."""
        for key, mine in self._fingerprint().items():
            if state.get(key) != mine:
                raise GenomeLMError(f"data-loader state is for {key}={state.get(key)!r}, this loader has {mine!r}; "
                                    "resume with the dataset and data settings of the checkpoint")
        if "mix" in state and not self.mixed:
            raise GenomeLMError(f"data-loader state mixes in {state['mix']!r}, this loader mixes nothing; resume "
                                "with the data settings of the checkpoint")
        self.seed = int(state["seed"])
        self._set_crops(int(state["seq_len"]))
        if self.items_per_epoch != state["items_per_epoch"]:
            raise GenomeLMError(f"data-loader state counts {state['items_per_epoch']} items per epoch, "
                                f"the dataset now gives {self.items_per_epoch}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def eval_batches(dataset: str | Path, split: str, *, seq_len: int, batch_size: int, softmask_weight: float = 0.0,
                 max_n_fraction: float = MAX_N_FRACTION, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
    """One pass over a split in (window, crop) order, no augmentation: global batches of
    ``batch_size * world_size`` items, this rank's ``batch_size`` of each (the last ones may be
    short; a rank whose slice is empty gets no batch for it). ``softmask_weight`` defaults to 0,
    as GPN evaluates; pass 1.0 to score repeats like any base."""
    crops = _Crops(SplitReader(dataset, split), seq_len, softmask_weight, max_n_fraction)
    step = batch_size * world_size
    for first in range(0, len(crops), step):
        mine = np.arange(first + rank * batch_size, min(first + (rank + 1) * batch_size, len(crops)))
        if mine.size:
            yield crops.batch(mine, np.zeros(mine.size, dtype=bool))
