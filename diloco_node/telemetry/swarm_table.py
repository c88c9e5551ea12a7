"""The swarm table (/api/peers, the dashboard, `diloco-node status`) from the stats each node publishes
with its presence record (their fields: record.PEER_STATS_FIELDS, what RoundReporter.peer_stats makes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco_node.telemetry.record import PEER_STATS_FIELDS

# what a row shows of a peer's stats while the peer has not published the field (yet)
_MISSING: dict[str, Any] = {"label": "", "rounds": 0, "bytes_sent": 0, "bytes_received": 0,
                            "last_round_bytes_sent": 0, "last_round_bytes_received": 0}
_NOT_COLUMNS = ("last_exchange_seconds", "time")  # shown as bandwidth_bps and last_seen instead


def swarm_row(peer_id: str, stats: Mapping[str, Any], is_self: bool,
              bounded: tuple[int, int] = (0, 0), batch_tokens: int = 0) -> dict[str, Any]:
    """One row of the swarm table (/api/peers) from a node's published stats; `bounded`: how many of
    its contributions our aggregator clipped and rejected (our view, not its claim); `batch_tokens`:
    the run's tokens per batch (batch size × sequence length), from which `batches_per_step` (k,
    what --speed-spent batch gives a fast node a step; 1 otherwise) follows from its steps and tokens."""
    moved = stats.get("last_round_bytes_sent", 0) + stats.get("last_round_bytes_received", 0)
    seconds = stats.get("last_exchange_seconds") or 0.0
    steps, tokens = stats.get("last_round_inner_steps"), stats.get("last_round_tokens")
    return {"peer_id": peer_id,
            **{name: stats.get(name, _MISSING.get(name)) for name in PEER_STATS_FIELDS if name not in _NOT_COLUMNS},
            "bandwidth_bps": 8 * moved / seconds if seconds > 0 else None, "last_seen": stats.get("time") or None,
            "is_self": is_self, "clipped": bounded[0], "rejected": bounded[1],
            "batches_per_step": tokens / (steps * batch_tokens) if steps and tokens and batch_tokens > 0 else None}
