"""A thread-safe record of what the node is doing, read by the status server.

The training thread writes, the server thread reads; both hold the lock only to copy a dict or a
list, so a slow HTTP client can never stall training. History is bounded so a node that runs for
months keeps a constant footprint.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

HISTORY_LIMIT = 2000  # rounds kept for the charts; older ones drop off the front


class Telemetry:
    def __init__(self, **initial: Any):
        self._lock = threading.Lock()
        self._values: dict[str, Any] = {"started_at": time.time(), "bytes_sent": 0, "bytes_received": 0, **initial}
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LIMIT)
        self._peers: list[dict[str, Any]] = []

    def update(self, **values: Any) -> None:
        with self._lock:
            self._values.update(values)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._values)

    def record_round(self, stats: dict[str, Any]) -> None:
        """One finished round: the point behind every chart (see README, /api/history)."""
        with self._lock:
            self._history.append(dict(stats))

    def history(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._history)

    def set_peers(self, rows: list[dict[str, Any]]) -> None:
        with self._lock:
            self._peers = [dict(row) for row in rows]

    def peers(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(row) for row in self._peers]
