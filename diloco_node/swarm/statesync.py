"""State downloads: how a joiner or a re-syncing node gets φ, the outer momentum and the round.

Over our own libp2p stream handler rather than hivemind's load_state_from_peers, which takes the
state from whichever peer claims the highest priority in an unsigned DHT key that anyone can
write, serves anyone who asks, and checks neither size nor content. Here the downloader picks
among the run's verified records (whose, and in which order: trust/state.py), the server serves only admitted peers, the
transfer is bounded in bytes (known from the model's size) and in time (an inactivity timeout and
a least rate), and the result is checked by `accept` (φ's digest against the round's records, in
runs whose φ is the same on every node); a failure is logged and the next peer is tried.

Wire: request {"admission": token} → {"sharing", "metadata", "vectors"} → the vectors, fp32,
one after another, each of the model's size.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco_node.errors import NodeError
from diloco_node.rates import format_rate
from diloco_node.replica.layout import digest
from diloco_node.swarm.streams import HEADER_LEN, Limits, Streams, StreamService, parse_json, receive, send
from diloco_node.telemetry.progress import Bar, Progress, terminal_bar
from diloco_node.trust.records import NodeRecord, reference_state
from diloco_node.trust.state import (
    announced_states,
    catch_up_target,
    metadata_refusal,
    servers_in_order,
    state_refusal,
)

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 2048
MAX_META_BYTES = 1 << 16
CHUNK_BYTES = 1 << 20
READ_TIMEOUT = 10.0  # seconds without a byte before a download is given up
LEAST_RATE = 256 * 1024  # bytes/s: a server slower than this (2 Mbit/s) is dropped for the next one
# A server under an upload cap announces the rate it serves each transfer at (its cap shared by
# MAX_SERVES), and a joiner under a download cap reads at its own: the least rate is then half the
# lower of those (payloads share the caps), but no less than this floor (1 Mbit/s), of our choosing:
# a server's word is its own (announcing 1 B/s made a drip of 32 KiB/s acceptable), and our servers
# cut a reader slower than it as well, so that two slow readers cannot hold both serve slots for
# hours (docs/architecture.md §14).
STATE_LEAST_RATE = 128 * 1024
SHARE_WAIT_SECONDS = 6.0  # a request waits this long for us to share again (below the asker's READ_TIMEOUT)
SHARE_POLL_SECONDS = 0.1
NOT_SHARING = "it is not sharing its state now"  # a blocking node mid-exchange: asked again, not demoted
SETUP_SECONDS = 10.0  # beyond the transfer at LEAST_RATE: connecting, the server's snapshot
STATE_RETRY_SECONDS = 1.0  # between state downloads that found no peer sharing
AGREEMENT_POLLS, AGREEMENT_POLL_SECONDS = 10, 0.5  # reading the records again after a download
# A state the run has moved past while it downloaded is caught up on in at most this many passes
# (the run goes on while the means are fetched; each pass fetches fewer rounds; how far behind a
# state may be: trust/state.py's CATCH_UP_ROUNDS)
CATCH_UP_PASSES = 4

SharedState = tuple[dict[str, Any], list[torch.Tensor]]  # metadata, flat fp32 vectors (φ first)
# Our state for the peer that asks (its id); None while we do not share.
StateProvider = Callable[[str], "SharedState | None"]
# Why a peer showing admission token may not download our state; None when it may.
AccessPolicy = Callable[[str, str], "str | None"]
# The state to take from a peer (the one downloaded, or it caught up), or why it is refused (e.g. φ's digest).
Acceptance = Callable[[str, SharedState], "SharedState | str"]
# (server, its state, the settled round to reach, the server's round) → the state with the means of
# the rounds it lacks before that settled round applied, at the server's round with the rounds from
# the settled one on in flight; None when a mean cannot be had (outer/catchup.py)
CatchUp = Callable[[str, SharedState, int, int], "SharedState | None"]


MAX_SERVES = 2  # state transfers served at once, each holding at most one snapshot of φ and the momentum
SNAPSHOT_REUSE_SECONDS = 5.0  # a serve under way lends its snapshot to requests this recent
# one state request per peer at a time, and a few a second: a joiner asks each server once per retry
STATE_LIMITS = Limits(per_peer=1, total=16, rate=1.0, burst=4.0, reserved=4)
MAX_METADATA_DEPTH = 3  # the header {"metadata": {"in_flight": [...]}}

@dataclass
class _Snapshot:
    """One copy of our state, lent to every serve under way (`users`)."""

    shared: SharedState
    taken: float
    users: int = 1


@dataclass(frozen=True)
class Admission:
    """A well-formed state request: the admission token it shows."""

    token: str


def parse_request(data: bytes) -> Admission | str:
    """A state request → the admission it shows, or why it is malformed (never raises)."""
    try:
        request = parse_json(data, max_depth=1)
    except ValueError:
        return "malformed request"
    token = request.get("admission", "") if isinstance(request, dict) else None
    return Admission(token) if isinstance(token, str) else "malformed request"


def parse_header(data: bytes, max_vectors: int) -> tuple[dict[str, Any], int]:
    """A server's answer header → (its metadata, the vectors it announces); StateRefused for
    anything else: not JSON, nested too deep, not sharing, a count out of range."""
    try:
        header = parse_json(data, MAX_METADATA_DEPTH)
    except ValueError as exc:
        raise StateRefused(f"malformed answer ({exc})") from None
    if not isinstance(header, dict) or header.get("sharing") is not True:
        raise StateRefused(NOT_SHARING)
    count = header.get("vectors")
    if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= max_vectors:
        raise StateRefused(f"it announced {str(count)[:20]!r} vectors")
    metadata = header.get("metadata")
    if not isinstance(metadata, dict):
        raise StateRefused("malformed answer (no metadata)")
    return metadata, count


MAX_ANNOUNCED_RATE = 1e15  # bytes/s: beyond any link (a larger int, 10**400, has no float at all)


def announced_rate(data: bytes) -> float | None:
    """The rate (bytes/s) a server's answer header says it serves at; None when it names none
    (uncapped) or the header is malformed (parse_header refuses that)."""
    try:
        header = parse_json(data, MAX_METADATA_DEPTH)
    except ValueError:
        return None
    rate = header.get("rate") if isinstance(header, dict) else None
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < MAX_ANNOUNCED_RATE:
        return None
    return float(rate)


def least_rate(announced: float | None, own_cap: float) -> float:
    """Bytes/s a download must keep, from the server's announced rate and our own download cap
    (each 0 or None: none); LEAST_RATE when neither is capped."""
    caps = [rate / 2 for rate in (announced, own_cap) if rate]
    return min(LEAST_RATE, max(STATE_LEAST_RATE, min(caps))) if caps else LEAST_RATE


class DisputedState(NodeError, RuntimeError):
    """A joiner with no root of trust (no proof, no `--peers` naming a node of the run) found the
    run's records announcing different states: nothing tells the run's from a forged one."""


def await_one_state(peers: Callable[[], dict[str, NodeRecord]], wait: float, stop: threading.Event) -> int:
    """How many distinct states the records `peers` gives announce, read again until they name at
    most one or `wait` seconds have passed (honest nodes a step apart agree again within a round;
    forged records announcing a state of their own never do). docs/architecture.md §9: a joiner
    with no anchor takes a state only from records that all name it."""
    deadline = time.monotonic() + wait
    while len(states := announced_states(peers().values())) > 1 and time.monotonic() < deadline:
        if stop.wait(AGREEMENT_POLL_SECONDS):
            break
    return len(states)


class StateRefused(Exception):
    """A download from one peer that failed or was refused; the next peer is tried."""


class StateService(StreamService):
    def __init__(self, streams: Streams, namespace: str, numel: int, max_vectors: int, provider: StateProvider,
                 may_download: AccessPolicy, token: str = "", on_moved: Callable[[int, int], None] | None = None,
                 on_shared: Callable[[str, dict[str, Any]], None] | None = None):
        """`max_vectors`: the most flat vectors a state may hold (φ, momentum, rounds in flight);
        `on_moved(sent, received)` counts the state's bytes, by default in `streams` with the
        payloads' (the node's traffic is their sum); pass one to keep a tally of its own.
        `on_shared(peer, metadata)`: told of every peer a state goes to (a snapshot is shared by
        the joiners that arrive together, so `provider` is not asked for each)."""
        super().__init__(streams, f"{namespace}_state", STATE_LIMITS)
        self._numel, self._max_vectors = numel, max_vectors
        self._provider, self._may_download, self._token = provider, may_download, token
        self._on_moved = on_moved or streams.count
        self._on_shared = on_shared
        self._serving = 0  # transfers under way (on the streams' loop only)
        self._shared: _Snapshot | None = None
        # told where a download stands after each read, None once it ended (watch)
        self._on_progress: Callable[[dict[str, Any] | None], None] | None = None

    def watch(self, on_progress: Callable[[dict[str, Any] | None], None]) -> None:
        """`on_progress(figures)` after each read of a download: the peer, bytes so far and in all,
        the rate and the seconds left; `on_progress(None)` once it ended, however (the status server
        shows a joiner's minutes of download, docs/operations.md)."""
        self._on_progress = on_progress

    # --- serving ------------------------------------------------------------------------------

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)
        try:
            request = parse_request(await receive(reader, MAX_REQUEST_BYTES, READ_TIMEOUT))
            why = request if isinstance(request, str) else \
                await self.loop.run_in_executor(None, self._may_download, peer, request.token)
            if why is not None:
                self._refuse_once(peer, why, "refused our state to peer=%s: %s", peer, why)
            if why is not None or self._serving >= MAX_SERVES:  # busy: the asker asks again (NOT_SHARING)
                await send(writer, json.dumps({"sharing": False}).encode())
                return
            self._serving += 1
            try:
                await self._send_state(peer, writer)
            finally:
                self._serving -= 1
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError) as exc:
            logger.warning("state request from peer=%s failed: %s", peer, str(exc) or type(exc).__name__)
        finally:
            writer.close()

    async def _send_state(self, peer: str, writer: asyncio.StreamWriter) -> None:
        snapshot = await self._snapshot(peer)
        if snapshot is None:
            await send(writer, json.dumps({"sharing": False}).encode())
            return
        try:
            metadata, vectors = snapshot.shared
            if self._on_shared is not None:
                await self.loop.run_in_executor(None, self._on_shared, peer, metadata)
            header: dict[str, Any] = {"sharing": True, "metadata": metadata, "vectors": len(vectors)}
            upload = self.streams.throttle.upload
            if upload.rate > 0:  # what each of our transfers gets at least, for the joiner's least rate
                header["rate"] = round(upload.rate / MAX_SERVES)
            await send(writer, json.dumps(header).encode())
            size = len(vectors) * self._numel * 4
            writer.write(size.to_bytes(HEADER_LEN, "big"))
            # a reader slower than STATE_LEAST_RATE is cut, as a joiner cuts such a server: a serve
            # slot is held for a bounded time whatever the reader does
            deadline = self.loop.time() + SETUP_SECONDS + size / STATE_LEAST_RATE
            # under a cap each drain is at most a chunk of the bucket, well inside READ_TIMEOUT
            step = CHUNK_BYTES if upload.rate <= 0 else upload.chunk
            for vector in vectors:
                # the snapshot's own memory, a chunk at a time: no second copy of φ per request
                data = memoryview(vector.detach().float().contiguous().numpy()).cast("B")  # type: ignore[arg-type]
                for start in range(0, len(data), step):
                    writer.write(bytes(data[start:start + step]))
                    left = deadline - self.loop.time()
                    try:
                        await asyncio.wait_for(writer.drain(), min(READ_TIMEOUT, max(left, 0.01)))
                    except TimeoutError:
                        if left < READ_TIMEOUT:
                            raise TimeoutError(f"read slower than {format_rate(STATE_LEAST_RATE)}") from None
                        raise
            self._on_moved(len(vectors) * self._numel * 4, 0)
        finally:
            snapshot.users -= 1
            if snapshot.users == 0 and self._shared is snapshot:
                self._shared = None  # no copy of φ is held between serves

    async def _snapshot(self, peer: str) -> _Snapshot | None:
        """Our state for `peer`: the snapshot a serve under way holds, when it is recent (so joiners
        arriving together share one copy of φ and the momentum), else a fresh one, waiting up to
        SHARE_WAIT_SECONDS for us to share again: a blocking node shares only between its
        exchanges, windows a joiner polling from afar would miss."""
        shared = self._shared
        if shared is not None and self.loop.time() - shared.taken < SNAPSHOT_REUSE_SECONDS:
            shared.users += 1
            return shared
        until = self.loop.time() + SHARE_WAIT_SECONDS
        while (state := await self.loop.run_in_executor(None, self._provider, peer)) is None:
            if self.loop.time() > until:
                return None
            await asyncio.sleep(SHARE_POLL_SECONDS)
        self._shared = _Snapshot(state, self.loop.time())
        return self._shared

    # --- downloading --------------------------------------------------------------------------

    def longest_transfer(self) -> float:
        """Seconds the largest state we take (`max_vectors` of the model's size) may stream at the
        least rate: how far past the caller's deadline a download begun in time may run."""
        return SETUP_SECONDS + self._numel * self._max_vectors * 4 / STATE_LEAST_RATE

    async def download(self, peer: str, timeout: float) -> SharedState:
        """`peer`'s state, begun within `timeout` (its size known) and then streamed at no less than
        the least rate, however long that takes: 160 MB of φ and momentum at 4 Mbit/s is minutes,
        past any deadline of a few rounds (docs/architecture.md §4). StateRefused with the reason otherwise."""
        try:
            return await asyncio.wait_for(self._download(peer, self.loop.time() + timeout),
                                          timeout + self.longest_transfer())
        except TimeoutError:
            raise StateRefused(f"no whole state within {timeout + self.longest_transfer():.0f}s") from None

    async def _download(self, peer: str, begin_by: float) -> SharedState:
        started = self.loop.time()
        bar: Bar | None = None
        try:
            reader, writer = await self._open(peer, self.name, READ_TIMEOUT)
        except Exception as exc:  # the peer is gone, unreachable or has no such handler
            raise StateRefused(f"cannot reach it ({type(exc).__name__})") from None
        try:
            await send(writer, json.dumps({"admission": self._token}).encode())
            answer = await receive(reader, MAX_META_BYTES, READ_TIMEOUT)
            metadata, count = parse_header(answer, self._max_vectors)
            least = least_rate(announced_rate(answer), self.streams.throttle.download_limit)
            data = bytearray()
            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(HEADER_LEN), READ_TIMEOUT), "big")
            if size != count * self._numel * 4:
                raise StateRefused(f"it announced {size} bytes for {count} vectors of the model's size")
            if self.loop.time() > begin_by:
                raise StateRefused("it answered too late to begin")
            # a slow drip is cut at the least rate, whatever the pace of single reads
            deadline = started + SETUP_SECONDS + size / least
            # minutes on a slow link: a bar on a terminal, elsewhere a line every few seconds, says how
            # far (docs/architecture.md §4); the figures go to the status server either way
            bar = terminal_bar("state download", total=size)
            progress = Progress("state download", total=size, clock=self.loop.time,
                                emit=(lambda line: None) if bar else
                                (lambda line: logger.info("%s (peer=%s)", line, peer)))
            while len(data) < size:
                if self.loop.time() > deadline:
                    raise StateRefused(f"too slow: {len(data)} of {size} bytes in time")
                chunk = await asyncio.wait_for(reader.read(min(CHUNK_BYTES, size - len(data))),
                                               max(min(READ_TIMEOUT, deadline - self.loop.time()), 0.01))
                if not chunk:
                    raise StateRefused(f"it closed the stream after {len(data)} of {size} bytes")
                data += chunk
                progress.update(len(data))
                if bar is not None:
                    bar.update(len(data))
                if self._on_progress is not None:
                    now = progress.figures()
                    self._on_progress({"peer": peer, "bytes": now["done"], "total_bytes": now["total"],
                                       "bytes_per_second": now["per_second"], "seconds_left": now["seconds_left"]})
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            raise StateRefused(f"transfer failed ({type(exc).__name__})") from None
        except ValueError as exc:  # an oversized header
            raise StateRefused(f"malformed answer ({exc})") from None
        finally:
            writer.close()
            if bar is not None:
                bar.close()
            if self._on_progress is not None:
                self._on_progress(None)
        self._on_moved(0, len(data))
        seconds = max(self.loop.time() - started, 1e-3)
        # against the run's round length (the records' rounds moving on), what says why a state
        # arrives superseded and is caught up on (docs/architecture.md §14)
        logger.info("state from peer=%s arrived: %.1f MB in %.1fs (%s)", peer, len(data) / 1e6, seconds,
                    format_rate(len(data) / seconds))
        flat = torch.frombuffer(data, dtype=torch.float32)
        return metadata, list(flat.split(self._numel))


def settled_state(shared: SharedState) -> tuple[int, str] | None:
    """What a downloaded state's server announces for it: the first round whose mean it lacks and
    the digest of all it sends, φ and the momentum (outer/state.Served); None when malformed."""
    metadata, vectors = shared
    in_flight = metadata.get("in_flight") or []
    rounds = [metadata.get("round"), *in_flight] if isinstance(in_flight, list) else [None]
    settled = [r for r in rounds if isinstance(r, int)]
    return (min(settled), digest(vectors)) if len(settled) == len(rounds) else None


def agreement(shared: SharedState, peers: Callable[[], dict[str, NodeRecord]], started: float,
              stop: threading.Event) -> str | None:
    """Why a downloaded state is not the one the run's records agree on (reference_state), None
    when it is. The records are read again after the download, for a few seconds: a blocking
    server shares its next state as soon as it has stepped, before every record says so. After
    AGREEMENT_WAIT_SECONDS without any two nodes announcing the same state, the state is taken
    unchecked (returns None) and the caller is told so in the log."""
    got = settled_state(shared)
    if got is None:
        return "malformed rounds"
    reference, served = None, [got[0]]
    for _ in range(AGREEMENT_POLLS):
        others = peers()
        reference = reference_state(others.values())
        served = [r.served_round for r in others.values() if r.served_digest] or served
        if got == reference:
            return None
        if reference is not None and reference[0] > got[0]:
            break  # superseded: records do not go back (the wait is for records that lag the server)
        if stop.wait(AGREEMENT_POLL_SECONDS):
            break
    # unchecked, but not a state every server has moved past (it arrived late: caught_up's to catch up)
    why = state_refusal(got, reference, served, time.monotonic() - started)
    if why is None:
        logger.warning("no two peers announce the same state; taking one unchecked")
    return why


def agreed_records(peers: Callable[[], dict[str, NodeRecord]],
                   stop: threading.Event) -> tuple[dict[str, NodeRecord], tuple[int, str] | None]:
    """The run's records and the state they agree on, read again for a few seconds while they agree
    on none (overlapped nodes one round apart announce different states until both have stepped)."""
    for _ in range(AGREEMENT_POLLS):
        others = peers()
        if (reference := reference_state(others.values())) is not None or stop.wait(AGREEMENT_POLL_SECONDS):
            return others, reference
    return others, None


def caught_up(server: str, shared: SharedState, peers: Callable[[], dict[str, NodeRecord]], catch_up: CatchUp,
              refused: str, stop: threading.Event) -> SharedState | str:
    """`shared`, a state from `server` that the run moved past while it downloaded, caught up on the
    means of the rounds since (`catch_up`) and taken only when it then is the state the run's
    records agree on, bit for bit: a round's mean that cannot be had, or a digest that differs,
    refuses it. The run goes on while the means are fetched: up to CATCH_UP_PASSES passes, each
    fetching the rounds the previous one took. `refused`: the reason when it is not to be caught up
    at all (catch_up_target)."""
    got = settled_state(shared)
    if got is None:
        return refused
    started, gap = got[0], 0
    for passes in range(CATCH_UP_PASSES + 1):
        others, reference = agreed_records(peers, stop)
        if passes and reference is not None and reference[0] - got[0] > gap:
            # a round's payloads take longer to fetch here than the round: each pass ends further behind
            return (f"catching up is slower than the run: it moved {reference[0] - got[0]} rounds on while we "
                    f"caught up on {gap} (a round's payloads take longer than a round to arrive here)")
        if got == reference or (passes and reference is None):
            # the run's state (a pass ago, when the records agree on none now: rounds since are in flight)
            if not passes:
                return shared
            # the planning line of a state download outlasting rounds: what it cost, and what avoids it
            logger.info("state from peer=%s was %d rounds behind the run's (settled round %d of %d) when it "
                        "arrived: caught up on the means of those rounds (the download outlasts the run's "
                        "rounds; a faster link or longer rounds avoid this)", server, got[0] - started, started, got[0])
            return shared
        target = catch_up_target(got, reference, others.get(server))
        if target is None or passes == CATCH_UP_PASSES:
            if passes:
                return f"caught up to settled round {got[0]}, but the run is at {reference} after {passes} passes"
            return refused
        gap = target - got[0]
        caught = catch_up(server, shared, target, others[server].round)
        if caught is None:
            return f"its state (settled round {got[0]}) lags the run's ({target}); a mean between cannot be had"
        now = settled_state(caught)
        if now is None or now != reference:
            return f"caught up to settled round {target}, its state {now} is not the run's {reference}"
        shared, got = caught, now
    return refused  # not reached: the last pass returns


def download_from(service: StateService, run: Callable[[Any, float, threading.Event], Any],
                  candidates: Sequence[str], accept: Acceptance, deadline: float, logged: set[tuple[str, str]],
                  stop: threading.Event) -> SharedState | None:
    """The first state among `candidates` (in order) that arrives whole and that `accept` takes (as
    it hands it back: caught up, perhaps);
    each failure is logged with the peer and the reason, once per pair in `logged` (the caller
    retries, asking the peers that failed last). None when every one failed or `stop` was set."""
    failed = {peer for peer, why in logged if why != NOT_SHARING}
    for peer in sorted(candidates, key=lambda p: p in failed):  # stable: the caller's order otherwise
        left = deadline - time.monotonic()
        if left <= 0 or stop.is_set():
            return None
        try:
            taken = accept(peer, run(service.download(peer, left), left + service.longest_transfer() + READ_TIMEOUT,
                                     stop))
        except StateRefused as exc:
            taken = str(exc)
        except TimeoutError:
            if stop.is_set():
                return None
            taken = "timed out"
        if not isinstance(taken, str):
            return taken
        why = taken
        if (peer, why) not in logged:
            logged.add((peer, why))
            logger.warning("state from peer=%s not taken: %s; trying another peer", peer, why)
    return None


def holds_run_state(others: dict[str, NodeRecord], held: tuple[int, str]) -> bool:
    """Whether the state the run's records agree on is `held`, the (settled round, digest) of the
    state we would serve ourselves, with every node announcing it still before that round's inner
    phase (no round in flight, and no training a lagging record may not show yet): downloading it
    would hand us the bytes we have. A fresh run's nodes all build φ0 and a zero momentum from the
    seed, so none of them needs the first node's copy (8 B/param of start-up traffic)."""
    announcers = [r for r in others.values() if (r.served_round, r.served_digest) == held]
    return (reference_state(others.values()) == held and bool(announcers)
            and all(r.round == held[0] and r.ready_round < held[0] for r in announcers))


def download_run_state(service: StateService, run: Callable[[Any, float, threading.Event], Any],
                       peers: Callable[[], dict[str, NodeRecord]], timeout: float, stop: threading.Event,
                       check_digest: bool, held: tuple[int, str] | None = None,
                       catch_up: CatchUp | None = None) -> SharedState | None:
    """The run's state, retried over the verified nodes `peers` gives (fresh records each time)
    within `timeout`. `check_digest` (runs whose nodes serve the same state): the state must be
    the one the records agree on (`agreement`), or, given `catch_up`, one a few rounds older that
    catches up to it (`caught_up`: rounds shorter than the download). None when nobody else is in the run, the run's
    state is the one we hold (`held`, see holds_run_state), nobody shared it in time, or `stop`
    was set."""
    started = time.monotonic()
    deadline = started + timeout
    logger.info("downloading state from peers")
    logged: set[tuple[str, str]] = set()

    def accept(peer: str, shared: SharedState) -> SharedState | str:
        why = metadata_refusal(shared[0], peer, peers())
        if why is None and check_digest:
            why = agreement(shared, peers, started, stop)
            if why is not None and catch_up is not None:
                return caught_up(peer, shared, peers, catch_up, why, stop)
        return shared if why is None else why

    while True:
        others = peers()
        if not others:
            return None
        if held is not None and holds_run_state(others, held):
            logger.info("the run's state is the one we hold (settled round %d, digest %s): nothing to download", *held)
            return None
        received = download_from(service, run, servers_in_order(others, reference_state(others.values())),
                                 accept, deadline, logged, stop)
        if received is not None:
            return received
        if time.monotonic() > deadline:
            logger.warning("no peer shared its state within %.0fs", timeout)
            return None
        if stop.wait(STATE_RETRY_SECONDS):
            logger.warning("state download stopped")
            return None
