"""A thread-safe record of what the node is doing, read by the status server.

The training thread writes, the server thread reads; both hold the lock only to copy a dict or a
list, so a slow HTTP client can never stall training. History is bounded so a node that runs for
months keeps a constant footprint.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from diloco_node.telemetry.record import ROUND_STATUS_FIELDS

# Every field docs/operations.md documents for /api/status: each is there from the first response on, null
# until it is known (a client polling right after start-up finds the same keys as later). The node's
# own fields are listed here; those a finished round sets are declared by the round record.
NODE_STATUS_FIELDS = (
    "run_id", "peer_id", "maddrs", "model", "parameters", "inner_step", "eval_loss_initial", "peers",
    "wire_bytes_sent", "wire_bytes_received", "compression", "exchanging_round", "algorithm", "label",
    "uptime_seconds", "isolated", "isolated_since", "parallel", "local_ranks", "reachability",
    "micro_batch_size", "upload_limit_bytes_per_second", "download_limit_bytes_per_second",
    "egress_bytes_per_second", "ingress_bytes_per_second", "fragments", "stream_egress_bytes_per_second",
    "stream_ingress_bytes_per_second", "peer_streams", "state_download")
STATUS_FIELDS = NODE_STATUS_FIELDS + ROUND_STATUS_FIELDS
HISTORY_LIMIT = 2000  # rounds kept for the charts; older ones drop off the front
# Round-time histogram bounds (seconds). Counted over every round since start, not just the kept
# history, so Prometheus never sees its buckets shrink.
ROUND_SECONDS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Telemetry:
    def __init__(self, **initial: Any):
        self._lock = threading.Lock()
        self._values: dict[str, Any] = {**dict.fromkeys(STATUS_FIELDS), "started_at": time.time(), "bytes_sent": 0,
                                        "bytes_received": 0, "contributions_clipped": 0,
                                        "contributions_rejected": 0, **initial}
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LIMIT)
        self._peers: list[dict[str, Any]] = []
        self._round_buckets = [0] * len(ROUND_SECONDS_BUCKETS)
        self._round_count, self._round_sum = 0, 0.0
        self._refresh: list[Callable[[], None]] = []
        self._unhealthy: str | None = None  # why /healthz fails (a helper process died), None while healthy

    def refresh_with(self, refresh: Callable[[], None]) -> None:
        """`refresh` (one more of them) brings live figures (wire bytes, per-peer stream rates) up to
        date before a reader's fresh snapshot."""
        self._refresh.append(refresh)

    def update(self, **values: Any) -> None:
        with self._lock:
            self._values.update(values)

    def clear_if(self, key: str, value: Any) -> None:
        """Set `key` to None only if it still holds `value` (a later writer's value stays)."""
        with self._lock:
            if self._values.get(key) == value:
                self._values[key] = None

    def mark_unhealthy(self, why: str) -> None:
        with self._lock:
            self._unhealthy = why

    def unhealthy(self) -> str | None:
        with self._lock:
            return self._unhealthy

    def snapshot(self, fresh: bool = False) -> dict[str, Any]:
        if fresh:
            for refresh in self._refresh:
                refresh()
        with self._lock:
            return dict(self._values)

    def record_round(self, stats: dict[str, Any]) -> None:
        """One finished round: the point behind every chart (see docs/operations.md, /api/history)."""
        with self._lock:
            self._history.append(dict(stats))
            seconds = stats.get("round_seconds")
            if seconds is not None:
                self._round_count += 1
                self._round_sum += seconds
                for index, bound in enumerate(ROUND_SECONDS_BUCKETS):
                    self._round_buckets[index] += seconds <= bound

    def round_seconds_histogram(self) -> tuple[list[tuple[float, int]], int, float]:
        """(cumulative (bound, count) pairs, count, sum) over all rounds since start."""
        with self._lock:
            buckets = list(zip(ROUND_SECONDS_BUCKETS, self._round_buckets, strict=True))
            return buckets, self._round_count, self._round_sum

    def history(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._history)

    def set_peers(self, rows: list[dict[str, Any]]) -> None:
        with self._lock:
            self._peers = [dict(row) for row in rows]

    def peers(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(row) for row in self._peers]
