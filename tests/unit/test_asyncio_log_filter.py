"""The asyncio log filter (cli._not_a_cancelled_future) drops only hivemind's cancelled futures, and
never raises: uvloop logs its exception handler's message with exc_info=False, which the filter
once indexed (TypeError), so uvloop printed "Exception in default exception handler" with a
traceback and the message itself was lost."""

from __future__ import annotations

import asyncio
import logging

from diloco_node.cli import _not_a_cancelled_future


def record(message: str, exc_info: object) -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, exc_info)  # type: ignore[arg-type]


def test_a_cancelled_future_never_retrieved_is_dropped() -> None:
    cancelled = asyncio.CancelledError()
    assert not _not_a_cancelled_future(record("Future exception was never retrieved",
                                              (type(cancelled), cancelled, None)))


def test_other_records_pass_whatever_their_exc_info() -> None:
    failure = ValueError("x")
    for exc_info in (None, False, (type(failure), failure, None)):
        assert _not_a_cancelled_future(record("Future exception was never retrieved", exc_info))
    assert _not_a_cancelled_future(record("Task was destroyed but it is pending!", False))


def test_a_closed_loop_of_a_failed_manifest_fetch_is_dropped() -> None:
    """An unreachable --peer: the fetch's p2p daemon is reaped after its loop closed (one line said why)."""
    closed = "Loop <_UnixSelectorEventLoop running=False closed=True debug=False> that handles pid 27735 is closed"
    assert not _not_a_cancelled_future(record(closed, None))
    assert _not_a_cancelled_future(record("Loop that handles nothing in particular", None))
