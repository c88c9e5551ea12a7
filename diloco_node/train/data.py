"""Byte-level corpus loading and deterministic batching.

Tokens are raw bytes (vocab 256): no tokenizer to download or keep in sync between nodes. Batches
are a pure function of ``(stream_seed, position)`` so a node resumes from a checkpoint by storing
one integer, and nodes with different stream seeds see different orders of the same corpus.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import logging
import os
import queue
import sysconfig
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco_node import registry
from diloco_node.errors import NodeError
from diloco_node.train import shards
from diloco_node.train.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# Below this a 128-byte window sampler repeats itself almost immediately and the eval split is a
# handful of windows; a corpus this small is almost certainly the wrong path.
MIN_CORPUS_BYTES = 4096
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "__pycache__"})


class DataError(NodeError, ValueError):
    """A corpus that cannot be used; the message is one line, fit for the CLI to print."""


def data_stream_seed(peer_id: str, seed: int) -> int:
    """A fresh node's data order (`train_batch`'s stream), derived from its identity: nodes of one run
    share --seed but never a stream. The learning simulator (harness/simulator.py) draws its workers'
    streams the same way."""
    return zlib.crc32(peer_id.encode()) ^ seed


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


# --- token data: any source, any tokenizer (issue 27) ----------------------------------------------
#
# A source is read into documents (text) and tokenized, each document followed by the tokenizer's
# end-of-text id, or it is already tokens (shards). The held-out eval split is the same on every node:
# the last EVAL_FRACTION of the tokens (nanoGPT's and llm.c's `val` shards when a shard directory has
# them; the first documents of a hub stream). The train split is cut into windows of seq_len + 1 tokens
# that overlap by one (every token is an input exactly once per epoch).
#
# Each node reads its own share (docs/architecture.md §12): the windows of an epoch form a ring, in an
# order that is the same on every node (a permutation seeded by the epoch alone), and a node reads the
# ring onwards from its own place on it, which its stream seed (a hash of its peer id) fixes. Two nodes
# read disjoint windows until one has read through the arc up to the other's place; no node needs to
# know how many others there are, and a node that joins or leaves moves nobody else's share. Batch
# `position` is a pure function of (stream_seed, position), so a resumed node goes on with the next
# window of its share: no token repeated or skipped.

EVAL_FRACTION = 0.05
RING_SEED = 0x5EED_D17A  # the rings' seed: a constant, so every node of every run orders the windows alike
DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
HUB_PREFIX = "hf:"
STREAM_EVAL_TOKENS = 1 << 18  # a hub stream's eval split: its first documents, up to this many tokens
STREAM_SHUFFLE_BUFFER = 10_000  # documents in a stream's shuffle buffer (datasets' IterableDataset.shuffle)
HUB_TIMEOUT = 5.0  # seconds to reach the hub before saying it cannot be reached
TOKENIZE_CHUNK = 512  # documents per tokenizer call (tokenizers parallelises within one call)
PREFETCH_DEPTH = 8  # batches the prefetch thread keeps ready
LOG_EVERY = 1000  # batches between the prefetch's summary log lines
WAIT_LOG_INTERVAL = 60.0  # seconds between log lines about waits (the first is logged at once)

Batch = tuple[torch.Tensor, torch.Tensor]


def _data_error(spec: str, exc: BaseException) -> DataError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return DataError(f"data '{spec}' cannot be read: {first}")


def _quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _column_texts(dataset: Any, column: str, spec: str) -> Iterator[str]:
    """The text column's values, in order; DataError when the column is missing or not text."""
    names = list(dataset.column_names or [])
    if column not in names:
        raise DataError(f"data '{spec}' has no text column '{column}' (columns: {', '.join(names) or 'none'}; "
                        "choose one with --text-column)")
    for batch in dataset.select_columns([column]).iter(batch_size=TOKENIZE_CHUNK):
        for value in batch[column]:
            if value is None:
                continue
            if not isinstance(value, str):
                raise DataError(f"data '{spec}' column '{column}' holds {type(value).__name__}, not text")
            yield value


def _local_dataset(fmt: str, files: list[Path], spec: str) -> Any:
    datasets = _quiet_datasets()
    try:
        return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as exc:  # pyarrow and datasets raise many types for a file they cannot parse
        raise _data_error(spec, exc) from None


def _files(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(Path(dirpath) / name for name in sorted(filenames) if not name.startswith("."))
    return found


def _text_documents(files: list[Path]) -> Iterator[str]:
    for file in files:
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise DataError(f"data file '{file}' cannot be read: {exc.strerror}") from None
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError:
            logger.debug("skipping non-UTF-8 file path=%s", file)


def parse_hub(spec: str) -> tuple[str, str | None, str]:
    """hf:NAME[:CONFIG][:SPLIT] → (name, config, split); split defaults to train."""
    parts = spec[len(HUB_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3 or any(not p for p in parts[1:]):
        raise DataError(f"data '{spec}' is not hf:NAME[:CONFIG][:SPLIT]")
    return parts[0], parts[1] if len(parts) > 1 else None, parts[2] if len(parts) > 2 else "train"


def _check_hub(spec: str) -> None:
    """DataError at once when the hub cannot be reached (datasets itself retries for about 25 s)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    fix = "download it where the hub is reachable and pass local files (parquet, jsonl, arrow or shards) to --data"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise DataError(f"data '{spec}' is a hub dataset and the hub is switched off (HF_HUB_OFFLINE): {fix}")
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # the hub is reached through the proxy: datasets itself finds out
    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_TIMEOUT).close()
    except OSError as exc:
        raise DataError(f"data '{spec}': the hub ({url.hostname}) cannot be reached ({exc.strerror or exc}): "
                        f"{fix}") from None


def hub_loader(spec: str) -> Callable[[], Any]:
    """A function that opens the hub dataset `spec` as a stream (datasets' IterableDataset)."""
    name, config, split = parse_hub(spec)
    _check_hub(spec)
    datasets = _quiet_datasets()

    def load() -> Any:
        try:
            return datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as exc:
            raise _data_error(spec, exc) from None
    load()  # fails here, at start-up, when the name, config or split is wrong
    return load


def _pack(tokenizer: Tokenizer, texts: Iterable[str]) -> Iterator[np.ndarray]:
    """Each document's ids followed by the end-of-text id, as arrays, tokenized TOKENIZE_CHUNK at a time."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    if isinstance(tokenizer, ByteTokenizer):
        for document in texts:
            yield np.frombuffer(document.encode("utf-8") + bytes([tokenizer.eot_id]), dtype=np.uint8).astype(dtype)
        return
    chunk: list[str] = []
    text: str | None
    for text in itertools.chain(texts, [None]):
        if text is not None:
            chunk.append(text)
        if chunk and (text is None or len(chunk) >= TOKENIZE_CHUNK):
            for ids in tokenizer.encode_batch(chunk):
                yield np.array([*ids, tokenizer.eot_id], dtype=dtype)
            chunk = []


@dataclass(frozen=True)
class Source:
    """What --data names, read: tokens already split (local sources) or a stream (a hub dataset)."""

    train: list[np.ndarray]
    eval: list[np.ndarray]
    stream: Callable[[], Any] | None = None  # a hub dataset: opens the stream (its first `skip` docs are eval)
    skip: int = 0


def documents(spec: str | None, text_column: str = "text") -> Iterator[str]:
    """The documents of a local text source (what `tokenizer train` reads); DataError when unusable."""
    if spec is None:
        yield embedded_corpus().decode("utf-8", errors="replace")
        return
    if spec.startswith(HUB_PREFIX):
        stream = hub_loader(spec)()
        yield from _column_texts(stream, text_column, spec)
        return
    path = Path(spec)
    if not path.exists():
        raise DataError(f"data path '{spec}' does not exist")
    files = _files(path) if path.is_dir() else [path]
    if any(f.suffix == shards.SUFFIX for f in files):
        raise DataError(f"data '{spec}' holds token shards, not text")
    formats = {DATASET_FORMATS[f.suffix] for f in files if f.suffix in DATASET_FORMATS}
    if len(formats) > 1:
        raise DataError(f"data directory '{spec}' mixes {', '.join(sorted(formats))} files: keep one format")
    if formats:
        fmt = formats.pop()
        dataset = _local_dataset(fmt, [f for f in files if DATASET_FORMATS.get(f.suffix) == fmt], spec)
        yield from _column_texts(dataset, text_column, spec)
    else:
        yield from _text_documents(files)


def _split_tail(arrays: list[np.ndarray], fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The last `fraction` of the tokens of `arrays` (in order) held out."""
    total = sum(len(a) for a in arrays)
    keep = int(total * (1.0 - fraction))
    train: list[np.ndarray] = []
    held: list[np.ndarray] = []
    seen = 0
    for array in arrays:
        if seen + len(array) <= keep:
            train.append(array)
        elif seen >= keep:
            held.append(array)
        else:
            train.append(array[:keep - seen])
            held.append(array[keep - seen:])
        seen += len(array)
    return train, held


Tally = Callable[[int], None]  # told each tokenized document's token count (tokenize's progress)


def _tallied(pieces: Iterable[np.ndarray], tally: Tally | None) -> Iterator[np.ndarray]:
    """`pieces` as they come, each one's length told to `tally`: `tokenize` of a large dataset
    is minutes of tokenizing, which its progress line reports (telemetry/progress.py)."""
    for piece in pieces:
        if tally is not None:
            tally(len(piece))
        yield piece


def read_source(spec: str | None, tokenizer: Tokenizer, text_column: str = "text",
                tally: Tally | None = None) -> Source:
    """Read and split --data; DataError (one line) when it cannot be used. `tally`: told of every
    document tokenized (see _tallied)."""
    if spec is not None and spec.startswith(HUB_PREFIX):
        load = hub_loader(spec)
        held: list[np.ndarray] = []
        count = docs = 0
        for tokens in _tallied(_pack(tokenizer, _column_texts(load(), text_column, spec)), tally):
            held.append(tokens)
            count, docs = count + len(tokens), docs + 1
            if count >= STREAM_EVAL_TOKENS:
                break
        return Source([], [np.concatenate(held)] if held else [], stream=load, skip=docs)
    if spec is None and isinstance(tokenizer, ByteTokenizer):  # the default: the byte stream as it always was
        return Source(*_split_tail([np.frombuffer(load_corpus(None), dtype=np.uint8)], EVAL_FRACTION))
    if spec is None:
        return Source(*_split_tail(list(_tallied(_pack(tokenizer, documents(None)), tally)), EVAL_FRACTION))
    path = Path(spec)
    if not path.exists():
        raise DataError(f"data path '{spec}' does not exist")
    files = _files(path) if path.is_dir() else [path]
    bins = [f for f in files if f.suffix == shards.SUFFIX]
    if bins:
        opened = [(f, shards.open_shard(f)) for f in bins]
        for file, tokens in opened:
            shards.check_ids(file, tokens, tokenizer.vocab_size)
        train = [t for f, t in opened if not shards.is_eval_shard(f)]
        held = [t for f, t in opened if shards.is_eval_shard(f)]
        if held and train:
            return Source(train, held)
        return Source(*_split_tail(train or held, EVAL_FRACTION))
    packed = list(_tallied(_pack(tokenizer, documents(spec, text_column)), tally))
    if not packed:
        raise DataError(f"data '{spec}' is empty")
    return Source(*_split_tail([np.concatenate(packed)], EVAL_FRACTION))


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


def digest_of(arrays: list[np.ndarray]) -> str:
    """16 hex digits over the tokens (as uint32, whatever their stored width)."""
    hasher = hashlib.sha256()
    for array in arrays:
        for start in range(0, len(array), 1 << 22):
            hasher.update(np.asarray(array[start:start + (1 << 22)], dtype="<u4").tobytes())
    return hasher.hexdigest()[:16]


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
            for tokens in _pack(self.tokenizer, _column_texts(stream, self.text_column, self.name)):
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


@dataclass
class DataMeter:
    """How often the training thread found no batch ready: the data's share of the inner loop's time.

    `waits`/`wait_seconds` count steady-state gets that found the queue empty; the first batch after a
    (re)start of the prefetch (start-up, a resume, a jump in position) is counted in `cold_*`."""

    batches: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    cold_starts: int = 0
    cold_seconds: float = 0.0

    def waited(self) -> float:
        """Seconds the training thread has waited for batches, cold starts included (a round's figure
        is the difference of two readings: /api/status' data_wait_seconds)."""
        return self.wait_seconds + self.cold_seconds

    def reset(self) -> None:
        self.batches = self.waits = self.cold_starts = 0
        self.wait_seconds = self.cold_seconds = 0.0

    def line(self) -> str:
        return (f"data batches={self.batches} waits={self.waits} wait_s={self.wait_seconds:.4f} "
                f"cold_starts={self.cold_starts} cold_s={self.cold_seconds:.3f}")


METER = DataMeter()  # this process's data waits (each local rank is a process of its own)


@atexit.register
def _report_waits() -> None:
    """The process's figure, once, at its end: how often and how long the inner loop waited for data."""
    if METER.batches:
        logger.info("%s", METER.line())


class Prefetcher:
    """Makes the next batches on a background thread while the training thread trains.

    `get(batch_size, stream_seed, position)` returns batch `position`; asking for the batch after the
    last one takes it from the queue, anything else restarts the thread at `position`. The producer
    thread only reads (memory-mapped pages, a hub stream) and tokenizes; it never touches the model."""

    def __init__(self, batches: Callable[[int, int, int], Iterator[Batch]], meter: DataMeter = METER,
                 depth: int = PREFETCH_DEPTH):
        self._batches, self.meter, self._depth = batches, meter, depth
        self._next: tuple[int, int, int] | None = None
        self._queue: queue.Queue[Batch | BaseException] | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._wait_logged = -WAIT_LOG_INTERVAL

    def get(self, batch_size: int, stream_seed: int, position: int) -> Batch:
        cold = self._next != (batch_size, stream_seed, position)
        if cold:
            self._restart(batch_size, stream_seed, position)
        assert self._queue is not None
        started = time.perf_counter()
        empty = self._queue.empty()
        item = self._queue.get()
        waited = time.perf_counter() - started
        meter = self.meter
        meter.batches += 1
        if cold:
            meter.cold_starts += 1
            meter.cold_seconds += waited
        elif empty:
            meter.waits += 1
            meter.wait_seconds += waited
            if time.monotonic() - self._wait_logged >= WAIT_LOG_INTERVAL:
                self._wait_logged = time.monotonic()
                logger.info("the inner loop waited %.4fs for data at position %d (%s)", waited, position,
                            meter.line())
        if meter.batches % LOG_EVERY == 0:
            logger.info("%s", meter.line())
        if isinstance(item, BaseException):
            self._next = None
            raise item
        self._next = (batch_size, stream_seed, position + 1)
        return item

    def start(self, batch_size: int, stream_seed: int, position: int) -> None:
        """Begin making batches from `position` (unless already making them), before the first `get`."""
        if self._next != (batch_size, stream_seed, position):
            self._restart(batch_size, stream_seed, position)
            self._next = (batch_size, stream_seed, position)
            self.meter.cold_starts += 1  # a start, counted as one; the first get is then a steady one

    def _restart(self, batch_size: int, stream_seed: int, position: int) -> None:
        self.close()
        logger.info("data prefetch starts at position=%d stream_seed=%d batch_size=%d", position, stream_seed,
                    batch_size)
        self._queue = queue.Queue(self._depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="data-prefetch", daemon=True,
                                        args=(self._batches(batch_size, stream_seed, position), self._queue,
                                              self._stop))
        self._thread.start()

    @staticmethod
    def _produce(batches: Iterator[Batch], out: queue.Queue[Batch | BaseException], stop: threading.Event) -> None:
        item: Batch | BaseException
        while not stop.is_set():
            try:
                item = next(batches)
            except StopIteration:
                item = DataError("the data ran out")
            except BaseException as exc:  # handed to the training thread, which raises it
                item = exc if isinstance(exc, NodeError) else _data_error("prefetch", exc)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def close(self) -> None:
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)
        self._thread = self._stop = self._queue = None
        self._next = None


class NodeData:
    """What a replica reads: `train_batch` through the prefetch, `eval_batches`, and the data's identity.

    `dataset` may still be being read and tokenized on a background thread (open_data): whoever needs
    it first waits for it there (the eval batches at the replica's start, the prefetch's thread), and a
    DataError of the read is raised to each of them."""

    def __init__(self, dataset: TokenDataset | Future[TokenDataset]):
        self._dataset = dataset
        self.prefetch = Prefetcher(self._batches)

    @property
    def dataset(self) -> TokenDataset:
        return self._dataset.result() if isinstance(self._dataset, Future) else self._dataset

    def _batches(self, batch_size: int, stream_seed: int, position: int) -> Iterator[Batch]:
        # a generator: the wait for the read, if any, happens in the prefetch's thread
        yield from self.dataset.batches(batch_size, stream_seed, position)

    def prepare(self, batch_size: int, stream_seed: int, position: int) -> None:
        """Start making batches from `position` now, so that the inner loop's first step finds its
        batch ready (a node calls this once it knows where its data position is: docs/architecture.md §12)."""
        self.prefetch.start(batch_size, stream_seed, position)

    def train_batch(self, batch_size: int, stream_seed: int, position: int) -> Batch:
        return self.prefetch.get(batch_size, stream_seed, position)

    def eval_batches(self, batch_size: int, max_batches: int = 8) -> list[Batch]:
        return self.dataset.eval_batches(batch_size, max_batches)


class _Reads:
    """Each source read once per process, on a background thread of its own (`data-read`): reading and
    tokenizing a local corpus can take minutes, and the node builds its model, starts its ranks and
    joins the swarm meanwhile. `start` begins a read; calling the object waits for it (and raises its
    DataError). The fingerprint (data_identity) and the replica share one read."""

    LIMIT = 4  # sources kept (a process reads one; tests read a few)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: dict[tuple[str | None, str | None, str], Future[Source]] = {}

    def start(self, spec: str | None, tokenizer_spec: str | None, text_column: str) -> Future[Source]:
        key = (spec, tokenizer_spec, text_column)
        with self._lock:
            if key in self._reads:
                return self._reads[key]
            future: Future[Source] = Future()
            self._reads[key] = future
            while len(self._reads) > self.LIMIT:
                del self._reads[next(iter(self._reads))]
        threading.Thread(target=self._read, args=(future, key), name="data-read", daemon=True).start()
        return future

    @staticmethod
    def _read(future: Future[Source], key: tuple[str | None, str | None, str]) -> None:
        spec, tokenizer_spec, text_column = key
        started = time.perf_counter()
        try:
            future.set_result(read_source(spec, load_tokenizer(tokenizer_spec), text_column))
        except BaseException as exc:  # handed to whoever waits: a DataError is the user's one line
            future.set_exception(exc)
            return
        logger.info("data read and tokenized in %.1fs (background thread)", time.perf_counter() - started)

    def __call__(self, spec: str | None, tokenizer_spec: str | None, text_column: str) -> Source:
        return self.start(spec, tokenizer_spec, text_column).result()

    def cache_clear(self) -> None:
        with self._lock:
            self._reads.clear()


_source = _Reads()


def open_data(spec: str | None, tokenizer_spec: str | None, seq_len: int, text_column: str = "text") -> NodeData:
    """The node's data, read and tokenized from now on in the background (once per process: the
    fingerprint and the replica share it). The tokenizer is loaded here: a bad one fails at once."""
    tokenizer = load_tokenizer(tokenizer_spec)
    name = f"data '{spec}'" if spec else "the embedded corpus"
    built: Future[TokenDataset] = Future()

    def build(read: Future[Source]) -> None:  # on the reading thread, once the read is done
        try:
            built.set_result(TokenDataset(read.result(), seq_len, tokenizer, name, text_column))
        except BaseException as exc:
            built.set_exception(exc)

    _source.start(spec, tokenizer_spec, text_column).add_done_callback(build)
    return NodeData(built)


def data_identity(cfg: Any) -> dict[str, str]:
    """The fingerprint's data fields (registry.DATA_IDENTITY): the tokenizer's digest when --tokenizer is
    given, the eval split's digest when --data is (the default corpus is Python's own stdlib, which
    differs between Python versions: fingerprinting it would split runs by Python version)."""
    fields: dict[str, str] = {}
    if cfg.tokenizer:
        fields["tokenizer"] = load_tokenizer(cfg.tokenizer).digest
    if cfg.data:
        fields["eval_data"] = digest_of(_source(cfg.data, cfg.tokenizer, cfg.text_column).eval)
    return fields


registry.DATA_IDENTITY.declare(data_identity)


# --- the offline preparation commands: `tokenizer train` and `tokenize` -----------------------------


def train_tokenizer_from(spec: str | None, vocab_size: int, out: Path, text_column: str = "text") -> Tokenizer:
    """`diloco-node tokenizer train`: a byte-level BPE tokenizer trained on --data's documents."""
    from diloco_node.train.tokenizer import train_tokenizer

    if spec is not None and spec.startswith(HUB_PREFIX):
        raise DataError(f"data '{spec}': train a tokenizer on local files (a hub stream has no end to train on)")
    return train_tokenizer(documents(spec, text_column), vocab_size, out)


def write_shards(spec: str | None, tokenizer_spec: str | None, out: Path, text_column: str = "text",
                 max_tokens: int = 0, shard_tokens: int = shards.SHARD_TOKENS,
                 tally: Tally | None = None) -> tuple[list[Path], int, int]:
    """`diloco-node tokenize`: --data as llm.c-layout shards under `out`, the held-out split in `*_val_*`
    files (what the node holds out from the source itself). Returns the shards and the train and eval
    token counts. `max_tokens` (0: all) bounds the train tokens, for a hub stream that would not end;
    `tally` is told of every document tokenized (its token count), for tokenize's progress."""
    tokenizer = load_tokenizer(tokenizer_spec)
    source = read_source(spec, tokenizer, text_column, tally)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"output directory '{out}' cannot be made: {exc.strerror}") from None
    prefix = ("data" if spec is None else parse_hub(spec)[0].rsplit("/", 1)[-1] if spec.startswith(HUB_PREFIX)
              else Path(spec).stem or "data")
    evals = shards.ShardWriter(out, prefix, "val", tokenizer.vocab_size, shard_tokens)
    evals.add(source.eval)
    train = shards.ShardWriter(out, prefix, "train", tokenizer.vocab_size, shard_tokens)
    if source.stream is not None:
        stream = source.stream().skip(source.skip)
        pieces: Iterable[np.ndarray] = _tallied(_pack(tokenizer, _column_texts(stream, text_column, str(spec))),
                                                tally)
    else:
        pieces = source.train
    taken = 0
    for piece in pieces:
        if max_tokens and taken + len(piece) >= max_tokens:
            train.add([piece[:max_tokens - taken]])
            break
        train.add([piece])
        taken += len(piece)
    paths = evals.close() + train.close()
    return paths, train.tokens, evals.tokens
