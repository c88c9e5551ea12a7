"""Bounded waits on hivemind's helper processes (docs/architecture.md §4, "Bounded waits").

hivemind's DHT and averager each run in a process of their own: a call sends its request over a
pipe and waits on an MPFuture that only that process resolves. hivemind's own calls wait without a
limit, so a helper that died (or hangs) would hold the caller forever. Every call of ours to either
goes through here: it waits at most its timeout, then raises `HelperTimeout` (a TimeoutError, which
the callers already treat as a failed DHT or averager call). Consecutive timeouts are counted:
the watchdog (watchdog.py) takes a helper that stops answering for dead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from hivemind import DHT
from hivemind.dht.node import DHTNode

from diloco_node.errors import NodeError

T = TypeVar("T")

# A `latest=True` read asks the nodes nearest the key one after another, each with hivemind's
# 3 s request timeout (DHTNode's wait_timeout); records of a run sit on a handful of nodes, so a
# read that has not finished in 20 s is a stuck one. The heartbeat reads every 10 s and a record
# lives 25 s (presence.py, records.py): a stuck read costs at most one refresh.
DHT_GET_TIMEOUT = 20.0
# A store contacts the same nearest nodes as a read, then writes: the same bound.
DHT_STORE_TIMEOUT = 20.0
# Our coroutines run in the DHT process (addresses, connected peers, the peer id); each bounds its
# own network steps (contacts.DIAL_TIMEOUT is 3 s per contact, run concurrently), so 30 s is ample.
DHT_COROUTINE_TIMEOUT = 30.0
# Requests the averager answers from its own state at once (set the group bits, start a step).
AVERAGER_CALL_TIMEOUT = 10.0
# The averager's start: it starts its own p2pd and announces itself, as the DHT does in
# dht.start_dht's `startup_timeout` (30 s).
AVERAGER_START_TIMEOUT = 30.0

GONE_POLL_SECONDS = 0.5  # a wait looks this often whether the watchdog has given the helpers up

_lock = threading.Lock()  # guards _streak: heartbeat, round loop and exchange threads all call here
_streak = 0  # calls that timed out in a row, since the last call answered
_gone: str | None = None  # why the helpers are dead (watchdog.py); set once, never cleared


class HelperTimeout(NodeError, TimeoutError):
    """A helper process (hivemind's DHT or averager) did not answer a call in time. Where no caller
    takes it as a failed call (start-up, the round loop), the node stops: exit 1, a restart may
    find the helpers well (docs/architecture.md §10)."""

    exit_code = 1


class HelperGone(HelperTimeout):
    """The helpers are dead (watchdog.py): no call waits any more, each fails at once."""


def give_up(why: str) -> None:
    """From now on every call fails at once with HelperGone(why): the node is stopping, and a wait
    of its stop path on a dead helper would only delay the exit."""
    global _gone
    _gone = why


def wait(future: Future[Any], timeout: float, what: str) -> Any:
    """The result of `future`, waiting at most `timeout` seconds; HelperTimeout after that (the
    request is cancelled), HelperGone once the helpers are given up. Exceptions the helper raised
    pass through."""
    global _streak
    deadline = time.monotonic() + timeout
    while True:
        if _gone is not None:
            future.cancel()
            raise HelperGone(_gone)
        try:
            result = future.result(timeout=max(0.0, min(GONE_POLL_SECONDS, deadline - time.monotonic())))
            break
        except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError since Python 3.11
            if time.monotonic() < deadline:
                continue
            future.cancel()
            with _lock:
                _streak += 1
            raise HelperTimeout(f"{what} did not answer within {timeout:.0f}s") from None
    with _lock:
        _streak = 0
    return result


def call(function: Callable[[], T], timeout: float, what: str) -> T:
    """`function()`, for the hivemind calls that wait inside and take no timeout (the averager's
    `step` waits for its process to accept the step): run on a daemon thread of its own and given
    up after `timeout`. The thread stays blocked if the helper died; the node then exits (watchdog.py)."""
    _check()
    done: Future[T] = Future()
    done.set_running_or_notify_cancel()  # running: a late answer is still set, never refused as cancelled

    def run() -> None:
        try:
            done.set_result(function())
        except BaseException as exc:  # handed to the caller, who sees what the call raised
            done.set_exception(exc)

    threading.Thread(target=run, name=f"bounded {what}", daemon=True).start()
    result: T = wait(done, timeout, what)
    return result


def timeout_streak() -> int:
    """How many helper calls in a row timed out (0 once one answers)."""
    with _lock:
        return _streak


def _check() -> None:
    if _gone is not None:
        raise HelperGone(_gone)


def get(dht: DHT, key: str, latest: bool = True, timeout: float = DHT_GET_TIMEOUT) -> Any:
    _check()  # a dead helper's pipe may even fail to create the request (torch's shared memory)
    return wait(dht.get(key, latest=latest, return_future=True), timeout, f"DHT read of {key}")


def store(dht: DHT, key: str, value: Any, expiration_time: float, subkey: Any = None,
          timeout: float = DHT_STORE_TIMEOUT) -> bool:
    _check()
    return bool(wait(dht.store(key, value, expiration_time, subkey=subkey, return_future=True),
                     timeout, f"DHT store of {key}"))


def run_coroutine(dht: DHT, coroutine: Callable[[DHT, DHTNode], Awaitable[T]],
                  timeout: float = DHT_COROUTINE_TIMEOUT) -> T:
    """`coroutine(dht, node)` run in the DHT process; it must be picklable (a module-level function
    or a functools.partial of one)."""
    _check()
    name = getattr(coroutine, "__name__", None) or getattr(getattr(coroutine, "func", None), "__name__", "coroutine")
    result: T = wait(dht.run_coroutine(coroutine, return_future=True), timeout, f"DHT call {name}")
    return result


async def _visible_maddrs(_dht: DHT, node: DHTNode) -> list[Any]:
    return list(await node.get_visible_maddrs())


async def _peer_id(_dht: DHT, node: DHTNode) -> Any:
    return node.peer_id


def visible_maddrs(dht: DHT) -> list[str]:
    """The addresses peers can dial us at (hivemind's get_visible_maddrs, bounded)."""
    return [str(address) for address in run_coroutine(dht, _visible_maddrs)]


def peer_id(dht: DHT) -> str:
    """The DHT's peer id (hivemind's `DHT.peer_id` property, bounded)."""
    return str(run_coroutine(dht, _peer_id))
