"""Bytes on the wire, from the kernel's interface counters: the one wire sampler of the tests and the
benchmarks (the node's own figures come from diloco_node/telemetry/wire.py, which is a different
thing: per-socket TCP counters of its libp2p daemon, shown on the dashboard).

Every counter read here is `/sys/class/net/<interface>/statistics/{tx,rx}_bytes`: everything the
interface carried, IP/TCP headers, handshakes, ACKs and unrelated traffic included.

- `counters(interface)`: an interface of this machine (loopback, the host's end of a container's
  veth); `counters(interface, namespace)`: one inside a network namespace (an island's eth0).
- `loopback_bytes()`: what the machine sent over `lo` (None where unavailable), `per_node` halves it.
- `wire_bytes(islands)`: what the islands put on their links, `WireSampler` samples any such figure
  with its time on a thread; `windows` turns (time, bytes) samples into the rates of 1-second windows.
"""

from __future__ import annotations

import bisect
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from harness.islands import Island

COMMAND_TIMEOUT = 20.0


class Counters(NamedTuple):
    tx: int  # bytes the interface sent
    rx: int  # bytes it received


def counters(interface: str, namespace: str | None = None) -> Counters:
    """The interface's byte counters; inside `namespace` when given (read through `ip netns exec`,
    which shows that namespace's /sys/class/net)."""
    paths = [f"/sys/class/net/{interface}/statistics/{name}" for name in ("tx_bytes", "rx_bytes")]
    if namespace is None:
        tx, rx = (int(Path(path).read_text()) for path in paths)
    else:
        out = subprocess.run(["ip", "netns", "exec", namespace, "cat", *paths], capture_output=True, text=True,
                             check=True, timeout=COMMAND_TIMEOUT).stdout
        tx, rx = (int(value) for value in out.split())
    return Counters(tx, rx)


def loopback_bytes() -> int | None:
    """Transmit byte counter of the loopback interface (machine-wide), or None where unavailable."""
    try:
        return counters("lo").tx
    except (OSError, ValueError):
        return None


def per_node(before: int | None, after: int | None, nodes: int) -> int | None:
    """A machine-wide counter's growth shared out over `nodes` (None when either reading is missing)."""
    return None if before is None or after is None else (after - before) // nodes


def wire_bytes(islands: Iterable[Island], since: int = 0) -> int:
    """Bytes on the islands' links (tx of every island), less `since`."""
    return sum(island.tx_bytes() for island in islands) - since


class WireSampler:
    """A byte figure (e.g. `lambda: wire_bytes(islands)`) sampled with its unix time on a thread."""

    def __init__(self, read: Callable[[], int], interval: float):
        self.read, self.interval = read, interval
        self.samples: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="wire-sampler", daemon=True)

    def __enter__(self) -> WireSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> tuple[float, int]:
        """Take a sample now (the time is the one before reading the counters)."""
        at = time.time()
        value = self.read()
        with self._lock:
            self.samples.append((at, value))
            self.samples.sort()
        return at, value

    def at_or_after(self, moment: float) -> int:
        """The counters at the first sample taken at or after `moment` (the last one if none is later)."""
        with self._lock:
            index = bisect.bisect_left(self.samples, (moment, -1))
            return self.samples[min(index, len(self.samples) - 1)][1]


def windows(samples: list[tuple[float, int]]) -> list[float]:
    """Bytes/s of every window of (at least) 1 s between two samples."""
    rates, j = [], 0
    for i, (start, sent) in enumerate(samples):
        j = max(j, i)
        while j < len(samples) and samples[j][0] - start < 1.0:
            j += 1
        if j == len(samples):
            break
        rates.append((samples[j][1] - sent) / (samples[j][0] - start))
    return rates
