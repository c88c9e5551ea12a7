"""A node whose hivemind helper dies (docs/architecture.md §4 "Bounded waits", §10): `/healthz`
turns unhealthy, the node logs one line naming the helper and exits 1 within 30 s, so docker and
systemd restart it; and it can be restarted at once on the same listen port.

The helper is killed for real (SIGKILL), as the OOM killer or a crash would end it; p2pd and the
averager are killed in test_dead_daemon.py (each file stays under a minute).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from diloco_node.commands.launch import NodeProcess, alive, descendants
from diloco_node.procs import parent, program
from harness.bench import free_port
from harness.nodes import fast_on
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

EXIT_BOUND = 30.0  # README: a node whose helper died exits 1 within 30 s


def health(node: NodeProcess) -> tuple[int, dict]:  # type: ignore[type-arg]
    """(HTTP status, body) of the node's /healthz."""
    assert node.status_url
    try:
        with urllib.request.urlopen(f"{node.status_url}/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def helpers(node: NodeProcess) -> dict[str, int]:
    """The node's hivemind helpers by name: the DHT process (p2pd runs below it), the averager
    process (a forked python with no child) and p2pd."""
    assert node.process
    found = {}
    for pid in descendants(node.process.pid):
        if program(pid) == "p2pd":
            found["p2pd"] = pid
        elif program(pid).startswith("python") and parent(pid) == node.process.pid:
            has_p2pd = any(program(child) == "p2pd" for child in descendants(pid))
            found["DHT" if has_p2pd else "averager"] = pid
    assert set(found) == {"DHT", "averager", "p2pd"}, found
    return found


def test_a_dead_dht_process_makes_the_node_unhealthy_and_exit_1(spawn: NodeFactory) -> None:
    dies_and_exits_1(spawn, "DHT")


def dies_and_exits_1(spawn: NodeFactory, victim: str) -> None:
    """Kill the node's `victim` helper; the node must say so in one line, answer /healthz 503 while
    it stops, exit 1 within EXIT_BOUND and leave no process behind. For the DHT (whose p2pd holds
    the listen port), it must also start again at once on the same port."""
    port = free_port()
    node = spawn("a", "--inner-steps", "5", base=fast_on(listen_port=port))
    node.wait_for_round(1)
    assert health(node) == (200, {"ok": True})
    assert node.process
    pids = helpers(node)
    everything = descendants(node.process.pid)
    started = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    seen = []
    while node.running() and time.monotonic() - started < EXIT_BOUND:
        try:
            seen.append(health(node))
        except OSError:  # the server is gone: the node is exiting
            break
        time.sleep(0.05)  # a node whose stop path is short is unhealthy for well under a second
    code = node.wait_exit(timeout=max(1.0, EXIT_BOUND - (time.monotonic() - started)))
    took = time.monotonic() - started
    assert code == 1, node.log_text()[-3000:]
    assert took < EXIT_BOUND
    assert any(status == 503 and body["ok"] is False and victim in body["reason"] for status, body in seen), seen
    log = node.log_text()
    named = [line for line in log.splitlines() if "died" in line]
    assert len(named) == 1 and victim in named[0] and f"pid {pids[victim]}" in named[0], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    deadline = time.monotonic() + 10
    while [pid for pid in everything if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in everything if alive(pid)], "processes of the node outlived it"

    if victim != "DHT":
        return
    # restarted at once (as docker or systemd would) on the same port, although the DHT's p2pd
    # (which holds that port) lost its parent: it resumes from its checkpoint
    again = spawn("a", "--inner-steps", "5", base=fast_on(listen_port=port))
    again.wait_for_round(again.wait_joined() + 1)
    assert again.wait_for_address().startswith(f"/ip4/127.0.0.1/tcp/{port}/")
    again.stop("sigterm", within=30)
