"""Presence records: who is in the run, with which config, how far each node has got, and its stats.

Every node keeps one record under the DHT key `<run_id>_nodes`, refreshed by a heartbeat so that a
crashed node's record expires on its own. The subkey carries the node's public key, so hivemind's
RSASignatureValidator signs the record and nobody else can overwrite it; the same pydantic schema
is enforced by the DHT on store (SchemaValidator) and by us on read, so a peer that writes nonsense
is ignored and cannot break the barrier or the dashboard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pydantic.v1 as pydantic  # hivemind's SchemaValidator speaks pydantic v1
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils import ValueWithExpiration, get_dht_time

logger = logging.getLogger(__name__)

RECORD_TTL = 15.0  # seconds; a node silent for this long is treated as gone
NodeCount = pydantic.conint(strict=True, ge=0)
Seconds = pydantic.confloat(strict=True, ge=0)


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

    class Config:
        extra = pydantic.Extra.forbid


class NodeValue(pydantic.BaseModel):
    peer_id: pydantic.StrictStr
    fingerprint: pydantic.StrictStr
    config: dict[pydantic.StrictStr, Any]
    round: pydantic.StrictInt
    ready_round: pydantic.StrictInt
    exchanged_round: pydantic.StrictInt
    digest: pydantic.StrictStr
    left: pydantic.StrictBool = False
    stats: NodeStats = NodeStats()


class RunRecords(pydantic.BaseModel):
    nodes: dict[BytesWithPublicKey, NodeValue]  # type: ignore[valid-type]


def validators(run_id: str) -> list[Any]:
    """The DHT record validators every node of a run installs (schema first, then signatures)."""
    return [SchemaValidator(RunRecords, allow_extra_keys=True, prefix=run_id), RSASignatureValidator()]


@dataclass(frozen=True)
class NodeRecord:
    peer_id: str
    fingerprint: str
    config: dict[str, Any]
    round: int  # the round the node is training or averaging
    ready_round: int  # the last round whose inner phase it finished (-1: none yet)
    digest: str  # hash of the node's φ at the start of `round`
    stats: dict[str, Any] = field(default_factory=dict)
    exchanged_round: int = -1  # the last round whose exchange this node completed

    def may_still_fetch(self, round_: int) -> bool:
        """Whether this node may still fetch a payload of `round_`: it has neither completed that
        round's exchange nor gone past the round after it (an overlapped exchange of round r runs
        during round r + 1). A group member whose fetch failed moves on without it."""
        return self.exchanged_round < round_ and self.round <= round_ + 1

    def to_wire(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "fingerprint": self.fingerprint, "config": self.config,
                "round": self.round, "ready_round": self.ready_round, "exchanged_round": self.exchanged_round,
                "digest": self.digest, "left": False,
                # every field spelled out: the DHT's SchemaValidator refuses values that need defaults filled in
                "stats": NodeStats(**self.stats).dict()}

    @classmethod
    def from_wire(cls, value: Any, left: bool = False) -> NodeRecord | None:
        """A live node's record (a departed node's, with `left`), or None for anything else."""
        try:
            parsed = NodeValue.parse_obj(value)
        except (pydantic.ValidationError, TypeError):
            return None
        if parsed.left != left:
            return None
        return cls(parsed.peer_id, parsed.fingerprint, parsed.config, parsed.round, parsed.ready_round,
                   parsed.digest, parsed.stats.dict(), parsed.exchanged_round)


def records_key(run_id: str) -> str:
    return f"{run_id}_nodes"


def owned_subkey(peer_id: str) -> bytes:
    """Our peer id followed by our public key: the key makes hivemind sign the record."""
    return peer_id.encode() + RSASignatureValidator().local_public_key


def publish(dht: DHT, run_id: str, record: NodeRecord) -> None:
    dht.store(records_key(run_id), subkey=owned_subkey(record.peer_id), value=record.to_wire(),
              expiration_time=get_dht_time() + RECORD_TTL)


def withdraw(dht: DHT, run_id: str, record: NodeRecord) -> None:
    """Mark our record as left, so peers stop waiting for us at once.

    The DHT keeps the value with the latest expiration, so the marker must outlive the record it
    replaces; readers skip it like an expired record.
    """
    dht.store(records_key(run_id), subkey=owned_subkey(record.peer_id), value={**record.to_wire(), "left": True},
              expiration_time=get_dht_time() + RECORD_TTL + 1)


def fetch(dht: DHT, run_id: str) -> tuple[dict[str, NodeRecord], dict[str, NodeRecord]]:
    """The run's well-formed records by peer id: the live nodes', and those of nodes that left
    within the last RECORD_TTL seconds (as they were when they left)."""
    found = dht.get(records_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}, {}
    live: dict[str, NodeRecord] = {}
    departed: dict[str, NodeRecord] = {}
    for subkey, item in found.value.items():
        if not (isinstance(subkey, bytes) and isinstance(item, ValueWithExpiration)
                and item.expiration_time > get_dht_time()):
            continue
        for left, into in ((False, live), (True, departed)):
            record = NodeRecord.from_wire(item.value, left=left)
            # the signed subkey must name the peer the record claims to be
            if record and subkey.startswith(record.peer_id.encode()):
                into[record.peer_id] = record
    return live, departed


def canonical_digest(nodes: Iterable[NodeRecord], round_: int) -> str | None:
    """The φ digest most nodes at the start of `round_` hold; a tie goes to the smallest peer id's.

    Every node evaluates this on the same records, so all reach the same verdict.
    """
    holders: dict[str, list[str]] = {}
    for record in nodes:
        if record.round == round_ and record.digest:
            holders.setdefault(record.digest, []).append(record.peer_id)
    if not holders:
        return None
    return min(holders, key=lambda digest: (-len(holders[digest]), min(holders[digest])))


def config_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """A short 'key=theirs (ours: value)' list naming what makes two configs incompatible."""
    keys = sorted(set(ours) | set(theirs))
    diffs = [f"{k}={theirs.get(k)} (ours: {ours.get(k)})" for k in keys if ours.get(k) != theirs.get(k)]
    return ", ".join(diffs) or "unknown difference"
