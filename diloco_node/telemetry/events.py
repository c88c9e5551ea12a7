"""Machine-readable events: one JSON object per line (`--events -` for stdout, or a file path).

What launchers, tests, benchmarks and the demo read instead of parsing log lines: `joined`,
`resumed`, `synced`, `round` (every figure of the round's log line and status history entry),
`settled` and `left`. Each carries `event` and `time` (unix seconds).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import IO, Any

from diloco_node.errors import NodeError


class EventsError(NodeError, RuntimeError):
    """The events file cannot be written; one line."""


class Events:
    def __init__(self, target: str):
        """`target`: '' (no events), '-' (stdout) or a file path (appended to)."""
        self._file: IO[str] | None = None
        if target == "-":
            self._file = sys.stdout
        elif target:
            try:
                self._file = open(target, "a", buffering=1)  # noqa: SIM115 - closed by close()
            except OSError as exc:
                raise EventsError(f"events file '{target}' cannot be written: {exc.strerror}") from None
        self._lock = threading.Lock()  # the round engine and the exchange thread may both emit

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None and self._file is not sys.stdout:
            self._file.close()
