"""State downloads: how a joiner or a re-syncing node gets φ, the outer momentum and the round.

Over our own libp2p stream handler rather than hivemind's load_state_from_peers, which takes the
state from whichever peer claims the highest priority in an unsigned DHT key that anyone can
write, serves anyone who asks, and checks neither size nor content. Here the downloader picks
among the run's verified records (swarm/records.py), the server serves only admitted peers, the
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
from typing import Any

import torch
from hivemind.p2p import PeerID

from diloco_node.replica.layout import digest
from diloco_node.swarm.records import NodeRecord, reference_state
from diloco_node.swarm.streams import HEADER_LEN, Streams, StreamService, receive, send

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 2048
MAX_META_BYTES = 1 << 16
CHUNK_BYTES = 1 << 20
READ_TIMEOUT = 10.0  # seconds without a byte before a download is given up
LEAST_RATE = 256 * 1024  # bytes/s: a server slower than this (2 Mbit/s) is dropped for the next one
SHARE_WAIT_SECONDS = 6.0  # a request waits this long for us to share again (below the asker's READ_TIMEOUT)
SHARE_POLL_SECONDS = 0.1
NOT_SHARING = "it is not sharing its state now"  # a blocking node mid-exchange: asked again, not demoted
SETUP_SECONDS = 10.0  # beyond the transfer at LEAST_RATE: connecting, the server's snapshot
STATE_RETRY_SECONDS = 1.0  # between state downloads that found no peer sharing
# how long a joiner waits for two nodes to announce the same state before taking one unchecked:
# a few rounds, for nodes one round apart to meet
AGREEMENT_WAIT_SECONDS = 30.0
AGREEMENT_POLLS, AGREEMENT_POLL_SECONDS = 10, 0.5  # reading the records again after a download

SharedState = tuple[dict[str, Any], list[torch.Tensor]]  # metadata, flat fp32 vectors (φ first)
# Our state for the peer that asks (its id); None while we do not share.
StateProvider = Callable[[str], "SharedState | None"]
# Why a peer showing admission token may not download our state; None when it may.
AccessPolicy = Callable[[str, str], "str | None"]
# Why a downloaded state from a peer is refused (e.g. φ's digest); None to accept it.
Acceptance = Callable[[str, SharedState], "str | None"]


class StateRefused(Exception):
    """A download from one peer that failed or was refused; the next peer is tried."""


class StateService(StreamService):
    def __init__(self, streams: Streams, namespace: str, numel: int, max_vectors: int, provider: StateProvider,
                 may_download: AccessPolicy, token: str = "", on_moved: Callable[[int, int], None] | None = None):
        """`max_vectors`: the most flat vectors a state may hold (φ, momentum, rounds in flight);
        `on_moved(sent, received)` counts the state's bytes, by default in `streams` with the
        payloads' (the node's traffic is their sum); pass one to keep a tally of its own."""
        super().__init__(streams, f"{namespace}_state")
        self._numel, self._max_vectors = numel, max_vectors
        self._provider, self._may_download, self._token = provider, may_download, token
        self._on_moved = on_moved or streams.count

    # --- serving ------------------------------------------------------------------------------

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)
        try:
            request = json.loads(await receive(reader, MAX_REQUEST_BYTES, READ_TIMEOUT))
            token = request.get("admission", "") if isinstance(request, dict) else None
            why = "malformed request" if not isinstance(token, str) else \
                await self.loop.run_in_executor(None, self._may_download, peer, token)
            shared = None if why else await self._snapshot(peer)
            if why:
                self._refuse_once(peer, why, "refused our state to peer=%s: %s", peer, why)
            if shared is None:
                await send(writer, json.dumps({"sharing": False}).encode())
                return
            metadata, vectors = shared
            await send(writer, json.dumps({"sharing": True, "metadata": metadata, "vectors": len(vectors)}).encode())
            writer.write((len(vectors) * self._numel * 4).to_bytes(HEADER_LEN, "big"))
            for vector in vectors:
                data = vector.detach().float().contiguous().numpy().tobytes()
                for start in range(0, len(data), CHUNK_BYTES):
                    writer.write(data[start:start + CHUNK_BYTES])
                    await asyncio.wait_for(writer.drain(), READ_TIMEOUT)
            self._on_moved(len(vectors) * self._numel * 4, 0)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError) as exc:
            logger.warning("state request from peer=%s failed: %s", peer, type(exc).__name__)
        finally:
            writer.close()

    async def _snapshot(self, peer: str) -> SharedState | None:
        """Our state for `peer`, waiting up to SHARE_WAIT_SECONDS for us to share again: a blocking
        node shares only between its exchanges, windows a joiner polling from afar would miss."""
        until = self.loop.time() + SHARE_WAIT_SECONDS
        while (shared := await self.loop.run_in_executor(None, self._provider, peer)) is None:
            if self.loop.time() > until:
                return None
            await asyncio.sleep(SHARE_POLL_SECONDS)
        return shared

    # --- downloading --------------------------------------------------------------------------

    async def download(self, peer: str, timeout: float) -> SharedState:
        """`peer`'s state within `timeout`; StateRefused with the reason otherwise."""
        try:
            return await asyncio.wait_for(self._download(peer, self.loop.time() + timeout), timeout)
        except TimeoutError:
            raise StateRefused(f"no whole state within {timeout:.0f}s") from None

    async def _download(self, peer: str, deadline: float) -> SharedState:
        started = self.loop.time()
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.name), READ_TIMEOUT)
        except Exception as exc:  # the peer is gone, unreachable or has no such handler
            raise StateRefused(f"cannot reach it ({type(exc).__name__})") from None
        try:
            await send(writer, json.dumps({"admission": self._token}).encode())
            header = json.loads(await receive(reader, MAX_META_BYTES, READ_TIMEOUT))
            if not isinstance(header, dict) or header.get("sharing") is not True:
                raise StateRefused(NOT_SHARING)
            count = header.get("vectors")
            if not isinstance(count, int) or not 2 <= count <= self._max_vectors:
                raise StateRefused(f"it announced {count!r} vectors")
            data = bytearray()
            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(HEADER_LEN), READ_TIMEOUT), "big")
            if size != count * self._numel * 4:
                raise StateRefused(f"it announced {size} bytes for {count} vectors of the model's size")
            deadline = min(deadline, started + SETUP_SECONDS + size / LEAST_RATE)
            while len(data) < size:
                if self.loop.time() > deadline:
                    raise StateRefused(f"too slow: {len(data)} of {size} bytes in time")
                chunk = await asyncio.wait_for(reader.read(min(CHUNK_BYTES, size - len(data))), READ_TIMEOUT)
                if not chunk:
                    raise StateRefused(f"it closed the stream after {len(data)} of {size} bytes")
                data += chunk
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            raise StateRefused(f"transfer failed ({type(exc).__name__})") from None
        except ValueError as exc:  # JSON or an oversized header
            raise StateRefused(f"malformed answer ({exc})") from None
        finally:
            writer.close()
        self._on_moved(0, len(data))
        flat = torch.frombuffer(data, dtype=torch.float32)
        metadata = header.get("metadata")
        return (metadata if isinstance(metadata, dict) else {}), list(flat.split(self._numel))


def servers_in_order(others: dict[str, NodeRecord], reference: tuple[int, str] | None) -> list[str]:
    """Whom to ask for the run's state, in order: the nodes serving the state most of the run
    announces, then the others, furthest round first."""
    return sorted(others, key=lambda p: ((others[p].served_round, others[p].served_digest) != reference,
                                         -others[p].round, p))


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
    reference = None
    for _ in range(AGREEMENT_POLLS):
        reference = reference_state(peers().values())
        if got == reference:
            return None
        if stop.wait(AGREEMENT_POLL_SECONDS):
            break
    if reference is None and time.monotonic() - started > AGREEMENT_WAIT_SECONDS:
        logger.warning("no two peers announce the same state; taking one unchecked")
        return None
    wanted = "no state two nodes agree on" if reference is None else \
        f"settled round {reference[0]}, digest {reference[1]}"
    return f"its state (settled round {got[0]}, digest {got[1]}) is not the run's ({wanted})"


def download_from(service: StateService, run: Callable[[Any, float, threading.Event], Any],
                  candidates: Sequence[str], accept: Acceptance, deadline: float, logged: set[tuple[str, str]],
                  stop: threading.Event) -> SharedState | None:
    """The first state among `candidates` (in order) that arrives whole and that `accept` takes;
    each failure is logged with the peer and the reason, once per pair in `logged` (the caller
    retries, asking the peers that failed last). None when every one failed or `stop` was set."""
    failed = {peer for peer, why in logged if why != NOT_SHARING}
    for peer in sorted(candidates, key=lambda p: p in failed):  # stable: the caller's order otherwise
        left = deadline - time.monotonic()
        if left <= 0 or stop.is_set():
            return None
        try:
            shared = run(service.download(peer, left), left + READ_TIMEOUT, stop)
            why = accept(peer, shared)
        except StateRefused as exc:
            why = str(exc)
        except TimeoutError:
            if stop.is_set():
                return None
            why = "timed out"
        if why is None:
            return shared
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
                       check_digest: bool, held: tuple[int, str] | None = None) -> SharedState | None:
    """The run's state, retried over the verified nodes `peers` gives (fresh records each time)
    within `timeout`. `check_digest` (runs whose nodes serve the same state): the state must be
    the one the records agree on (`agreement`). None when nobody else is in the run, the run's
    state is the one we hold (`held`, see holds_run_state), nobody shared it in time, or `stop`
    was set."""
    started = time.monotonic()
    deadline = started + timeout
    logger.info("downloading state from peers")
    logged: set[tuple[str, str]] = set()

    def accept(_peer: str, shared: SharedState) -> str | None:
        return agreement(shared, peers, started, stop) if check_digest else None

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
            logger.warning("no peer shared its state within %.0fs; starting from our own φ", timeout)
            return None
        if stop.wait(STATE_RETRY_SECONDS):
            logger.warning("state download stopped")
            return None
