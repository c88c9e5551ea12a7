"""Proven peers: who may decide anything about the run (docs/architecture.md §9, "free identities").

Identities are free in an open run: anyone can publish any number of validly signed records. So a
record alone decides nothing. A peer is *proven* to us when its contribution passed our checks and
went into a mean we applied (the AverageResult's group: its payload decoded and was bounded, or,
under butterfly, its part was used), within the last PROOF_ROUNDS of our rounds. Work cannot be
forged for free: a proven peer computed and sent a valid contribution.

Who counts in a decision (`counted`):
- our own proven peers, once we have any;
- before that (a joiner, a node just restarted): our *anchors*, the peers the operator named with
  `--peers` whose records list peers they proved, and those peers. The operator chose the anchor;
  its list names only peers whose work it checked;
- with neither (a fresh run before its first exchange, or anchors that are no nodes of the run):
  every record, as before any proof exists (a known limit, §9), except for the state we download:
  an anchor that is a node of the run but proved nobody yet is still the one source a joiner
  takes a state from (`state_sources`), since two forged records announcing one state would
  otherwise pass for two agreeing servers.

The barrier also waits, for one round only, for a *newcomer*: a peer that took a counted peer's
state (that peer vouched for it in its record) and has not been proven yet. A joiner can thus
take part in its first round, where its payload is checked; a record that never becomes ready
holds nobody up. Anyone can take our state under a fresh identity, so that wait is a budget shared
by all newcomers, not one per identity: once a newcomer was waited for and was not ready in its
grace, no other newcomer is waited for until it is proven or PROOF_ROUNDS rounds have passed
(`Proofs.newcomers`). A genuine joiner in that window takes part in the rounds it is ready for.

Matchmaking for unproven peers (`Proofs.may_matchmake_strangers`): a record that is ready whenever
an honest one is (a copy) but never matchmakes would make a node whose ready peers are all
unproven (the run's first node before its first exchange, or one whose proven peers left) wait a
matchmaking window in vain every round. After such a matchmaking found nobody, the next ones with
only unproven peers ready are skipped (the round goes alone at once) for 3, then 7 rounds; a
newcomer's first round and any proof end the skipping.

NoLoCo's draws (docs/architecture.md §9, "NoLoCo draws"): every node draws the same groups from
every record, since a draw among each node's own proven peers splits the run into islands (in groups
of two a node proves only its partners, and two nodes' draws then disagree). What the proofs decide
is whom a node *waits for*: a drawn partner is waited for up to the round timeout only when it is
`trusted` (counted, or endorsed: listed as proven in the record of a counted peer, whose checked
work we used, so it saw this one's checked work); any other drawn partner for a short grace once we
are ready, and it is dropped from the round if it is not ready by then (never matchmade for). A
forged record drawn into our group thus costs the grace, not the round timeout, and cannot make us
behind; two honest nodes that never met are endorsed to each other once the draws have mixed them
with a common partner, and until then still meet within the grace and the matchmaking window.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping

from diloco_node.trust.records import MAX_PROVEN, NodeRecord

PROOF_ROUNDS = 8  # a peer stays proven this many of our rounds after its last checked contribution
MAX_NEWCOMERS = 256  # newcomers remembered as already waited for (oldest forgotten first)
# Rounds skipped after the n-th matchmaking in a row with only unproven peers ready found nobody:
# 3, then 7 (PROOF_ROUNDS − 1); a genuine node we missed meets us in the next try, or sooner as a
# newcomer after it re-synced from us (docs/architecture.md §9)
STRANGER_SKIPS = (3, PROOF_ROUNDS - 1)


def known(proven: Collection[str], anchors: Collection[str], records: Mapping[str, NodeRecord]) -> set[str]:
    """The peers worth a matchmaking window when ready: the counted ones; before any proof, the
    anchors that are nodes of the run (the operator chose them; a record is not)."""
    who = counted(proven, anchors, records)
    return who if who is not None else {peer for peer in anchors if peer in records}


def anchor_ids(initial_peers: Iterable[str]) -> frozenset[str]:
    """The peer ids in the operator's `--peers` multiaddrs (`.../p2p/<peer id>`)."""
    return frozenset(address.rsplit("/p2p/", 1)[1] for address in initial_peers if "/p2p/" in address)


def counted(proven: Collection[str], anchors: Collection[str], records: Mapping[str, NodeRecord]) -> set[str] | None:
    """The peers whose records decide (see the module's docstring); None: every record counts."""
    if proven:
        return set(proven)
    endorsed: set[str] = set()
    for peer in anchors:
        # an anchor that has proved nobody yet (the run's first exchange is still to come) vouches
        # for nobody either: until then every record counts, as for every node of a fresh run
        if peer in records and records[peer].proven:
            endorsed.update({peer, *records[peer].proven})
    return endorsed or None


def state_sources(proven: Collection[str], anchors: Collection[str],
                  records: Mapping[str, NodeRecord]) -> set[str] | None:
    """The peers whose records choose the state we download and who serve it: the counted ones;
    with none (no proof of ours and anchors that proved nobody: a fresh run before its first
    exchange), the anchors that are serving nodes of the run; None: every record (no anchor is
    one). k forged identities announcing one state meet the "two agreeing servers" check of a
    fresh run; they cannot make us take it where the operator named a node of the run with
    `--peers` (docs/architecture.md §9)."""
    who = counted(proven, anchors, records)
    if who is not None:
        return who
    serving = {peer for peer in anchors if peer in records and not records[peer].client}
    return serving or None


def endorsed(who: Collection[str], records: Mapping[str, NodeRecord]) -> set[str]:
    """The peers that those of `who` with a record list as proven (one hop: not the peers those list)."""
    return {peer for voucher in who if voucher in records for peer in records[voucher].proven}


def trusted(proven: Collection[str], anchors: Collection[str], records: Mapping[str, NodeRecord]) -> set[str] | None:
    """The drawn partners a NoLoCo node waits for up to the round timeout (see the module's
    docstring): the counted peers and those they endorse; None before any proof (every record
    counts, as for every decision then). A peer they vouched for is a newcomer, waited for once."""
    who = counted(proven, anchors, records)
    if who is None:
        return None
    return who | endorsed(who, records)


def deciding(records: Iterable[NodeRecord], who: Collection[str] | None) -> list[NodeRecord]:
    """The records of `who` (all of them when None)."""
    return [r for r in records if who is None or r.peer_id in who]


def vouched_by(records: Mapping[str, NodeRecord], who: Collection[str]) -> set[str]:
    """The peers that those of `who` with a record vouched for (took their state)."""
    return {peer for voucher in who if voucher in records for peer in records[voucher].vouched}


class Proofs:
    """Our bounded memory of proven peers, and of the newcomers the barrier already waited for."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self._lock = threading.Lock()  # proved on the round loop, read by the barrier's thread too
        self._last: dict[str, int] = {}  # peer → our round whose mean last used its contribution
        self._round = -1  # the latest round we proved anyone in
        self._waited: dict[str, int] = {}  # newcomer → the round the barrier waited for it
        # the last round a newcomer was not ready in its grace, and those newcomers (see newcomers)
        self._late: tuple[int, frozenset[str]] | None = None
        self._missed = 0  # matchmakings in a row with only unproven peers ready that found nobody
        self._next_try = -1  # the first round such a matchmaking is tried again

    def prove(self, round_: int, peers: Iterable[str]) -> bool:
        """`peers`' contributions went into the mean we applied in `round_`; whether the set changed."""
        others = [peer for peer in peers if peer != self.peer_id]
        with self._lock:
            before = self._current()
            self._round = max(self._round, round_)
            for peer in others:
                self._last[peer] = max(round_, self._last.get(peer, round_))
            # bounded: the most recently proven first (the record lists MAX_PROVEN of them)
            recent = sorted(self._last.items(), key=lambda item: -item[1])[:MAX_PROVEN]
            self._last = dict(recent)
            if others:
                self._missed, self._next_try = 0, -1  # someone showed up: unproven peers are worth a try again
            return self._current() != before

    def proven(self) -> frozenset[str]:
        """The peers proven within the last PROOF_ROUNDS rounds."""
        with self._lock:
            return self._current()

    def _current(self) -> frozenset[str]:
        return frozenset(p for p, at in self._last.items() if at > self._round - PROOF_ROUNDS)

    def newcomers(self, candidates: Iterable[str], round_: int) -> set[str]:
        """Those of `candidates` (unproven, vouched for) the barrier may wait for in `round_`: each
        once only, in the first round it was waited for, and none while a newcomer that was late
        within the last PROOF_ROUNDS rounds is still unproven (fresh identities that take our
        state and never get ready would otherwise buy one grace each)."""
        with self._lock:
            late = self._late
            blocked = late is not None and round_ - late[0] < PROOF_ROUNDS and not late[1] & self._current()
            waited = set()
            for peer in candidates:
                first = self._waited.get(peer)
                if first is None and not blocked:  # withheld: it may still be waited for once unblocked
                    first = self._waited[peer] = round_
                if first == round_:
                    waited.add(peer)
            while len(self._waited) > MAX_NEWCOMERS:
                del self._waited[next(iter(self._waited))]
            return waited

    def granted(self, round_: int) -> set[str]:
        """The newcomers the barrier waits for in `round_` (see newcomers)."""
        with self._lock:
            return {peer for peer, first in self._waited.items() if first == round_}

    def late_newcomers(self, round_: int, peers: Collection[str]) -> None:
        """The barrier of `round_` gave up on the newcomers `peers` (not ready in their grace)."""
        if peers:
            with self._lock:
                self._late = (round_, frozenset(peers))

    def may_matchmake_strangers(self, round_: int) -> bool:
        """Whether to matchmake in `round_` when every peer ready for it is unproven (see the
        module's docstring)."""
        with self._lock:
            return round_ >= self._next_try

    def strangers_missed(self, round_: int) -> int:
        """A matchmaking of `round_` with no counted peer expected found nobody: the rounds skipped next."""
        with self._lock:
            self._missed += 1
            skip = STRANGER_SKIPS[min(self._missed, len(STRANGER_SKIPS)) - 1]
            self._next_try = round_ + 1 + skip
            return skip
