"""The prefetch: the next batches made on a background thread, and the meter of the waits for them.

The training thread should never wait for data: reading memory-mapped pages or a hub stream and
tokenizing happen on the `data-prefetch` thread, into a bounded queue. `DataMeter` counts the times
the training thread found it empty (a round's `data_wait_seconds`; benchmarks/data_wait.py).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from diloco_node.errors import NodeError
from diloco_node.train.shares import Batch
from diloco_node.train.sources import DataError, data_error

logger = logging.getLogger(__name__)

PREFETCH_DEPTH = 8  # batches the prefetch thread keeps ready
LOG_EVERY = 1000  # batches between the prefetch's summary log lines
WAIT_LOG_INTERVAL = 60.0  # seconds between log lines about waits (the first is logged at once)


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
                item = exc if isinstance(exc, NodeError) else data_error("prefetch", exc)
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
