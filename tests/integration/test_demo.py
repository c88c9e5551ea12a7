"""`diloco-node demo` end to end: a real local swarm through the real CLI, then its summary table."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROW = re.compile(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)\s+(\d+)x less$")


def test_demo_trains_and_summarises() -> None:
    result = subprocess.run([sys.executable, "-m", "diloco_node", "demo", "--nodes", "2", "--rounds", "2",
                             "--inner-steps", "5"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [match for line in result.stdout.splitlines() if (match := ROW.match(line))]
    assert [int(row[1]) for row in rows] == [0, 1], result.stdout
    for row in rows:
        eval_start, eval_after, rounds, group = float(row[2]), float(row[3]), int(row[4]), float(row[5])
        assert eval_after < eval_start and rounds == 2 and group == 2.0, result.stdout
        assert int(row[8]) > 1, "DiLoCo must send less than all-reduce every step"
