"""A thread-safe snapshot of what the node is doing, read by the status server.

The training thread writes, the server thread reads; both only hold the lock for a dict copy,
so a slow HTTP client can never stall training.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Telemetry:
    def __init__(self, **initial: Any):
        self._lock = threading.Lock()
        self._values: dict[str, Any] = {"started_at": time.time(), "bytes_sent": 0, "bytes_received": 0, **initial}

    def update(self, **values: Any) -> None:
        with self._lock:
            self._values.update(values)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._values)
