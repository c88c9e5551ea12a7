"""`diloco-node demo` stopped by Ctrl-C while its nodes train leaves no process behind (see
test_demo_stop.py, which holds the check, for the stops during start-up)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.system.test_demo_stop import stop_demo_when

pytestmark = pytest.mark.integration


def training(printed: str) -> bool:
    """Whether the demo's first node has finished a round (its log is in the demo's directory)."""
    found = re.search(r"logs in (\S+)", printed)
    log = Path(found[1]) / "node0.log" if found else None
    return log is not None and log.exists() and " round=1 " in log.read_text()


def test_stopped_mid_run(tmp_path: Path) -> None:
    stop_demo_when(lambda tree, printed: training(printed), "ctrl-c", tmp_path / "demo.out")
