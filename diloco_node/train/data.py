"""The node's data: --data read once per process on a background thread, shared by its two users.

Reading and tokenizing a local corpus can take minutes, and the node builds its model, starts its
ranks and joins the swarm meanwhile: `open_data` starts the read (`data-read` thread) and hands the
replica a NodeData (batches through the prefetch, the eval batches); `data_identity`, the
fingerprint's data fields (registry.DATA_IDENTITY), waits for the same read. Reading is sources.py's
and tokens.py's, each node's order shares.py's, the background batches prefetch.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from diloco_node import registry
from diloco_node.train.prefetch import Prefetcher
from diloco_node.train.shares import Batch, TokenDataset
from diloco_node.train.tokenizer import load_tokenizer
from diloco_node.train.tokens import Source, digest_of, read_source

logger = logging.getLogger(__name__)


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
    inputs = cfg.inputs
    if inputs.tokenizer:
        fields["tokenizer"] = load_tokenizer(inputs.tokenizer).digest
    if inputs.data:
        fields["eval_data"] = digest_of(_source(inputs.data, inputs.tokenizer, inputs.text_column).eval)
    return fields


registry.DATA_IDENTITY.declare(data_identity)
