"""A benchmark sent SIGTERM unwinds (harness/bench.py unwind_on_sigterm): its `finally` blocks run,
which stop its nodes and remove its islands."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, time
from pathlib import Path
from harness.bench import unwind_on_sigterm
unwind_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    Path(sys.argv[1]).write_text("cleaned up")
"""


def test_sigterm_runs_the_finally_blocks_and_exits_143(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(marker)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 128 + signal.SIGTERM
    assert time.monotonic() - sent < 5
    assert marker.read_text() == "cleaned up"
