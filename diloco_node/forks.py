"""What every helper process of the node does first: hivemind's forked helpers and the local ranks alike.

A fork inherits the node's Python signal handlers and every descriptor. A forked helper that ran
the handlers would "stop at the next safe point" of a node it is not, and live on; one that held
the status server's listening socket would keep the port taken after the node exits. So every
helper closes the node's listening sockets, ignores Ctrl-C and resets the other stop signals,
moves to a process group of its own (Ctrl-C in a terminal signals the whole foreground group: p2pd
would die under the node's feet before it could leave the swarm), and is killed by the kernel when
the node dies, whatever kills it. The node's own stop signals are daemon/lifecycle.py's.

A leaf of the package root, imported by the node's start-up (daemon/startup.py), the status server
(telemetry/server.py, which registers its socket) and the local ranks (replica/worker.py).
"""

from __future__ import annotations

import ctypes
import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


_closed_in_helpers: set[int] = set()  # the node's listening sockets (the status server's)


def close_in_helpers(fd: int, close: bool = True) -> None:
    """Have every helper forked from now on close `fd` at once (close=False: no longer). A fork
    keeps every descriptor (only exec drops Python's non-inheritable ones): a helper holding the
    status server's listening socket would keep the port taken after the node exits."""
    if close:
        _closed_in_helpers.add(fd)
    else:
        _closed_in_helpers.discard(fd)


def become_helper() -> None:
    """What a helper process of the node does first: close the node's listening sockets, ignore
    Ctrl-C, own process group, die with the node."""
    for fd in _closed_in_helpers:
        try:
            os.close(fd)
        except OSError:
            pass
    for signum in STOP_SIGNALS:
        # SIGINT ignored: the node stops its helpers itself; SIGTERM, SIGHUP default: `kill` still works.
        signal.signal(signum, signal.SIG_IGN if signum == signal.SIGINT else signal.SIG_DFL)
    signal.set_wakeup_fd(-1)  # the node's stop guard reads that pipe, not a helper's signals
    try:
        os.setpgid(0, 0)
    except OSError:  # already a group leader (cannot happen after fork, but never fail a fork)
        pass
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: p2pd's idle timeout ends orphans instead
        pass


_hooked = False


def isolate_forked_children() -> None:
    """Apply `become_helper` to every later os.fork of this process (subprocess's spawn is
    not a Python-level fork and is not affected)."""
    global _hooked
    if not _hooked:
        os.register_at_fork(after_in_child=become_helper)
        _hooked = True
