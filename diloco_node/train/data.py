"""Byte-level corpus loading and deterministic batching.

Tokens are raw bytes (vocab 256): no tokenizer to download or keep in sync between nodes. Batches
are a pure function of ``(stream_seed, position)`` so a node resumes from a checkpoint by storing
one integer, and nodes with different stream seeds see different orders of the same corpus.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from pathlib import Path

import torch

from diloco_node.errors import NodeError

logger = logging.getLogger(__name__)

# Below this a 128-byte window sampler repeats itself almost immediately and the eval split is a
# handful of windows; a corpus this small is almost certainly the wrong path.
MIN_CORPUS_BYTES = 4096
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "__pycache__"})


class DataError(NodeError, ValueError):
    """A corpus that cannot be used; the message is one line, fit for the CLI to print."""


def embedded_corpus(max_bytes: int = 4_000_000) -> bytes:
    """The running Python's stdlib ``.py`` sources, in sorted path order, up to ``max_bytes``.

    Always available offline. Test suites and site-packages are skipped because they differ
    between installs; what remains is the same for every node on the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place steers os.walk; sorting makes the walk order deterministic.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                data = (Path(dirpath) / name).read_bytes()
            except OSError:
                continue
            parts.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(parts)[:max_bytes]
    return b"".join(parts)[:max_bytes]


def _read_jsonl(path: Path) -> bytes:
    texts: list[bytes] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(f"data file '{path}' line {lineno}: not valid JSON ({exc})") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"data file '{path}' line {lineno}: no string field 'text'")
            texts.append(text.encode("utf-8"))
    return b"\n".join(texts)


def _read_directory(path: Path) -> bytes:
    parts: list[bytes] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(dirnames)
        for name in sorted(filenames):
            file = Path(dirpath) / name
            if not file.is_file():
                continue
            data = file.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                logger.debug("skipping non-UTF-8 file path=%s", file)
                continue
            parts.append(data)
    return b"\n".join(parts)


def load_corpus(path: str | None) -> bytes:
    """Load the training corpus; ``None`` means the embedded stdlib corpus."""
    if path is None:
        corpus = embedded_corpus()
        source = "embedded stdlib corpus"
    else:
        p = Path(path)
        if not p.exists():
            raise DataError(f"data path '{path}' does not exist")
        try:
            if p.is_dir():
                corpus = _read_directory(p)
            elif p.suffix == ".jsonl":
                corpus = _read_jsonl(p)
            else:
                corpus = p.read_bytes()
        except OSError as exc:
            raise DataError(f"data path '{path}' cannot be read: {exc.strerror}") from exc
        source = f"data path '{path}'"
    if not corpus:
        raise DataError(f"{source} is empty")
    if len(corpus) < MIN_CORPUS_BYTES:
        raise DataError(
            f"{source} is too small: {len(corpus)} bytes (need at least {MIN_CORPUS_BYTES})"
        )
    logger.info("loaded corpus source=%r bytes=%d", source, len(corpus))
    return corpus


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
