"""The watchdog: a node whose hivemind helper died exits instead of waiting forever
(docs/architecture.md §4 "Bounded waits", §10).

hivemind's DHT and averager run in forked processes, the DHT's with the p2pd daemon below it
(the averager talks through the same daemon), and every hivemind call passes its result through
torch's shared-memory manager, a process of ours too. Every call of ours to them is bounded
(bounded.py), but a node whose helper is gone can only fail its rounds for ever while `/healthz`
says ok. So a thread of its own looks each second: a helper, p2pd or the manager that exited, or
calls that time out in a row, mean the node must stop and be restarted (docker's and systemd's
restart policies do that on exit 1).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable

from diloco_node import procs
from diloco_node.swarm import bounded

logger = logging.getLogger(__name__)

WATCH_INTERVAL = 1.0  # seconds between looks: a dead helper is noticed well within the 30 s promised
# Helper calls in a row that timed out (20 s each for DHT reads and stores): a helper that hangs
# is as useless as a dead one; three rule out one slow answer on a loaded machine.
TIMEOUT_STREAK = 3
P2PD = "p2pd"
SHM_MANAGER = "torch_shm_manager"


class Watchdog:
    """Calls `on_dead(why)` once, on its own thread, when a helper died; `why` is one line."""

    def __init__(self, helpers: dict[str, multiprocessing.Process]):
        self._helpers = helpers  # what users know it by ("DHT", "averager") -> its process
        self._daemons: dict[int, str] = {}  # p2pd pid -> the helper that started it
        self._managers: list[int] = []
        self._stopped = threading.Event()
        # held while looking and while stopping: a helper shut down on purpose is never taken for dead
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="swarm-watchdog", daemon=True)
        self._on_dead: Callable[[str], None] | None = None

    def start(self, on_dead: Callable[[str], None]) -> None:
        self._on_dead = on_dead
        for name, process in self._helpers.items():
            if process.pid is not None:
                for pid in procs.descendants(process.pid):
                    if procs.program(pid) == P2PD:
                        self._daemons[pid] = name
        # torch's shared-memory manager, which every hivemind call needs for its future (MPFuture)
        self._managers = [pid for pid in procs.children(os.getpid()) if procs.program(pid) == SHM_MANAGER]
        self._thread.start()

    def stop(self) -> None:
        """Before the helpers are shut down on purpose."""
        with self._lock:
            self._stopped.set()

    def dead(self) -> str | None:
        """Why the swarm's helpers can no longer serve us (one line), None while they can."""
        for name, process in self._helpers.items():
            if not process.is_alive():
                return f"hivemind's {name} process (pid {process.pid}) died (exit code {process.exitcode})"
        for pid, name in self._daemons.items():
            if not procs.alive(pid):
                return f"the p2pd daemon (pid {pid}) of hivemind's {name} process died"
        for pid in self._managers:
            if not procs.alive(pid):
                return f"torch's shared-memory manager (pid {pid}), which hivemind's calls need, died"
        if (streak := bounded.timeout_streak()) >= TIMEOUT_STREAK:
            return f"hivemind's helper processes left {streak} calls in a row unanswered"
        return None

    def end_orphans(self) -> None:
        """A p2pd whose helper died lives on, holding the node's listen port (its idle timeout ends
        it only after 30 s without clients): end it, so that a restart can listen there at once."""
        for pid, name in self._daemons.items():
            if not self._helpers[name].is_alive() and procs.alive(pid) and procs.program(pid) == P2PD:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _loop(self) -> None:
        while not self._stopped.wait(WATCH_INTERVAL):
            with self._lock:
                why = None if self._stopped.is_set() else self.dead()
                if why is None:
                    continue
                self._stopped.set()
            bounded.give_up(why)
            self.end_orphans()
            if self._on_dead is not None:
                self._on_dead(why)
            return
