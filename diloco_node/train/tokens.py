"""--data as tokens: documents tokenized and packed, and the held-out eval split cut off (a Source).

A source is read into documents (text) and tokenized, each document followed by the tokenizer's
end-of-text id, or it is already tokens (shards). The held-out eval split is the same on every node:
the last EVAL_FRACTION of the tokens (nanoGPT's and llm.c's `val` shards when a shard directory has
them; the first documents of a hub stream), and `digest_of` is its hash (the fingerprint's
`eval_data`). How each node then orders the train split is shares.py's.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from diloco_node.train import shards
from diloco_node.train.sources import (
    HUB_PREFIX,
    TOKENIZE_CHUNK,
    DataError,
    column_texts,
    documents,
    files_under,
    hub_loader,
    load_corpus,
)
from diloco_node.train.tokenizer import ByteTokenizer, Tokenizer

EVAL_FRACTION = 0.05
STREAM_EVAL_TOKENS = 1 << 18  # a hub stream's eval split: its first documents, up to this many tokens


def pack(tokenizer: Tokenizer, texts: Iterable[str]) -> Iterator[np.ndarray]:
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


class Tally(Protocol):
    """What tokenize's progress is told (telemetry/progress.py's Meter is one): how many documents
    the source holds, where it knows (`expect`), and each document tokenized with its token count."""

    def expect(self, total: float) -> None: ...
    def add(self, amount: float, count: int = 1) -> None: ...


Piece = TypeVar("Piece", bound=Sized)


def tallied(pieces: Iterable[Piece], tally: Tally | None) -> Iterator[Piece]:
    """`pieces` (one per document: its tokens, or its text) as they come, each told to `tally` with
    its length: `tokenize` and `tokenizer train` of a large dataset are minutes, which their
    progress reports."""
    for piece in pieces:
        if tally is not None:
            tally.add(1, len(piece))
        yield piece


def read_source(spec: str | None, tokenizer: Tokenizer, text_column: str = "text",
                tally: Tally | None = None) -> Source:
    """Read and split --data; DataError (one line) when it cannot be used. `tally`: told of every
    document tokenized (see tallied)."""
    if spec is not None and spec.startswith(HUB_PREFIX):
        load = hub_loader(spec)
        held: list[np.ndarray] = []
        count = docs = 0
        for tokens in tallied(pack(tokenizer, column_texts(load(), text_column, spec)), tally):
            held.append(tokens)
            count, docs = count + len(tokens), docs + 1
            if count >= STREAM_EVAL_TOKENS:
                break
        return Source([], [np.concatenate(held)] if held else [], stream=load, skip=docs)
    if spec is None and isinstance(tokenizer, ByteTokenizer):  # the default: the byte stream as it always was
        return Source(*_split_tail([np.frombuffer(load_corpus(None), dtype=np.uint8)], EVAL_FRACTION))
    if spec is None:
        return Source(*_split_tail(list(tallied(pack(tokenizer, documents(None)), tally)), EVAL_FRACTION))
    path = Path(spec)
    if not path.exists():
        raise DataError(f"data path '{spec}' does not exist")
    files = files_under(path) if path.is_dir() else [path]
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
    packed = list(tallied(pack(tokenizer, documents(spec, text_column, tally.expect if tally else None)), tally))
    if not packed:
        raise DataError(f"data '{spec}' is empty")
    return Source(*_split_tail([np.concatenate(packed)], EVAL_FRACTION))


def digest_of(arrays: list[np.ndarray]) -> str:
    """16 hex digits over the tokens (as uint32, whatever their stored width)."""
    hasher = hashlib.sha256()
    for array in arrays:
        for start in range(0, len(array), 1 << 22):
            hasher.update(np.asarray(array[start:start + (1 << 22)], dtype="<u4").tobytes())
    return hasher.hexdigest()[:16]
