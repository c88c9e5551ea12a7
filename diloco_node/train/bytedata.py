"""The byte-level dataset: a corpus's raw bytes (vocabulary 256), random windows addressable by position.

What the codec benchmarks and the DDP harness train on (no tokenizer to download or keep in sync).
Batches are a pure function of ``(stream_seed, position)`` so a run resumes by storing one integer,
and different stream seeds see different orders of the same corpus. A node reads --data through
tokens.py and shares.py instead, even for bytes.
"""

from __future__ import annotations

import torch

from diloco_node.train.sources import DataError


class ByteDataset:
    """Train/eval split of a byte corpus; the last ``eval_fraction`` is held out for eval."""

    def __init__(self, corpus: bytes, seq_len: int, eval_fraction: float = 0.05) -> None:
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.seq_len = seq_len
        # bytearray: torch.frombuffer refuses read-only buffers; clone detaches from it.
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).clone()
        split = int(len(corpus) * (1.0 - eval_fraction))
        self._train = self.data[:split]
        self._eval = self.data[split:]
        window = seq_len + 1
        if len(self._train) < window or len(self._eval) < window:
            raise DataError(
                f"corpus of {len(corpus)} bytes is too small for seq_len={seq_len} "
                f"with eval_fraction={eval_fraction}"
            )

    @property
    def train_bytes(self) -> int:
        return len(self._train)

    @property
    def eval_bytes(self) -> int:
        return len(self._eval)

    def train_batch(
        self, batch_size: int, stream_seed: int, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``position`` of stream ``stream_seed``: random windows from the train split.

        Seeding a fresh generator per (seed, position) costs a few microseconds and buys
        resumability without saving RNG state: the stream is addressable by position.
        """
        # Mix the two integers so neighbouring seeds/positions do not share generator seeds.
        mixed = (stream_seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (2**63)
        generator = torch.Generator().manual_seed(mixed)
        high = len(self._train) - self.seq_len - 1
        starts = torch.randint(0, high + 1, (batch_size,), generator=generator)
        return self._windows(self._train, starts)

    def eval_batches(
        self, batch_size: int, max_batches: int = 8
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed, non-overlapping windows from the eval split, identical on every node."""
        window = self.seq_len + 1
        n_windows = min(len(self._eval) // window, batch_size * max_batches)
        starts = torch.arange(n_windows) * window
        return [
            self._windows(self._eval, starts[i : i + batch_size])
            for i in range(0, n_windows, batch_size)
        ]

    def _windows(
        self, split: torch.Tensor, starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.arange(self.seq_len + 1)
        windows = split[starts.unsqueeze(1) + offsets].long()
        return windows[:, :-1], windows[:, 1:]
