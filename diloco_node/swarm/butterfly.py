"""Butterfly exchange: reduce-scatter, then all-gather of the averaged parts (docs/architecture.md §2, transport).

In an all-gather every member fetches every other member's payload: (M−1) payloads per node and
round. Here the vector is cut into M parts, member j owns part j: every member pushes its encoded
part j to j, j takes the bounded mean of what it received (the reducer, outer/averaging.py) and
answers each push with that averaged part, encoded again with the run's codec. Each node then
moves about 2·(M−1)/M payloads each way, whatever M is; every member holds the same bytes for every
part, so φ stays bit-identical across the group.

Why our own streams rather than hivemind's AllReduceRunner: its reducer adds (mean − local) to each
member's tensor (a few ulps apart per node), averages raw tensors with no per-peer bound, and would
need our aggregators, token caps and admission checks inside hivemind's internals.

A push is one request-answer on one stream the pusher opens: a member that accepts no inbound
connection (behind a NAT) can still push its parts and receive the averaged ones; it simply owns no
part. A part whose owner vanished is asked of the other members (any that received it holds the
same bytes); when nobody has it, every member skips it alike.

An owner seals each averaged part it answers (seals.py), and a member takes no part its owner did
not seal. Before a member applies the parts, it compares them with the group (docs/architecture.md
§9): it asks every other member for the sealed hash of each averaged part it holds (and tells its
own). A part is kept only where the members other than its owner hold one sealed version of it: a
member that lacks it fetches it from one that holds it, and two sealed versions (an owner that sent
different bytes to different members) make every member skip it. Only what the owner sealed counts
and the owner's own word counts for nothing, so no single member can make two others decide
differently. outer/verify.py then checks what is kept against the declared contributions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco_node.round import PartIn, PartSource, Reduced, part_bounds
from diloco_node.swarm.exchange import MAX_SENDS_PER_PEER
from diloco_node.swarm.messages import (
    MAX_GROUP,
    DigestsRequest,
    PartRequest,
    Push,
    Told,
    parse_digests_request,
    parse_part_request,
    parse_push,
    parse_report,
    told_list,
    told_on_wire,
)
from diloco_node.swarm.streams import HEADER_LEN, PEER_FAILURES, Streams, StreamService, receive, send
from diloco_node.trust.seals import Seal, Sealer, parse_seal, sealed_by, sealed_versions, statement

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 16  # round, part, tokens, norms, the group's peer ids and an admission
# An owner's report: per used peer its id and declaration (M + 2 floats), so ~M² floats in all:
# groups up to about 100 members
MAX_REPORT_BYTES = 1 << 18
# A member's sealed hashes: ~840 bytes a part (hash, signature, the owner's public key), so the
# same groups up to about 300
MAX_HASHES_BYTES = 1 << 18
KEPT_ROUNDS = 4  # rounds whose parts we hold (late members, joiners completing a round in flight)
PART_RECOVERY_SECONDS = 10.0  # how long a member asks the others for a part whose owner vanished
# A push waits this long beyond the owners' wait for parts: the owner reduces when its wait ends and
# answers then, so a push must outlast it by the reduction and the answer's transfer.
ANSWER_SLACK = 30.0
# How long a finished exchange waits for our averaged part to be written to every member that
# pushed to us, so the round's traffic counts its own answers; a member that reads slower than this
# is counted in the next round.
WRITE_WAIT_SECONDS = 10.0
# How long a member waits for the others' hashes of the parts: the slowest member ends its exchange
# at most a push's wait and a recovery after the first (its round deadline is the same).
COMPARE_SECONDS = ANSWER_SLACK + PART_RECOVERY_SECONDS
# The longest an exchange runs beyond its timeout: a push's wait, the recovery of vanished parts,
# the writes of our answers, the comparison of hashes.
BEYOND_TIMEOUT = ANSWER_SLACK + PART_RECOVERY_SECONDS + WRITE_WAIT_SECONDS + COMPARE_SECONDS
RECEIVED = b"\x01"  # an acknowledgement: the whole answer was read
REFUSAL = "round=%d refused a butterfly exchange with peer=%s: %s"


def owners(group: Sequence[str], clients: Sequence[str] = ()) -> tuple[str, ...]:
    """The members owning a part each, in peer order: all but those that accept no connection."""
    return tuple(sorted(p for p in group if p not in set(clients)))


@dataclass
class _Round:
    """One round's butterfly state on this node (touched on the event loop only)."""

    group: tuple[str, ...] | None = None  # once our matchmaking has told us
    owned: int | None = None
    # peer → (part, its push, the group it names): held only until the round is reduced (`_release`)
    received: dict[str, tuple[int, PartIn, tuple[str, ...]]] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # our part is reduced, or we will not reduce one
    held: dict[int, tuple[bytes, dict[str, Any]]] = field(default_factory=dict)  # averaged parts we hold
    seals: dict[int, Seal] = field(default_factory=dict)  # their owners' seals
    awaited: set[str] = field(default_factory=set)  # members that pushed and have not read our answer yet
    unwritten: set[str] = field(default_factory=set)  # members whose answer we have not written yet
    written: asyncio.Event = field(default_factory=asyncio.Event)  # `unwritten` is empty
    owning: tuple[str, ...] = ()  # the part owners, in part order
    finished: bool = False  # our exchange of the round has ended: what we hold is all we will hold
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # `finished` is set: our hashes are final
    # (peer, part) → averaged parts of it we began to send: at most MAX_SENDS_PER_PEER, as payloads
    part_sends: dict[tuple[str, int], int] = field(default_factory=dict)
    told: dict[str, tuple[Told | None, ...]] = field(default_factory=dict)  # member → the part hashes it told us
    asked: set[str] = field(default_factory=set)  # members we answered our hashes to
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # `asked` grew


def digest(part: tuple[bytes, dict[str, Any]]) -> str:
    """The hash members compare of one averaged part and its owner's report."""
    averaged, report = part
    return hashlib.sha256(averaged + json.dumps(report, sort_keys=True).encode()).hexdigest()


def _without_serving_keys(report: dict[str, Any]) -> dict[str, Any]:
    """An owner's report as its owner made it, without its seal and what a member adds when serving it."""
    return {key: value for key, value in report.items() if key not in ("group", "parts", "seal")}


# Why `peer`, showing admission `token`, may not take part in `round`'s exchange whose group (None:
# not known yet) is `group`; None when it may. Runs off the event loop: it may look up the DHT.
Policy = Callable[[str, int, str, "tuple[str, ...] | None"], "str | None"]


class Butterfly(StreamService):
    def __init__(self, streams: Streams, namespace: str, max_part_bytes: int, may_take_part: Policy, token: str,
                 wait_seconds: float, sealer: Sealer):
        """What we move adds to the node's payload traffic (`streams.count`); a push waits up to
        `wait_seconds` (the round timeout) for us to reduce its part; `sealer` signs the parts we
        own with our libp2p key. Three handlers: pushes to reduce (`name`, served by `_serve`),
        requests for averaged parts we hold (`_serve_part`) and for their hashes (`_serve_digests`)."""
        super().__init__(streams, f"{namespace}_reduce")
        self._namespace, self._sealer = namespace, sealer
        self._wait = wait_seconds
        self._reduce_name, self._part_name, self._digest_name = self.name, f"{namespace}_part", f"{namespace}_digests"
        self._handlers[self._part_name] = self._serve_part
        self._handlers[self._digest_name] = self._serve_digests
        self._max_part = max_part_bytes
        self._may, self._token, self._count = may_take_part, token, streams.count
        self._rounds: dict[int, _Round] = {}
        self._current: int | None = None  # the latest round we began to exchange

    def _round(self, round_: int) -> _Round | None:
        """The round's state, made on first touch; None for a round older than those we keep."""
        if round_ in self._rounds:
            return self._rounds[round_]
        if self._rounds and round_ <= max(self._rounds) - KEPT_ROUNDS:
            return None
        self._rounds[round_] = _Round()
        for old in [r for r in self._rounds if r <= max(self._rounds) - KEPT_ROUNDS]:
            dropped = self._rounds.pop(old)
            self._release(dropped)  # a push still waiting on it gets an empty answer
            dropped.settled.set()
        return self._rounds[round_]

    @staticmethod
    def _release(rnd: _Round) -> None:
        """The round is reduced, or we will not reduce a part of it: its pushes are no longer
        needed, so their payloads go at once, not when the round leaves the KEPT_ROUNDS we keep
        (64 pusher ids held 256 MiB that way; docs/architecture.md §9)."""
        rnd.done.set()
        rnd.received.clear()

    def _holds_push(self, round_: int, rnd: _Round, peer: str, group: tuple[str, ...]) -> bool:
        """Whether a push of `peer` naming `group` is kept for our reduction of `round_`: not once
        the round is reduced, not for a past round we never exchanged (we will not reduce it), and,
        once we know the round's group, only a member's naming that very group. What we hold is
        thus bounded (docs/architecture.md §9): before the group is known, one push per open push
        stream (≤ the service's total stream limit, `Limits.total`, each ≤ max_part_bytes: a push
        is dropped when its stream ends, `_serve`); after, one per member of the group, until the
        round is reduced."""
        if rnd.done.is_set():
            return False
        if rnd.group is None:
            return self._current is None or round_ >= self._current
        return rnd.owned is not None and peer in rnd.group and group == rnd.group

    def _round_for_push(self, round_: int) -> _Round | None:
        """The round a push may touch: near the one we are exchanging, so a peer pushing far-off
        rounds can neither grow our memory nor push the current round out of those we keep."""
        if self._current is not None and not self._current - KEPT_ROUNDS < round_ <= self._current + 2:
            return None
        if self._current is None and round_ not in self._rounds and len(self._rounds) >= 2:
            return None
        return self._round(round_)

    # --- the round, from a member's side -----------------------------------------------------

    async def claimed_group(self, round_: int, ourselves: str) -> tuple[str, ...] | None:
        """The group that pushed us a part of `round_` (so counted us as an owner) although our own
        matchmaking did not find it; None unless every push so far names the same group with us."""
        rnd = self._rounds.get(round_)
        groups = {group for _, _, group in rnd.received.values()} if rnd else set()
        if len(groups) != 1:
            return None
        group = next(iter(groups))
        return group if ourselves in group else None

    async def close(self, round_: int) -> None:
        """We will not reduce a part of `round_` (we averaged alone): pushes get an empty answer now."""
        if rnd := self._round(round_):
            self._release(rnd)
            rnd.settled.set()

    async def exchange(self, round_: int, group: Sequence[str], ourselves: str, clients: Sequence[str],
                       numel: int, source: PartSource, timeout: float) -> Reduced:
        """Push our parts to their owners, reduce ours, and collect every averaged part: within
        `timeout` + BEYOND_TIMEOUT."""
        group = tuple(sorted(group))
        self._current = round_ if self._current is None else max(self._current, round_)
        owning = owners(group, clients)
        bounds = part_bounds(numel, len(owning), source.align)
        rnd = self._round(round_) or _Round()
        rnd.group, rnd.owning = group, owning
        rnd.owned = owning.index(ourselves) if ourselves in owning else None
        for peer in [p for p in rnd.received if not self._holds_push(round_, rnd, p, rnd.received[p][2])]:
            del rnd.received[peer]  # pushes that came before we knew the group: those we will not reduce go now
        rnd.arrived.set()  # pushes that came before we knew the group are checked against it now
        deadline = self.loop.time() + timeout  # for the parts we own to arrive
        pushes = {index: asyncio.ensure_future(self._push(owner, round_, index, group, bounds, source,
                                                          deadline + ANSWER_SLACK))
                  for index, owner in enumerate(owning) if owner != ourselves}
        try:
            if rnd.owned is not None:
                await self._reduce_ours(round_, rnd, group, bounds, ourselves, source, deadline)
            for index, push in pushes.items():
                if (answer := await push) is not None:
                    self._take(round_, rnd, index, *answer, owning[index])
        finally:
            for push in pushes.values():
                push.cancel()
            self._release(rnd)
        missing = [index for index in range(len(owning)) if index not in rnd.held]
        if missing:
            await self._recover(round_, rnd, group, owning, missing, ourselves)
        rnd.finished = True
        rnd.settled.set()
        if rnd.unwritten:  # our answers' writers wake on `done` and may not have run yet
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rnd.written.wait(), WRITE_WAIT_SECONDS)
        agreed = await self._compare(round_, rnd, group, owning, ourselves)
        return Reduced(group, len(owning), {i: rnd.held[i] for i in agreed}, rnd.owned)

    def _statement(self, round_: int, rnd: _Round, index: int, part_hash: str) -> bytes:
        return statement(self._namespace, round_, index, rnd.owning, part_hash)

    def _take(self, round_: int, rnd: _Round, index: int, averaged: bytes, report: dict[str, Any], source: str,
              want: str | None = None) -> bool:
        """Hold part `index` as peer `source` gave it (with its owner's seal in the report) when its
        owner sealed it, and, given `want`, when it hashes to that."""
        part = averaged, _without_serving_keys(report)
        part_hash, seal = digest(part), parse_seal(report.get("seal"))
        if (want is not None and part_hash != want) or seal is None or not sealed_by(
                rnd.owning[index], self._statement(round_, rnd, index, part_hash), seal):
            logger.warning("round=%d part %d from peer=%s is not what its owner peer=%s sealed: not taken",
                           round_, index, source, rnd.owning[index])
            return False
        rnd.held[index], rnd.seals[index] = part, seal
        return True

    def _served(self, rnd: _Round, index: int) -> tuple[bytes, dict[str, Any]]:
        """An averaged part we hold as we hand it on: with its owner's seal."""
        averaged, report = rnd.held[index]
        return averaged, {**report, "seal": rnd.seals[index].to_wire()}

    def _hashes(self, rnd: _Round) -> list[Told | None]:
        return [Told(digest(rnd.held[i]), rnd.seals[i]) if i in rnd.held else None for i in range(len(rnd.owning))]

    async def _compare(self, round_: int, rnd: _Round, group: tuple[str, ...], owning: tuple[str, ...],
                       ourselves: str) -> list[int]:
        """The parts of which the members other than their owner hold one sealed version (ours, or
        fetched now from a member that holds it)."""
        ours = self._hashes(rnd)
        request = DigestsRequest(round_, self._token, tuple(ours)).encode()
        deadline = self.loop.time() + COMPARE_SECONDS

        async def ask(peer: str) -> None:
            try:
                _, answer = await self._ask(peer, self._digest_name, request, b"", deadline)
            except Exception:  # a member gone or silent: it cannot split what the others compare
                return
            if (told := told_list(answer.get("digests"), len(owning))) is not None:
                rnd.told[peer] = told
        await asyncio.gather(*(ask(peer) for peer in group if peer != ourselves))
        # the members that answered us ask us too: the round's traffic holds those answers (and we
        # compare with what they tell), unless one takes longer than WRITE_WAIT_SECONDS
        until = self.loop.time() + WRITE_WAIT_SECONDS
        while not set(rnd.told) <= rnd.asked and (left := until - self.loop.time()) > 0:
            rnd.answered.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rnd.answered.wait(), left)
        agreed, unsealed = [], set()
        for index, owner in enumerate(owning):
            # hash → the members other than the owner that hold that sealed version (trust/seals.py)
            told = [(peer, entry.hash, entry.seal) for peer, entries in sorted(rnd.told.items())
                    if (entry := entries[index]) is not None]
            versions, untrue = sealed_versions(owner, ourselves, None if (mine := ours[index]) is None else mine.hash,
                                               told, functools.partial(self._statement, round_, rnd, index))
            unsealed |= untrue
            if len(versions) == 1:
                (want, holders), = versions.items()
                if (mine := ours[index]) is not None:
                    kept = mine.hash == want  # false only for an owner that sealed two versions
                else:
                    kept = await self._fetch(round_, rnd, group, index, holders, deadline, want) is not None
                if kept:
                    agreed.append(index)
                    continue
            if len(versions) > 1:
                logger.warning("round=%d skipped averaged part %d: its owner peer=%s sealed %d different versions "
                               "(held by peer=%s)", round_, index, owner, len(versions),
                               ";".join(",".join(holders) for holders in versions.values()))
            elif versions:
                logger.warning("round=%d skipped averaged part %d (owner peer=%s): peer=%s hold%s it and did not give "
                               "it to us", round_, index, owner, ",".join(holders), "" if len(holders) > 1 else "s")
            elif ours[index] is not None:
                logger.warning("round=%d skipped averaged part %d (owner peer=%s): no other member holds it",
                               round_, index, owner)
            # no longer held: members that ask our hashes (or the part) later skip it as we do
            rnd.held.pop(index, None)
            rnd.seals.pop(index, None)
        if unsealed:
            logger.warning("round=%d peer=%s told hashes their owners did not seal", round_, ",".join(sorted(unsealed)))
        return agreed

    async def _reduce_ours(self, round_: int, rnd: _Round, group: tuple[str, ...], bounds: tuple[tuple[int, int], ...],
                           ourselves: str, source: PartSource, deadline: float) -> None:
        """Wait for every member's push of our part (or the deadline), then reduce it."""
        index = rnd.owned
        assert index is not None
        members = set(group) - {ourselves}
        while True:
            fitting = {peer for peer, (part, _, their) in rnd.received.items()
                       if peer in members and part == index and their == group}
            left = deadline - self.loop.time()
            if fitting == members or left <= 0:
                break
            rnd.arrived.clear()
            try:
                await asyncio.wait_for(rnd.arrived.wait(), left)
            except TimeoutError:
                pass
        for peer in sorted(members - fitting):
            logger.warning("round=%d part %d: no part from peer=%s in time", round_, index, peer)
        start, end = bounds[index]
        parts = [rnd.received[peer][1] for peer in sorted(fitting)]
        if source.encode is not None:
            parts.append(PartIn(ourselves, source.encode(start, end), source.tokens, source.norm, source.norms(bounds)))
        parts.sort(key=lambda part: part.peer)
        answer = await self.loop.run_in_executor(None, source.reduce, round_, index, bounds, parts)
        rnd.held[index] = answer
        rnd.seals[index] = self._sealer.seal(self._statement(round_, rnd, index, digest(answer)))
        rnd.awaited, rnd.unwritten = set(fitting), set(fitting)
        self._release(rnd)

    async def _push(self, owner: str, round_: int, index: int, group: tuple[str, ...],
                    bounds: tuple[tuple[int, int], ...], source: PartSource,
                    deadline: float) -> tuple[bytes, dict[str, Any]] | None:
        """Our part `index` to its owner, with the norms of all our parts (the same list to every owner);
        its answer is the averaged part with its report and seal (None: failed or empty)."""
        payload = source.encode(*bounds[index]) if source.encode is not None else b""
        request = Push(round_, index, tuple(group), source.tokens if payload else 0.0, source.norm, self._token,
                       tuple(source.norms(bounds)) if payload else ()).encode()
        try:
            averaged, report = await self._ask(owner, self._reduce_name, request, payload, deadline)
            return (averaged, report) if averaged else None
        except Exception as exc:  # any network or peer failure loses this part from this owner only
            logger.warning("round=%d part %d: owner peer=%s did not answer (%s)", round_, index, owner,
                           type(exc).__name__)
            return None

    async def _ask(self, peer: str, handler: str, request: bytes, payload: bytes,
                   deadline: float) -> tuple[bytes, dict[str, Any]]:
        """One request-answer on a stream we open: (the averaged part, empty when none; its report)."""
        timeout = max(deadline - self.loop.time(), 1.0)
        reader, writer = await self._open(peer, handler, timeout)
        try:
            await send(writer, request)
            await send(writer, payload)
            meta = await receive(reader, MAX_REPORT_BYTES, max(deadline - self.loop.time(), 1.0))
            averaged = await receive(reader, self._max_part, max(deadline - self.loop.time(), 1.0))
            writer.write(RECEIVED)
            await writer.drain()
        finally:
            writer.close()
        self._count(sent=3 * HEADER_LEN + len(request) + len(payload) + 1,
                    received=2 * HEADER_LEN + len(meta) + len(averaged))
        return averaged, parse_report(meta)  # ValueError: that owner's part is not taken

    async def _fetch(self, round_: int, rnd: _Round, group: tuple[str, ...], index: int, holders: Sequence[str],
                     deadline: float, want: str | None = None) -> str | None:
        """Ask `holders` in turn for part `index` until one gives what its owner sealed (hashing to
        `want` when given); the member that did, None when none. Each is given an equal share of
        the time left, so one that stalls cannot use up the others' turns."""
        request = PartRequest(round_, index, self._token).encode()
        for turn, peer in enumerate(holders):
            share = (deadline - self.loop.time()) / (len(holders) - turn)
            try:
                averaged, report = await self._ask(peer, self._part_name, request, b"", self.loop.time() + share)
            except Exception:  # that member is gone too
                continue
            if averaged and report.get("group") == list(group) and self._take(round_, rnd, index, averaged, report,
                                                                              peer, want):
                return peer
        return None

    async def _recover(self, round_: int, rnd: _Round, group: tuple[str, ...], owning: tuple[str, ...],
                       missing: list[int], ourselves: str) -> None:
        """Ask the other members for the parts whose owner did not answer us."""
        deadline = self.loop.time() + PART_RECOVERY_SECONDS
        others = [p for p in group if p != ourselves and p not in {owning[i] for i in missing}]
        while missing and self.loop.time() < deadline:
            for index in list(missing):
                if (peer := await self._fetch(round_, rnd, group, index, others, deadline)) is not None:
                    missing.remove(index)
                    logger.info("round=%d part %d: not from its owner peer=%s; got it from peer=%s",
                                round_, index, owning[index], peer)
            if missing:
                await asyncio.sleep(0.5)
        for index in missing:
            logger.warning("round=%d part %d: neither its owner peer=%s nor another member gave it to us; skipped",
                           round_, index, owning[index])

    async def fetch_parts(self, peer: str, round_: int, timeout: float, max_group: int = MAX_GROUP
                          ) -> tuple[tuple[str, ...], dict[int, tuple[bytes, dict[str, Any]]]] | None:
        """The averaged parts of `round_` that `peer` holds and the group they were reduced in, once
        its exchange of that round has ended (a part it lacks was skipped by its group); None before,
        and for a group of more than `max_group` (the run's bound: no more parts are asked for)."""
        deadline = self.loop.time() + timeout
        request = PartRequest(round_, 0, self._token).encode()
        averaged, report = await self._ask(peer, self._part_name, request, b"", deadline)
        group, count = report.get("group"), report.get("parts")
        if not (isinstance(group, list) and all(isinstance(p, str) for p in group) and isinstance(count, int)
                and 0 < count <= len(group) <= max_group):
            return None
        parts = {0: (averaged, _without_serving_keys(report))} if averaged else {}
        for index in range(1, count):
            request = PartRequest(round_, index, self._token).encode()
            averaged, report = await self._ask(peer, self._part_name, request, b"", deadline)
            if averaged:
                parts[index] = averaged, _without_serving_keys(report)
        return tuple(group), parts

    # --- serving ------------------------------------------------------------------------------

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A member's push of its part; answered with the averaged part once we have reduced it."""
        peer = str(info.peer_id)
        rnd: _Round | None = None
        held: tuple[int, PartIn, tuple[str, ...]] | None = None
        try:
            request = await receive(reader, MAX_REQUEST_BYTES, timeout=10)
            push = parse_push(request)
            if isinstance(push, str):
                raise ValueError(push)
            round_, index, group, tokens, norm, norms = push.round, push.part, push.group, push.tokens, push.norm, \
                push.norms
            answer: tuple[bytes, dict[str, Any]] = (b"", {})
            rnd = self._round_for_push(round_)
            # admission before the body (up to ~5 B/param) is read: a refused peer costs a header
            why = await self.loop.run_in_executor(None, self._may, peer, round_, push.token,
                                                  rnd.group if rnd else None)
            if why is None and peer not in group:
                why = "not in the group it names"
            payload = await receive(reader, self._max_part, timeout=60) if why is None else b""
            self._count(received=2 * HEADER_LEN + len(request) + len(payload))
            if why is not None:
                self._refuse_once(peer, why, REFUSAL, round_, peer, why)
            elif rnd is not None:
                if self._holds_push(round_, rnd, peer, group):
                    held = (index, PartIn(peer, payload, tokens if payload else 0.0, norm, norms), group)
                    rnd.received[peer] = held
                    rnd.arrived.set()
                    payload = b""
                    await asyncio.wait_for(rnd.done.wait(), timeout=self._wait + ANSWER_SLACK)
                    held = None  # reduced: `_release` let go of it, and so do we
                payload = b""  # a push not held (late, or not for a part we reduce) gets what we reduced without it
                if rnd.done.is_set() and rnd.owned == index and rnd.group == group and index in rnd.held:
                    answer = self._served(rnd, index)
            # counted as soon as written: the round's traffic is read when our exchange returns
            self._count(sent=await self._answer(writer, answer))
            self._written(rnd, peer)
            acknowledged = await asyncio.wait_for(reader.read(1), timeout=10) == RECEIVED
            self._count(received=int(acknowledged))
            if acknowledged and rnd is not None:
                rnd.awaited.discard(peer)
        except PEER_FAILURES as exc:
            logger.warning("butterfly push from peer=%s failed: %s", peer, type(exc).__name__)
        finally:
            self._written(rnd, peer)
            if rnd is not None and held is not None and rnd.group is None and rnd.received.get(peer) is held:
                del rnd.received[peer]  # its stream is gone before we knew the group: held no longer
            writer.close()

    @staticmethod
    def _written(rnd: _Round | None, peer: str) -> None:
        """Our answer to `peer`'s push is written, or will never be."""
        if rnd is not None and peer in rnd.unwritten:
            rnd.unwritten.discard(peer)
            if not rnd.unwritten:
                rnd.written.set()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader, parse: Callable[[bytes], Any],
                            limit: int = MAX_REQUEST_BYTES) -> tuple[Any, int]:
        """A request with no body of at most `limit` bytes, parsed by its messages.py parser
        (ValueError: malformed), and the bytes it took."""
        request = await receive(reader, limit, timeout=10)
        await receive(reader, 0, timeout=10)
        asked = parse(request)
        if isinstance(asked, str):
            raise ValueError(asked)
        return asked, 2 * HEADER_LEN + len(request)

    async def _serve_part(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """An averaged part we hold, for a member whose owner vanished or a joiner completing a round."""
        peer = str(info.peer_id)
        sent = received = 0
        try:
            asked, received = await self._read_request(reader, parse_part_request)
            round_, index, token = asked.round, asked.part, asked.token
            rnd = self._rounds.get(round_)
            answer: tuple[bytes, dict[str, Any]] = (b"", {})
            if rnd is not None and rnd.finished and rnd.group is not None:
                why = await self.loop.run_in_executor(None, self._may, peer, round_, token, rnd.group)
                if why is not None:
                    self._refuse_once(peer, why, REFUSAL, round_, peer, why)
                elif index in rnd.held and rnd.part_sends.get((peer, index), 0) >= MAX_SENDS_PER_PEER:
                    why = f"sent part {index} {MAX_SENDS_PER_PEER} times already"
                    self._refuse_once(peer, why, REFUSAL, round_, peer, why)
                else:
                    averaged, report = self._served(rnd, index) if index in rnd.held else (b"", {})
                    if averaged:
                        rnd.part_sends[(peer, index)] = rnd.part_sends.get((peer, index), 0) + 1
                    answer = averaged, {**report, "group": list(rnd.group), "parts": len(rnd.owning)}
            sent = await self._answer(writer, answer)
            received += await asyncio.wait_for(reader.read(1), timeout=10) == RECEIVED
        except PEER_FAILURES as exc:
            logger.warning("butterfly part request from peer=%s failed: %s", peer, type(exc).__name__)
        finally:
            self._count(sent=sent, received=received)
            writer.close()

    async def _serve_digests(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A member's part hashes for a round: we keep them, and answer ours once our exchange has ended."""
        peer = str(info.peer_id)
        sent = received = 0
        try:
            asked, received = await self._read_request(reader, parse_digests_request, MAX_HASHES_BYTES)
            round_, token = asked.round, asked.token
            rnd = self._round_for_push(round_)
            answer: dict[str, Any] = {}
            why = await self.loop.run_in_executor(None, self._may, peer, round_, token, rnd.group if rnd else None)
            if why is not None:
                self._refuse_once(peer, why, REFUSAL, round_, peer, why)
            elif rnd is not None:
                # the asker may end its exchange before ours: our hashes are final once we have ended
                await asyncio.wait_for(rnd.settled.wait(), COMPARE_SECONDS)
                if rnd.group is not None and peer in rnd.group:
                    if len(asked.digests) == len(rnd.owning):
                        rnd.told.setdefault(peer, asked.digests)
                    answer = {"digests": told_on_wire(self._hashes(rnd))}
            sent = await self._answer(writer, (b"", answer))
            self._count(sent=sent, received=received)
            sent = received = 0
            if rnd is not None and answer:
                rnd.asked.add(peer)
                rnd.answered.set()
            received += await asyncio.wait_for(reader.read(1), timeout=10) == RECEIVED
        except PEER_FAILURES as exc:
            logger.warning("butterfly hash request from peer=%s failed: %s", peer, type(exc).__name__)
        finally:
            self._count(sent=sent, received=received)
            writer.close()

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, answer: tuple[bytes, dict[str, Any]]) -> int:
        averaged, report = answer
        meta = json.dumps(report).encode()
        await send(writer, meta)
        await send(writer, averaged)
        return 2 * HEADER_LEN + len(meta) + len(averaged)

    async def unanswered(self) -> set[str]:
        """Members that pushed to us and have not read our averaged part yet (a leaving node waits)."""
        return {peer for rnd in self._rounds.values() for peer in rnd.awaited}
