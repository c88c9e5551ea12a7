"""Our libp2p stream protocols (payloads, butterfly parts, state, dial-back) and what they share.

`Streams` is the event loop thread our stream handlers live on, the replica of hivemind's P2P they
speak through, and the count of the payload bytes they move. `StreamService` is the base of each
protocol: its handlers attached to and detached from that P2P, each behind `StreamLimits` (per-peer
and total concurrency, a per-peer request rate: checked before a byte is read), and refusals logged
once per peer and reason. `send`/`receive` are the length-prefixed framing of every protocol, and
`parse_json` the bounded parse of every JSON message (docs/architecture.md §9).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from hivemind import DHT
from hivemind.p2p import P2P, PeerID

from diloco_node.lru import MAX_TRACKED_PEERS, LRUSet, trim_oldest
from diloco_node.swarm.hosts import UNKNOWN_HOST, host_group
from diloco_node.swarm.peer_traffic import CountedReader, CountedWriter, PeerTraffic
from diloco_node.swarm.throttle import Throttle

logger = logging.getLogger(__name__)

HEADER_LEN = 8
STOP_POLL_SECONDS = 0.5  # how soon a long transfer notices a stop
ATTACH_TIMEOUT = 30.0
DETACH_TIMEOUT = 5.0
REPLICATE_TIMEOUT = 60.0
# What a stream handler catches from one peer's request: the peer went away, was too slow, or sent
# something malformed (parsers raise ValueError); each ends that request with one log line.
PEER_FAILURES = (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError, KeyError, TypeError)
MAX_JSON_DEPTH = 8  # our messages nest 3 deep at most; json.loads recurses once per level
MAX_INT_DIGITS = 20  # our integers (rounds, sizes, seeds) fit 64 bits; any larger one is a peer's lie
# A stream whose first message has not fully arrived this long after it opened may be closed to make
# room for a new one once the service's streams are all taken: our own requests arrive within
# milliseconds, so only silent streams go, and silence no longer holds every slot (16 fresh ids x 4
# silent streams held all 64 for 20 s each, and honest fetches closed with 0 bytes).
SILENT_GRACE_SECONDS = 1.0
# A JSON string, its closing quote optional: an unterminated one then runs to the end (which json
# refuses too) in one pass, where a required quote made the scan quadratic (`"\"\"\"…`: 2.5 s of
# CPU for 20 KB, minutes for a 256 KB report)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_JSON_NESTING = re.compile(r"[\[\]{}]")

# A stream handler: hivemind calls it with the stream's info (its peer_id) and its two ends.
Handler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(len(data).to_bytes(HEADER_LEN, "big"))
    writer.write(data)
    await writer.drain()


async def receive(reader: asyncio.StreamReader, limit: int, timeout: float) -> bytes:
    """Read one message, refusing (before allocating) anything over `limit`."""
    header = await asyncio.wait_for(reader.readexactly(HEADER_LEN), timeout)
    length = int.from_bytes(header, "big")
    if length > limit:
        raise ValueError(f"message of {length} bytes exceeds the limit of {limit}")
    return await asyncio.wait_for(reader.readexactly(length), timeout)


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`data` as JSON; ValueError when it is not UTF-8 JSON, nests deeper than `max_depth`, or
    holds NaN or ±Infinity, or an integer of more than MAX_INT_DIGITS digits (numbers no message of
    ours carries: 10**400 passed every type check and raised OverflowError wherever a float of it was
    taken, in a push, an owner's report, a payload's meta and a state server's rate).

    Every JSON message a peer sends on our streams is parsed here (docs/architecture.md §9), but for
    the run manifest a joiner fetches: manifest.parse reads that with the same checks at its own
    depth (manifest.MAX_DEPTH), since train/manifest.py may not import swarm/ (§8). The bytes are decoded
    as UTF-8 first and the depth is checked on that text, the very text json.loads then parses:
    given bytes, json.loads would itself detect and decode UTF-16 and UTF-32, which a depth check
    on the raw bytes does not see, and a deep nest within any size limit would raise
    RecursionError. Our own messages are json.dumps(...).encode(), UTF-8 without a BOM."""
    text = data.decode("utf-8")  # UnicodeDecodeError is a ValueError
    depth = 0
    for bracket in _JSON_NESTING.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth}")
    return json.loads(text, parse_constant=_refuse_constant, parse_int=_bounded_int,
                      parse_float=_finite_float)  # ValueError (JSONDecodeError)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} refused")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 is a float literal json reads as inf
        raise ValueError(f"JSON number {text[:20]} beyond a float's range refused")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"JSON integer of more than {MAX_INT_DIGITS} digits refused")
    return int(text)


class SilenceWatch:
    """A stream's reading end (as its handler reads it) that knows whether the stream's first
    message (`send`'s header and body) has arrived in full: until then the stream is silent."""

    def __init__(self, reader: asyncio.StreamReader):
        self._reader = reader
        self._header = b""  # the first message's header, as far as it was read
        self._left: int | None = None  # bytes of the first message still to come, once its header is in
        self.silent = True

    def _took(self, data: bytes) -> bytes:
        if self.silent:
            if self._left is None:
                head = data[:HEADER_LEN - len(self._header)]
                self._header += head
                if len(self._header) == HEADER_LEN:
                    self._left = int.from_bytes(self._header, "big") + len(head) - len(data)
            else:
                self._left -= len(data)
            self.silent = self._left is None or self._left > 0
        return data

    async def read(self, n: int = -1) -> bytes:
        return self._took(await self._reader.read(n))

    async def readexactly(self, n: int) -> bytes:
        return self._took(await self._reader.readexactly(n))

    def __getattr__(self, name: str) -> Any:  # at_eof, ...: the stream's own
        return getattr(self._reader, name)


@dataclass
class _Served:
    """A stream one of our handlers is serving: whose, since when, whether it still says nothing."""

    peer: str
    task: asyncio.Task[Any] | None
    opened: float
    reader: SilenceWatch
    trusted: bool  # took its slot as a peer we trust (Streams.trusted): gives it back to that pool
    host: str | None  # its connection's hosts.host_group
    evicted: bool = False


@dataclass(frozen=True)
class Limits:
    """How much of a handler one peer, and all peers together, may hold: streams open at once, and
    requests per second (a bucket of `burst` refilled at `rate`). Fresh peer ids get fresh buckets,
    which is why `total` bounds them all; `reserved` of the total only peers we trust may take
    (Streams.trusted), so strangers rotating fresh ids, however fast, never hold every slot; and the
    strangers of one host group (hosts.host_group: an IPv4 address, an IPv6 /48, a relay) hold at
    most `per_host` of theirs (by default a sixth), so fresh ids from fewer than six groups cannot
    keep a stranger of another out (an open run's joiner asking for our state is one)."""

    per_peer: int = 4
    total: int = 64
    rate: float = 8.0
    burst: float = 32.0
    reserved: int = 16
    per_host: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.reserved < self.total:
            raise ValueError(f"reserved streams {self.reserved} must leave strangers some of {self.total}")
        if self.per_host is None:
            object.__setattr__(self, "per_host", max(1, (self.total - self.reserved) // 6))
        elif not 0 < self.per_host <= self.total - self.reserved:
            raise ValueError(f"a host's {self.per_host} streams must be within the strangers' "
                             f"{self.total - self.reserved}")


class StreamLimits:
    """The bookkeeping of `Limits` for one service; used on the streams' event loop only."""

    def __init__(self, limits: Limits, capacity: int = MAX_TRACKED_PEERS):
        self.limits = limits
        self._open: dict[str, int] = {}
        self._strangers = 0  # streams open for peers we do not trust, at most total − reserved
        self._hosts: dict[str, int] = {}  # strangers' streams open by host group, each ≤ per_host
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer → (tokens, at)
        self._capacity = capacity

    def admit(self, peer: str, now: float | None = None, trusted: bool = False,
              host: str | None = UNKNOWN_HOST) -> str | None:
        """Why a new stream from `peer` (`trusted`: Streams.trusted; its connection from `host`, a
        hosts.host_group, None: our own machine, in no group) is refused now; None when it is taken
        (then `release` it alike)."""
        now = time.monotonic() if now is None else now
        if sum(self._open.values()) >= self.limits.total:
            return f"{self.limits.total} streams open already"
        if not trusted and self._strangers >= self.limits.total - self.limits.reserved:
            return f"{self._strangers} streams of peers we do not know open already"
        if not trusted and self.host_full(host):
            return f"{self.limits.per_host} streams of peers we do not know from its host open already"
        if self._open.get(peer, 0) >= self.limits.per_peer:
            return f"{self.limits.per_peer} of its streams open already"
        tokens, at = self._buckets.pop(peer, (self.limits.burst, now))
        tokens = min(self.limits.burst, tokens + (now - at) * self.limits.rate)
        self._buckets[peer] = (tokens - 1.0, now) if tokens >= 1.0 else (tokens, now)
        trim_oldest(self._buckets, self._capacity)
        if tokens < 1.0:
            return f"more than {self.limits.rate:g} requests/s"
        self._open[peer] = self._open.get(peer, 0) + 1
        self._strangers += not trusted
        if not trusted and host is not None:
            self._hosts[host] = self._hosts.get(host, 0) + 1
        return None

    def release(self, peer: str, trusted: bool = False, host: str | None = UNKNOWN_HOST) -> None:
        self._strangers -= not trusted
        if not trusted and host is not None:
            if (held := self._hosts.get(host, 0) - 1) > 0:
                self._hosts[host] = held
            else:
                self._hosts.pop(host, None)
        left = self._open.get(peer, 0) - 1
        if left > 0:
            self._open[peer] = left
        else:
            self._open.pop(peer, None)

    def open_streams(self) -> int:
        return sum(self._open.values())

    def host_full(self, host: str | None) -> bool:
        """Whether the strangers of `host` hold every stream one host's may (our own machine's: never)."""
        return host is not None and self._hosts.get(host, 0) >= cast(int, self.limits.per_host)

    def full(self, trusted: bool = True) -> bool:
        """Whether every stream a peer (`trusted` or not) may take is taken."""
        return self.open_streams() >= self.limits.total or \
            (not trusted and self._strangers >= self.limits.total - self.limits.reserved)


class Streams:
    """The event loop (on its own thread) and the replica of the DHT's P2P our protocols share, the
    node's caps every stream is paced by (`throttle`, docs/architecture.md §14), the bytes of
    payloads and butterfly parts they moved (state transfers count their own), and every byte of
    every stream by remote peer (`traffic`: the live per-peer rates)."""

    def __init__(self, dht: DHT, throttle: Throttle | None = None):
        self.throttle = throttle or Throttle()
        self.traffic = PeerTraffic()
        # whether a peer may take the streams `Limits.reserved` keeps (the facade sets it: proven,
        # anchors, joiners we served, our groups' members); called on the loop, so it must be cheap
        self.trusted: Callable[[str], bool] = lambda peer: False
        self._counter_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="swarm-streams", daemon=True)
        self._thread.start()
        self.p2p: P2P = self.run(dht.replicate_p2p(), timeout=REPLICATE_TIMEOUT)

    def run(self, coroutine, timeout: float, stop: threading.Event | None = None):  # type: ignore[no-untyped-def]
        """Run `coroutine` on the streams' event loop (the one our stream handlers live on);
        TimeoutError after `timeout`, or as soon as `stop` is set (the coroutine is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=min(STOP_POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
            except TimeoutError:  # ours, or the coroutine's own (then it is done)
                if future.done() or (stop is not None and stop.is_set()) or time.monotonic() >= deadline:
                    future.cancel()
                    raise

    def count(self, sent: int = 0, received: int = 0) -> None:
        with self._counter_lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def close(self) -> None:
        """Shut our P2P replica down and stop the loop (detach the services first)."""
        try:
            self.run(self._shutdown(), timeout=DETACH_TIMEOUT)
        except Exception as exc:  # closing must not fail; the daemon goes away with the DHT anyway
            logger.debug("closing the streams failed: %r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

    async def _shutdown(self) -> None:
        """Leave no task pending: at exit asyncio would log each one ('Task was destroyed') on stderr."""
        try:
            await self.p2p.shutdown()  # a replica: closes only its own client, not the DHT's daemon
        finally:
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class StreamService(ABC):
    """One protocol on the shared streams: the handler `name` serves `_serve` (a subclass may add
    handlers to `_handlers`), attached and detached from any thread but the streams' loop."""

    def __init__(self, streams: Streams, name: str, limits: Limits = Limits()):
        self.streams, self.p2p, self.loop = streams, streams.p2p, streams.loop
        self.name = name
        self._handlers: dict[str, Handler] = {name: self._serve}
        self._refusals_logged = LRUSet()
        self._limits = StreamLimits(limits)  # one budget for all of this service's handlers
        # the streams our handlers serve now (≤ limits.total, and evicted ones still ending)
        self._streams_served: list[_Served] = []

    def attach(self) -> None:
        """Serve our handlers; raises when the daemon would not take one."""
        self.streams.run(self._attach(), timeout=ATTACH_TIMEOUT)

    async def _attach(self) -> None:
        for name, handler in self._handlers.items():
            await self.p2p.add_binary_stream_handler(name, self._limited(handler))

    def _limited(self, handler: Handler) -> Handler:
        """`handler` behind our limits: a stream over them is closed before anything is read; one
        taken is read and written at the node's caps (throttle.py). When all the service's streams are
        taken, the longest silent one (`SILENT_GRACE_SECONDS`) is closed to make room."""
        async def limited(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = str(info.peer_id)
            reader, writer = self._paced(reader, writer, peer)
            trusted = self.streams.trusted(peer)
            host = host_group(getattr(info, "addr", None))
            why = self._limits.admit(peer, trusted=trusted, host=host)
            if why is not None and self._make_room(trusted, host):
                why = self._limits.admit(peer, trusted=trusted, host=host)
            if why is not None:
                self._refuse_once(peer, why, "%s refused a stream from peer=%s: %s", self.name, peer, why,
                                  level=logging.INFO)
                writer.close()
                return
            served = _Served(peer, asyncio.current_task(), time.monotonic(), SilenceWatch(reader), trusted, host)
            self._streams_served.append(served)
            try:
                await handler(info, cast(asyncio.StreamReader, served.reader), writer)
            except asyncio.CancelledError:
                # the node is stopping (its loop cancels what runs), or we closed a silent stream: end
                # quietly. Left to propagate, hivemind's stream callback asks the cancelled task for its
                # exception and asyncio logs that with a traceback (seen: a stop while serving a state)
                with contextlib.suppress(Exception):  # a transport already torn down
                    writer.close()
            finally:
                self._streams_served.remove(served)
                if not served.evicted:  # an evicted stream gave its slot back when it was closed
                    self._limits.release(peer, served.trusted, served.host)
        return limited

    def _make_room(self, trusted: bool, host: str | None) -> bool:
        """Close a silent stream for a refused one where that frees what it needs: a stranger whose
        host holds its share takes one of its own host's; else, when the streams it may take are
        all taken, the longest silent of those. Whether one was closed."""
        if not trusted and self._limits.host_full(host):
            return self._evict_silent(trusted, host)
        return self._limits.full(trusted) and self._evict_silent(trusted)

    def _evict_silent(self, trusted: bool, host: str | None = None) -> bool:
        """Close the stream that has been silent longest, if one has been for SILENT_GRACE_SECONDS
        (for a stranger's new stream, one of a stranger's: the slots it may take; with `host`, one of
        that host's strangers); its slot is free at once. Whether one was closed."""
        now = time.monotonic()
        silent = [s for s in self._streams_served if s.reader.silent and not s.evicted
                  and (trusted or not s.trusted) and (host is None or (not s.trusted and s.host == host))
                  and now - s.opened >= SILENT_GRACE_SECONDS]
        if not silent:
            return False
        oldest = min(silent, key=lambda s: s.opened)
        oldest.evicted = True
        self._limits.release(oldest.peer, oldest.trusted, oldest.host)
        if oldest.task is not None:
            oldest.task.cancel()
        self._refuse_once(oldest.peer, "silent", "%s closed a silent stream of peer=%s to serve another",
                          self.name, oldest.peer, level=logging.INFO)
        return True

    async def _open(self, peer: str, handler: str, timeout: float) -> tuple[asyncio.StreamReader,
                                                                            asyncio.StreamWriter]:
        """A stream to `peer`'s `handler`, read and written at the node's caps (throttle.py)."""
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler), timeout)
        return self._paced(reader, writer, peer)

    def _paced(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
               peer: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The stream's ends paced at the node's caps, its bytes counted for `peer` beneath the pacing
        (peer_traffic.py: a byte counts when it moves, not when a protocol queues it)."""
        # the wrapped ends have the methods our protocols call (read, readexactly; write, drain, close)
        throttle, traffic = self.streams.throttle, self.streams.traffic
        counted_reader = cast(asyncio.StreamReader, CountedReader(reader, traffic, peer))
        counted_writer = cast(asyncio.StreamWriter, CountedWriter(writer, traffic, peer))
        return (cast(asyncio.StreamReader, throttle.reader(counted_reader)),
                cast(asyncio.StreamWriter, throttle.writer(counted_writer)))

    def detach(self) -> None:
        """Stop serving; never raises (the handlers go with the daemon anyway)."""
        try:
            self.streams.run(self._detach(), timeout=DETACH_TIMEOUT)
        except Exception as exc:  # leaving must not fail
            logger.debug("detaching %s failed: %r", self.name, exc)

    async def _detach(self) -> None:
        for name in self._handlers:
            await self.p2p.remove_binary_stream_handler(name)

    @abstractmethod
    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one stream a peer opened to `name`."""

    def _refuse_once(self, peer: str, why: str, message: str, *args: object, level: int = logging.WARNING) -> None:
        """Log `message % args` (a refusal of `peer` for `why`) once per peer and reason: a flood
        stays one line. Logged under the protocol's own module."""
        if (peer, why) not in self._refusals_logged:
            self._refusals_logged.add((peer, why))
            logging.getLogger(type(self).__module__).log(level, message, *args)
