"""Each node's share of the train windows, in its own order: batch `position` as a pure function.

Each node reads its own share (docs/architecture.md §12): the windows of an epoch form a ring, in an
order that is the same on every node (a permutation seeded by the epoch alone), and a node reads the
ring onwards from its own place on it, which its stream seed (a hash of its peer id) fixes. Two nodes
read disjoint windows until one has read through the arc up to the other's place; no node needs to
know how many others there are, and a node that joins or leaves moves nobody else's share. Batch
`position` is a pure function of (stream_seed, position), so a resumed node goes on with the next
window of its share: no token repeated or skipped. The train split is cut into windows of
seq_len + 1 tokens that overlap by one (every token is an input exactly once per epoch); the eval
windows are the same on every node. A hub stream has no ring (it cannot seek): it is shuffled by the
node's stream seed and cut into windows as its documents arrive.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np
import torch

from diloco_node.train.sources import DataError, column_texts
from diloco_node.train.tokenizer import Tokenizer
from diloco_node.train.tokens import Source, digest_of, pack

RING_SEED = 0x5EED_D17A  # the rings' seed: a constant, so every node of every run orders the windows alike
STREAM_SHUFFLE_BUFFER = 10_000  # documents in a stream's shuffle buffer (datasets' IterableDataset.shuffle)

Batch = tuple[torch.Tensor, torch.Tensor]


def data_stream_seed(peer_id: str, seed: int) -> int:
    """A fresh node's data order (`train_batch`'s stream), derived from its identity: nodes of one run
    share --seed but never a stream. The learning simulator (harness/simulator.py) draws its workers'
    streams the same way."""
    return zlib.crc32(peer_id.encode()) ^ seed


def _windows(arrays: list[np.ndarray], seq_len: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The arrays long enough for one window, and the cumulative count of windows through each."""
    usable = [a for a in arrays if len(a) > seq_len]
    return usable, np.cumsum([(len(a) - 1) // seq_len for a in usable], dtype=np.int64)


def _gather(arrays: list[np.ndarray], ends: np.ndarray, seq_len: int, indices: np.ndarray) -> torch.Tensor:
    """Windows `indices` (counted across `arrays`) as a (len(indices), seq_len + 1) int64 tensor."""
    which = np.searchsorted(ends, indices, side="right")
    starts = (indices - np.where(which > 0, ends[np.maximum(which - 1, 0)], 0)) * seq_len
    rows = [np.asarray(arrays[a][s:s + seq_len + 1], dtype=np.int64) for a, s in zip(which, starts, strict=True)]
    return torch.from_numpy(np.stack(rows))


def _mix(*values: int) -> int:
    mixed = 0
    for value in values:
        mixed = (mixed * 0x9E3779B97F4A7C15 + value * 0xBF58476D1CE4E5B9 + 1) % (2**63)
    return mixed


class TokenDataset:
    """Batches of a node's data: train windows in the node's order, eval windows the same everywhere.

    `batches(batch_size, stream_seed, position)` yields batch `position` and the ones after it; the
    node reads them through a Prefetcher, off the training thread."""

    def __init__(self, source: Source, seq_len: int, tokenizer: Tokenizer, name: str, text_column: str = "text"):
        self.seq_len, self.tokenizer, self.name, self.source = seq_len, tokenizer, name, source
        self.text_column = text_column  # a stream's documents are read from it
        self._train, self._train_ends = _windows(source.train, seq_len)
        self._eval, self._eval_ends = _windows(source.eval, seq_len)
        self.train_windows = int(self._train_ends[-1]) if len(self._train_ends) else 0
        self.eval_windows = int(self._eval_ends[-1]) if len(self._eval_ends) else 0
        if self.eval_windows == 0 or (source.stream is None and self.train_windows == 0):
            tokens = sum(len(a) for a in source.train + source.eval)
            raise DataError(f"{name} is too small: {tokens} tokens leave no window of seq_len {seq_len} + 1 "
                            f"in its {'eval' if self.train_windows else 'train'} split")
        self._perm: tuple[int, np.ndarray] | None = None  # the last epoch's ring

    @property
    def eval_digest(self) -> str:
        return digest_of(self.source.eval)

    def eval_batches(self, batch_size: int, max_batches: int = 8) -> list[Batch]:
        """The first windows of the eval split, in order: identical on every node."""
        count = min(self.eval_windows, batch_size * max_batches)
        windows = _gather(self._eval, self._eval_ends, self.seq_len, np.arange(count, dtype=np.int64))
        return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]

    def share_start(self, stream_seed: int) -> int:
        """The node's place on the ring of train windows: where its share begins, every epoch."""
        return _mix(stream_seed) % self.train_windows

    def window_indices(self, stream_seed: int, start: int, count: int) -> np.ndarray:
        """Train windows number start .. start + count − 1 of the node's order (epoch after epoch):
        the epoch's ring read onwards from the node's place on it."""
        n = self.train_windows
        positions = np.arange(start, start + count, dtype=np.int64)
        places = (positions % n + self.share_start(stream_seed)) % n
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(positions // n):
            mask = positions // n == epoch
            out[mask] = self._ring(int(epoch))[places[mask]]
        return out

    def _ring(self, epoch: int) -> np.ndarray:
        """The epoch's order of the train windows, the same on every node (seeded by the epoch alone)."""
        ring = self._perm  # read once: the prefetch thread and the training thread may both ask
        if ring is None or ring[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(_mix(RING_SEED, epoch)))
            ring = self._perm = (epoch, rng.permutation(self.train_windows))
        return ring[1]

    def batch(self, batch_size: int, stream_seed: int, position: int) -> Batch:
        indices = self.window_indices(stream_seed, position * batch_size, batch_size)
        windows = _gather(self._train, self._train_ends, self.seq_len, indices)
        return windows[:, :-1], windows[:, 1:]

    def batches(self, batch_size: int, stream_seed: int, position: int) -> Iterator[Batch]:
        if self.source.stream is not None:
            yield from self._stream_batches(batch_size, stream_seed, position)
            return
        while True:
            yield self.batch(batch_size, stream_seed, position)
            position += 1

    def _stream_batches(self, batch_size: int, stream_seed: int, position: int) -> Iterator[Batch]:
        """A hub stream, after its eval documents, shuffled by the node's seed; windows cut as they come.
        Batch `position` is the stream's window position·batch_size on: a resume reads and drops the ones
        before it (a stream cannot seek)."""
        assert self.source.stream is not None
        width, skip = self.seq_len + 1, position * batch_size
        rows: list[np.ndarray] = []
        epoch = 0
        while True:
            stream = self.source.stream().skip(self.source.skip).shuffle(
                seed=_mix(stream_seed) % 2**32, buffer_size=STREAM_SHUFFLE_BUFFER)
            stream.set_epoch(epoch)
            carry = np.zeros(0, dtype=np.int64)
            cut = 0
            for tokens in pack(self.tokenizer, column_texts(stream, self.text_column, self.name)):
                carry = np.concatenate([carry, tokens.astype(np.int64)])
                while len(carry) >= width:
                    window, carry = carry[:width], carry[self.seq_len:]
                    cut += 1
                    if skip:
                        skip -= 1
                        continue
                    rows.append(window)
                    if len(rows) == batch_size:
                        stacked = torch.from_numpy(np.stack(rows))
                        rows = []
                        yield stacked[:, :-1], stacked[:, 1:]
            if cut == 0:
                raise DataError(f"{self.name} has no training documents beyond its eval split")
            epoch += 1
