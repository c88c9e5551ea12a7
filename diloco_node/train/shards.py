"""Pre-tokenized token shards: the files llm.c and nanoGPT write, memory-mapped.

Two layouts are read:
- llm.c: a header of 256 little-endian int32 (magic, version, token count, the rest zero) followed by
  the tokens: magic 20240520 version 1 holds uint16 tokens (GPT-2), magic 20240801 version 7 holds
  uint32 tokens (Llama 3). The header's count must match the file's size exactly, so a truncated
  shard is refused.
- nanoGPT: no header, the tokens as raw uint16 (`train.bin`, `val.bin`). Nothing in such a file can
  tell a truncated one from a whole one; an odd byte count is refused.
`diloco-node tokenize` writes llm.c's layout (uint16 when the vocabulary fits, else uint32), in
shards of at most SHARD_TOKENS tokens; the held-out split goes to files named `*_val_*.bin`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from diloco_node.errors import NodeError

SUFFIX = ".bin"
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# llm.c's dev/data/data_common.py: magic -> (version, token dtype)
LAYOUTS: dict[int, tuple[int, np.dtype[Any]]] = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}
SHARD_TOKENS = 100_000_000  # llm.c's shard size: 200 MB of uint16


class ShardError(NodeError, ValueError):
    """A shard that cannot be read as tokens; one line naming the file."""


def is_eval_shard(path: Path) -> bool:
    """nanoGPT's val.bin and llm.c's *_val_*.bin hold the held-out split."""
    stem = path.stem.lower()
    return stem == "val" or stem.startswith("val_") or "_val" in stem


def open_shard(path: Path) -> np.ndarray:
    """The shard's tokens, memory-mapped (read-only); ShardError when the file is not a whole shard."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(HEADER_BYTES)
    except OSError as exc:
        raise ShardError(f"shard '{path}' cannot be read: {exc.strerror}") from None
    if size == 0:
        raise ShardError(f"shard '{path}' is empty")
    magic = int(np.frombuffer(head[:4], "<i4")[0]) if len(head) >= 4 else None
    if magic in LAYOUTS:
        if len(head) < HEADER_BYTES:
            raise ShardError(f"shard '{path}' is truncated: {size} bytes, less than its {HEADER_BYTES}-byte header")
        header = np.frombuffer(head, "<i4")
        version, dtype = LAYOUTS[magic]
        if int(header[1]) != version:
            raise ShardError(f"shard '{path}' has llm.c magic {magic} with version {int(header[1])} "
                             f"(expected {version})")
        count = int(header[2])
        expected = HEADER_BYTES + count * dtype.itemsize
        if count <= 0 or size != expected:
            raise ShardError(f"shard '{path}' is truncated or corrupt: its header says {count} tokens "
                             f"({expected} bytes), the file has {size} bytes")
        return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
    if size % 2:
        raise ShardError(f"shard '{path}' is corrupt: no llm.c header, and {size} bytes is not a whole number "
                         "of uint16 tokens (nanoGPT's layout)")
    return np.memmap(path, dtype=np.dtype("<u2"), mode="r")


def check_ids(path: Path, tokens: np.ndarray, vocab_size: int) -> None:
    """ShardError when a token id is beyond the vocabulary (a shard made by another tokenizer, or garbage).

    Reads the whole shard once, in 16M-token chunks (about 0.1 s per 100M uint16 tokens)."""
    step = 1 << 24
    for start in range(0, len(tokens), step):
        top = int(tokens[start:start + step].max())
        if top >= vocab_size:
            raise ShardError(f"shard '{path}' holds token id {top}, beyond the tokenizer's vocabulary of "
                             f"{vocab_size} (pass the --tokenizer that wrote it)")


def dtype_for(vocab_size: int) -> np.dtype[Any]:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def write_shard(path: Path, tokens: np.ndarray, vocab_size: int) -> None:
    """One llm.c-layout shard, written to a temporary name and renamed (a crash leaves no half shard)."""
    dtype = dtype_for(vocab_size)
    magic = next(m for m, (_, d) in LAYOUTS.items() if d == dtype)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, LAYOUTS[magic][0], len(tokens)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as file:
        file.write(header.tobytes())
        file.write(np.asarray(tokens, dtype=dtype).tobytes())
    tmp.replace(path)


class ShardWriter:
    """Cuts a stream of token arrays into shards `<prefix>_<split>_<NNNNNN>.bin` under `out`."""

    def __init__(self, out: Path, prefix: str, split: str, vocab_size: int, shard_tokens: int = SHARD_TOKENS):
        self.out, self.prefix, self.split, self.vocab_size = out, prefix, split, vocab_size
        self.shard_tokens = shard_tokens
        self.dtype = dtype_for(vocab_size)
        self._parts: list[np.ndarray] = []
        self._held = 0
        self.paths: list[Path] = []
        self.tokens = 0

    def add(self, pieces: Iterable[np.ndarray]) -> None:
        for piece in pieces:
            self._parts.append(piece.astype(self.dtype, copy=False))
            self._held += len(piece)
            while self._held >= self.shard_tokens:
                whole = np.concatenate(self._parts)
                self._emit(whole[:self.shard_tokens])
                rest = whole[self.shard_tokens:]
                self._parts, self._held = ([rest] if len(rest) else []), len(rest)

    def close(self) -> list[Path]:
        if self._held:
            self._emit(np.concatenate(self._parts))
            self._parts, self._held = [], 0
        return self.paths

    def _emit(self, tokens: np.ndarray) -> None:
        path = self.out / f"{self.prefix}_{self.split}_{len(self.paths):06d}{SUFFIX}"
        write_shard(path, tokens, self.vocab_size)
        self.paths.append(path)
        self.tokens += len(tokens)
