"""SIGHUP stops a node as SIGTERM does, and a node stopped and started again at once binds the
same status and listen ports whatever its clients did (docs/architecture.md §5): a client that
read its status with `Connection: close` leaves a TIME-WAIT connection on the node's side, and no
helper process of hivemind's may hold the node's listening status socket.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from diloco_node.commands.launch import NodeProcess, descendants
from harness.bench import free_port
from harness.nodes import STOP_BOUND, fast_on
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration


def listening_inode(port: int) -> str:
    """The inode of the socket listening on 127.0.0.1:`port`, from /proc/net/tcp."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if local == f"0100007F:{port:04X}" and state == "0A":  # LISTEN
            return inode
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def holders(node: NodeProcess, inode: str) -> list[int]:
    """The node's processes (itself and every descendant) with that socket open."""
    assert node.process
    found = []
    for pid in [node.process.pid, *descendants(node.process.pid)]:
        if f"socket:[{inode}]" in open_files(pid):
            found.append(pid)
    return found


def open_files(pid: int) -> set[str]:
    """What each of the process's descriptors points at. A running node opens and closes files all
    the time: a descriptor gone between the listing and its readlink is skipped, not the process."""
    try:
        entries = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # the process has ended
        return set()
    links = set()
    for entry in entries:
        try:
            links.add(os.readlink(entry))
        except OSError:
            continue
    return links


def test_sighup_stops_and_a_restart_binds_the_same_ports(spawn: NodeFactory, tmp_path: Path) -> None:
    status_port, listen_port = free_port(), free_port()
    base = fast_on(listen_port=listen_port, status_port=status_port)
    node = spawn("a", "--inner-steps", "5", base=base)
    node.wait_for_round(1)
    assert node.process
    assert holders(node, listening_inode(status_port)) == [node.process.pid]  # no helper holds it
    request = urllib.request.Request(f"http://127.0.0.1:{status_port}/api/status", headers={"Connection": "close"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    node.stop("sighup", within=STOP_BOUND)  # exit 0, no traceback, no helper left (NodeProcess.stop)
    log = node.log_text()
    assert "received SIGHUP; stopping" in log and "left the swarm at round=" in log
    assert (tmp_path / "a" / "itest" / "node.json").exists()

    again = spawn("a", "--inner-steps", "5", base=base)
    again.wait_for_round(again.wait_joined() + 1)
    assert again.status_url == f"http://127.0.0.1:{status_port}"
    assert again.wait_for_address().startswith(f"/ip4/127.0.0.1/tcp/{listen_port}/")
    assert "resumed round=" in again.log_text()
    again.stop("sigterm", within=STOP_BOUND)
