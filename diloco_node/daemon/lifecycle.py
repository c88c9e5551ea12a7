"""How the node's process stops: the signals users send, and the last resort when start-up is stuck.

- The first SIGINT (Ctrl-C), SIGTERM (`kill`, `docker stop`, systemd) or SIGHUP (the terminal
  or ssh session closed, `kill -HUP`) asks the node to stop at the next safe point: it settles
  what is in flight, saves, leaves the swarm and exits 0. SIGHUP's default would end the process
  on the spot, without its stop path; a node reloads nothing, so a hangup means stop.
- A second one stops at once (exit 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP), as users
  expect from a terminal program. Checkpoints are written atomically (checkpoint.py), so the last saved round
  survives even that.
- hivemind forks helper processes (DHT, averager) that then start p2pd. A fork inherits the
  node's Python signal handlers; a forked helper that ran them would "stop at the next safe point"
  of a node it is not, and live on. What every helper does first instead is forks.py's (a root
  leaf: the status server and the local ranks need it too).

SIGUSR1 prints every thread's stack to stderr (faulthandler) and the node goes on: what to send a
node that seems stuck before stopping it, and what the tests send one that does not exit in time.

hivemind's averager sets SIGINT to SIG_IGN in the process that starts it, so `install` must be
called again once the swarm has started; `StopSignals.install` is idempotent for that reason.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
from types import FrameType

from diloco_node.forks import STOP_SIGNALS

logger = logging.getLogger(__name__)



# How long a stop that arrives during start-up may take. Start-up runs C code that never returns to
# the interpreter when a helper it waits on has died (torch's shared-memory manager, seen under load:
# hivemind's first shared tensor then spins), and Python runs signal handlers between bytecodes
# only; so the stop is also watched from a thread, through the wakeup fd the C-level handler writes
# to. A healthy start-up checks the stop request within seconds (the state download, the wait for
# peers); one that has not ended in this long is stuck, and the node ends with exit 1.
STARTUP_STOP_GRACE = 30.0


class StopSignals:
    """The first stop signal sets `requested`; a second ends the process at once. While `starting`,
    a stop the main thread cannot act on (stuck in C code) ends the process after STARTUP_STOP_GRACE."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.starting = True  # cleared by start-up once it has returned (startup.start)
        self._received: int | None = None
        self._wakeup: int | None = None  # the read end of the pipe the C-level handler writes to

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        if self._wakeup is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self._wakeup = read
            threading.Thread(target=self._guard_startup, name="stop-guard", daemon=True).start()

    def _guard_startup(self) -> None:
        """On the first signal during start-up: the last resort, should start-up never return."""
        assert self._wakeup is not None
        while os.read(self._wakeup, 64):
            if self.starting:
                exit_later(STARTUP_STOP_GRACE, 1, f"stop signal received during start-up, which has not ended "
                                                  f"{STARTUP_STOP_GRACE:.0f}s later; ending it")
                return

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # Runs on the main thread between two bytecodes. The first signal logs (logging's locks are
        # re-entrant); the second must end the process whatever the main thread is stuck in, so it
        # writes its line straight to stderr and exits without running any cleanup.
        name = signal.Signals(signum).name
        if self._received is None:
            self._received = signum
            logger.info("received %s; stopping at the next safe point (send it again to stop now)", name)
            self.requested.set()
            return
        os.write(2, f"diloco-node: received {name} again; stopping now without saving\n".encode())
        os._exit(128 + signum)


def exit_later(seconds: float, code: int, line: str) -> None:
    """The last resort of a node that must stop: unless it has exited `seconds` from now, write
    `line` to stderr and end the process with `code`, whatever its main thread is stuck in."""
    def end() -> None:
        os.write(2, f"diloco-node: {line}\n".encode())
        os._exit(code)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
