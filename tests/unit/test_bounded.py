"""swarm/bounded.py: a call to a helper that does not answer gives up after its timeout, and the
timeouts in a row are counted for the watchdog."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from diloco_node.swarm import bounded


def test_a_call_that_is_not_answered_gives_up_after_its_timeout_and_counts() -> None:
    answered: Future[int] = Future()
    answered.set_result(1)
    assert bounded.wait(answered, 1.0, "a call") == 1
    assert bounded.timeout_streak() == 0
    for expected in (1, 2):
        never: Future[int] = Future()
        started = time.monotonic()
        with pytest.raises(bounded.HelperTimeout, match="a read did not answer within 1s"):
            bounded.wait(never, 1.0, "a read")
        assert time.monotonic() - started >= 1.0
        assert never.cancelled()  # the request is withdrawn
        assert bounded.timeout_streak() == expected
    assert bounded.wait(answered, 1.0, "a call") == 1
    assert bounded.timeout_streak() == 0  # one answer ends the streak


def test_an_answer_within_the_timeout_is_returned_and_a_helper_error_passes_through() -> None:
    late: Future[str] = Future()
    threading.Timer(0.7, late.set_result, ["here"]).start()  # after a few of wait's looks
    assert bounded.wait(late, 5.0, "a call") == "here"
    failed: Future[str] = Future()
    failed.set_exception(ValueError("the helper's own error"))
    with pytest.raises(ValueError, match="the helper's own error"):
        bounded.wait(failed, 5.0, "a call")


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_call_bounds_a_function_that_waits_inside() -> None:
    release = threading.Event()
    with pytest.raises(bounded.HelperTimeout, match="a step did not answer"):
        bounded.call(release.wait, 0.5, "a step")
    late = threading.Thread(target=release.set)
    late.start()  # the call given up answers late: no exception on its thread (a pytest warning)
    late.join()
    assert bounded.call(lambda: 3, 1.0, "a call") == 3
