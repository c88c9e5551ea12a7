"""Each test's phase reports on its item (`item.rep_call` …), so that a fixture's teardown can tell
whether the test failed: the node fixtures then print every node's last log lines, since a failure
report shows only the lines of the node that timed out, and a flake in CI is read from that report."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
