"""The swarm table (/api/peers, the dashboard, `diloco-node status`) from the nodes' presence records."""

from __future__ import annotations

from typing import Any

from diloco_node.swarm.records import NodeRecord


def swarm_row(record: NodeRecord, is_self: bool, bounded: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """One row of the swarm table (/api/peers) from a node's published record; `bounded`: how many of
    its contributions our aggregator clipped and rejected (our view, not its claim)."""
    stats = record.stats
    moved = stats.get("last_round_bytes_sent", 0) + stats.get("last_round_bytes_received", 0)
    seconds = stats.get("last_exchange_seconds") or 0.0
    return {"peer_id": record.peer_id, "label": stats.get("label", ""), "rounds": stats.get("rounds", 0),
            "bytes_sent": stats.get("bytes_sent", 0), "bytes_received": stats.get("bytes_received", 0),
            "wire_bytes_sent": stats.get("wire_bytes_sent"), "wire_bytes_received": stats.get("wire_bytes_received"),
            "last_round_bytes_sent": stats.get("last_round_bytes_sent", 0),
            "last_round_bytes_received": stats.get("last_round_bytes_received", 0),
            "bandwidth_bps": 8 * moved / seconds if seconds > 0 else None,
            "utilization": stats.get("utilization"), "last_seen": stats.get("time") or None, "is_self": is_self,
            "clipped": bounded[0], "rejected": bounded[1]}
