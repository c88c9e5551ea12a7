"""The presence record as we believe it: its schema, and what the run's records decide together.

A record is free: anyone can publish any number of them (docs/architecture.md §9, "free
identities"). So what one may say is bounded by a schema, enforced by the DHT on store (swarm/
records.py installs it) and by us on read: a peer that writes nonsense is ignored and cannot break
the barrier or the dashboard. Whose records count is trust/proofs.py's; here is what the counted
ones decide together: the canonical φ of a round (`canonical_digest`, its tie-break by the round's
draw, `tie_order`) and the state a joiner takes (`reference_state`). Reading and writing the records
in the DHT is swarm/records.py's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pydantic.v1 as pydantic  # hivemind's SchemaValidator speaks pydantic v1

MAX_VOUCHED = 8
MAX_PROVEN = 16  # peers a record lists as proven by its node (trust/proofs.py)
MAX_ROUND = 1 << 40  # no run gets near; a larger round is a lie that would overflow what we publish
Token = pydantic.constr(strict=True, max_length=1024)
NodeCount = pydantic.conint(strict=True, ge=0, le=1 << 62)
Seconds = pydantic.confloat(strict=True, ge=0, le=1e12)
ByteRate = pydantic.confloat(strict=True, ge=0, le=1e13)  # bytes/s: 80 Tbit/s is no link of today
PeerIdText = pydantic.constr(strict=True, max_length=64)  # libp2p's base58 ids are 46 or 52 characters
Hash = pydantic.constr(strict=True, max_length=64)  # our digests and fingerprints are 16 hex digits
Round = pydantic.conint(strict=True, ge=-1, le=MAX_ROUND)


class NodeStats(pydantic.BaseModel):
    """What the swarm table shows about a node; published with its presence every heartbeat."""

    label: pydantic.constr(strict=True, max_length=64) = ""  # type: ignore[valid-type]
    rounds: NodeCount = 0  # type: ignore[valid-type]
    bytes_sent: NodeCount = 0  # type: ignore[valid-type]
    bytes_received: NodeCount = 0  # type: ignore[valid-type]
    last_round_bytes_sent: NodeCount = 0  # type: ignore[valid-type]
    last_round_bytes_received: NodeCount = 0  # type: ignore[valid-type]
    wire_bytes_sent: NodeCount | None = None  # type: ignore[valid-type]  # None: the node can't measure its wire
    wire_bytes_received: NodeCount | None = None  # type: ignore[valid-type]
    last_exchange_seconds: Seconds = 0.0  # type: ignore[valid-type]
    utilization: pydantic.confloat(strict=True, ge=0, le=1) | None = None  # type: ignore[valid-type]
    time: Seconds = 0.0  # type: ignore[valid-type]  # unix time of the last update
    # what its last round trained (--round-seconds: it differs per node, docs/architecture.md §13)
    last_round_inner_steps: NodeCount = 0  # type: ignore[valid-type]
    last_round_tokens: pydantic.confloat(strict=True, ge=0, le=1e15) = 0.0  # type: ignore[valid-type]
    last_round_tokens_per_second: pydantic.confloat(strict=True, ge=0, le=1e15) = 0.0  # type: ignore[valid-type]
    # its caps (0: none) and its link's mean rates over its last round (None: unmeasured), bytes/s
    upload_limit_bytes_per_second: ByteRate = 0.0  # type: ignore[valid-type]
    download_limit_bytes_per_second: ByteRate = 0.0  # type: ignore[valid-type]
    egress_bytes_per_second: ByteRate | None = None  # type: ignore[valid-type]
    ingress_bytes_per_second: ByteRate | None = None  # type: ignore[valid-type]
    last_round_weight: pydantic.confloat(strict=True, ge=0, le=1) = 0.0  # type: ignore[valid-type]  # its share of the mean
    # what its aggregator's token cap and clip took from its last round's group (outer/aggregate.py)
    last_round_weight_removed: pydantic.confloat(strict=True, ge=0, le=1) = 0.0  # type: ignore[valid-type]

    class Config:
        extra = pydantic.Extra.forbid


class NodeValue(pydantic.BaseModel):
    peer_id: PeerIdText  # type: ignore[valid-type]
    fingerprint: Hash  # type: ignore[valid-type]
    round: Round  # type: ignore[valid-type]
    ready_round: Round  # type: ignore[valid-type]
    exchanged_round: Round  # type: ignore[valid-type]
    digest: Hash  # type: ignore[valid-type]
    served_round: Round = -1  # type: ignore[valid-type]
    served_digest: Hash = ""  # type: ignore[valid-type]
    left: pydantic.StrictBool = False
    stats: NodeStats = NodeStats()
    admission: Token = ""  # type: ignore[valid-type]  # permissioned runs: the owner's token for this peer
    vouched: pydantic.conlist(PeerIdText, max_items=MAX_VOUCHED) = []  # type: ignore[valid-type]
    client: pydantic.StrictBool = False
    proven: pydantic.conlist(PeerIdText, max_items=MAX_PROVEN) = []  # type: ignore[valid-type]


@dataclass(frozen=True)
class NodeRecord:
    peer_id: str
    fingerprint: str
    round: int  # the round the node is training or averaging
    ready_round: int  # the last round whose inner phase it finished (-1: none yet)
    digest: str  # hash of the node's φ at the start of `round`
    stats: dict[str, Any] = field(default_factory=dict)
    exchanged_round: int = -1  # the last round whose exchange this node completed
    admission: str = ""
    vouched: tuple[str, ...] = ()  # joiners we handed rounds in flight: they may fetch those rounds' payloads
    # the state the node serves to joiners (OuterState.served): the first round whose mean it
    # lacks and the digest of φ and the momentum as sent; equal on nodes that applied the same means
    served_round: int = -1
    served_digest: str = ""
    client: bool = False  # accepts no inbound connection (reachability.py): owns no part, serves nothing
    proven: tuple[str, ...] = ()  # peers whose checked work this node used recently (trust/proofs.py)

    def may_still_fetch(self, round_: int) -> bool:
        """Whether this node may still fetch a payload of `round_`: it has neither completed that
        round's exchange nor gone past the round after it (an overlapped exchange of round r runs
        during round r + 1). A group member whose fetch failed moves on without it."""
        return self.exchanged_round < round_ and self.round <= round_ + 1

    def to_wire(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "fingerprint": self.fingerprint, "round": self.round,
                "ready_round": self.ready_round, "exchanged_round": self.exchanged_round,
                "digest": self.digest, "served_round": self.served_round, "served_digest": self.served_digest,
                "left": False,
                # every field spelled out: the DHT's SchemaValidator refuses values that need defaults filled in
                "stats": NodeStats(**self.stats).dict(), "admission": self.admission,
                "vouched": list(self.vouched), "client": self.client, "proven": list(self.proven)}

    @classmethod
    def from_wire(cls, value: Any, left: bool = False) -> NodeRecord | None:
        """A live node's record (a departed node's, with `left`), or None for anything else."""
        parsed = parse_record(value)
        return parsed[0] if parsed is not None and parsed[1] == left else None


def parse_record(value: Any) -> tuple[NodeRecord, bool] | None:
    """A record on the wire → the record and whether its node left; None when malformed."""
    try:
        parsed = NodeValue.parse_obj(value)
    except (pydantic.ValidationError, TypeError):
        return None
    return NodeRecord(parsed.peer_id, parsed.fingerprint, parsed.round, parsed.ready_round,
                      parsed.digest, parsed.stats.dict(), parsed.exchanged_round, parsed.admission,
                      tuple(parsed.vouched), parsed.served_round, parsed.served_digest, parsed.client,
                      tuple(parsed.proven)), parsed.left


def canonical_digest(nodes: Iterable[NodeRecord], round_: int, served: bool = False) -> str | None:
    """The φ digest more nodes at the start of `round_` hold than any other (`served`: the digest of
    the state most nodes serve with `round_` as its settled round); None when none is held. A tie
    goes to the digest of the holder that comes first in the round's draw (`tie_order`).

    Every node evaluates this on the same records, so all reach the same verdict, and one side of
    an even split (a pair that split) re-syncs from the other: left to nobody, a split pair stayed
    split for good and no joiner could find a state two servers agree on. The tie-break by peer id
    went to whoever generated the smaller key (an attacker, in a pair), and one by the digests to
    whoever ground its φ; the round's draw gives any key about half the ties, and what a winner can
    make the other install is bounded by outer/reach.py (docs/architecture.md §9).
    """
    holders: dict[str, list[str]] = {}
    for record in nodes:
        at, digest = (record.served_round, record.served_digest) if served else (record.round, record.digest)
        if at == round_ and digest:
            holders.setdefault(digest, []).append(record.peer_id)
    if not holders:
        return None
    most = max(len(peers) for peers in holders.values())
    tied = {digest: peers for digest, peers in holders.items() if len(peers) == most}
    return min(tied, key=lambda digest: min(tie_order(round_, peer) for peer in tied[digest]))


def tie_order(round_: int, peer: str) -> bytes:
    """Where `peer` comes in `round_`'s draw: a hash of both, so no key comes first in every round
    (each comes first in about half of them against another), and every node draws alike."""
    return hashlib.sha256(f"{round_}:{peer}".encode()).digest()


def reference_state(nodes: Iterable[NodeRecord]) -> tuple[int, str] | None:
    """The served state (settled round, digest) most of `nodes` announce: the one a joiner takes,
    so that one peer's claim alone cannot choose it (`nodes`: the records that decide, see
    trust/proofs.py, so that free identities cannot outvote proven peers). None when two or more
    nodes serve and no state has more announcers than every other and at least two of them: then
    nothing tells an honest server from a lying one (a tie never goes to the later round, which
    anyone can claim)."""
    counts: dict[tuple[int, str], int] = {}
    for record in nodes:
        if record.served_digest:
            state = (record.served_round, record.served_digest)
            counts[state] = counts.get(state, 0) + 1
    if not counts:
        return None
    ranked = sorted(counts.values(), reverse=True)
    if len(counts) == 1 and ranked[0] == 1:
        return next(iter(counts))  # the only node serving
    if ranked[0] < 2 or (len(ranked) > 1 and ranked[1] == ranked[0]):
        return None
    return max(counts, key=lambda state: counts[state])
