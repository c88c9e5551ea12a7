"""The asyncio log filter (cli._not_a_cancelled_future) drops only hivemind's cancelled futures, and
never raises: uvloop logs its exception handler's message with exc_info=False, which the filter
once indexed (TypeError), so uvloop printed "Exception in default exception handler" with a
traceback and the message itself was lost. And hivemind's own logs stay quiet whichever is first:
its import or the CLI's logging set-up."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

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


def test_hivemind_stays_quiet_when_it_is_imported_after_the_logging_is_set_up() -> None:
    """A node that names no --peer imports hivemind only after setup_logging; hivemind then sets its
    logger's level itself (from HIVEMIND_LOGLEVEL), which let its averager print 'could not find a
    group' with a traceback on a user's terminal."""
    probe = ("import logging, sys\n"
             "from diloco_node.cli import setup_logging\n"
             "assert 'hivemind' not in sys.modules\n"
             "setup_logging('INFO')\n"
             "from hivemind.utils.logging import get_logger\n"
             "print(get_logger('hivemind.averaging.averager').getEffectiveLevel())\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "HIVEMIND_LOGLEVEL"})
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == logging.CRITICAL
