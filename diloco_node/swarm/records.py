"""Presence records: who is in the run, with which config, and how far each node has got.

Every node keeps one record under the DHT key `<run_id>_nodes`, subkey = its peer id, refreshed by
a heartbeat so that a crashed node's record expires on its own. Records are plain dicts checked on
read: anything malformed is ignored, so a peer that writes nonsense cannot break the barrier.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.utils import ValueWithExpiration, get_dht_time

logger = logging.getLogger(__name__)

RECORD_TTL = 15.0  # seconds; a node silent for this long is treated as gone


@dataclass(frozen=True)
class NodeRecord:
    peer_id: str
    fingerprint: str
    config: dict[str, Any]
    round: int  # the round the node is training or averaging
    ready_round: int  # the last round whose inner phase it finished (-1: none yet)
    digest: str  # hash of the node's φ at the start of `round`

    def to_wire(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "config": self.config,
                "round": self.round, "ready_round": self.ready_round, "digest": self.digest}

    @classmethod
    def from_wire(cls, peer_id: str, value: Any) -> NodeRecord | None:
        if not isinstance(value, dict) or value.get("left"):
            return None
        fingerprint, config = value.get("fingerprint"), value.get("config")
        round_, ready, digest = value.get("round"), value.get("ready_round"), value.get("digest")
        if not (isinstance(fingerprint, str) and isinstance(config, dict) and isinstance(digest, str)
                and isinstance(round_, int) and isinstance(ready, int)):
            return None
        return cls(peer_id, fingerprint, config, round_, ready, digest)


def records_key(run_id: str) -> str:
    return f"{run_id}_nodes"


def publish(dht: DHT, run_id: str, record: NodeRecord) -> None:
    dht.store(records_key(run_id), subkey=record.peer_id, value=record.to_wire(),
              expiration_time=get_dht_time() + RECORD_TTL)


def withdraw(dht: DHT, run_id: str, record: NodeRecord) -> None:
    """Mark our record as left, so peers stop waiting for us at once.

    The DHT keeps the value with the latest expiration, so the marker must outlive the record it
    replaces; readers skip it like an expired record.
    """
    dht.store(records_key(run_id), subkey=record.peer_id, value={**record.to_wire(), "left": True},
              expiration_time=get_dht_time() + RECORD_TTL + 1)


def fetch(dht: DHT, run_id: str) -> dict[str, NodeRecord]:
    """All live, well-formed records of the run, by peer id."""
    found = dht.get(records_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {}
    for subkey, item in found.value.items():
        if isinstance(subkey, str) and isinstance(item, ValueWithExpiration):
            record = NodeRecord.from_wire(subkey, item.value)
            if record is not None and item.expiration_time > get_dht_time():
                records[subkey] = record
    return records


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
