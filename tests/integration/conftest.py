"""The `spawn` fixture: real `diloco-node join` processes that are killed after each test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from diloco_node.launch import NodeProcess
from harness.nodes import FAST

NodeFactory = Callable[..., NodeProcess]


@pytest.fixture
def spawn(tmp_path: Path):
    """Start nodes; whatever a test leaves running is killed afterwards."""
    started: list[NodeProcess] = []

    def start(name: str, *extra: str, run_id: str = "itest", peer: NodeProcess | None = None,
              checkpoint: bool = True, base: list[str] | None = None) -> NodeProcess:
        """`base`: the flags in place of FAST (harness.nodes.fast_on: FAST on given ports)."""
        args = [*(FAST if base is None else base), "--run-id", run_id, *extra]
        args += ["--checkpoint-dir", str(tmp_path / name) if checkpoint else ""]
        if peer is not None:
            args += ["--peer", peer.wait_for_address()]
        node = NodeProcess(name, args, tmp_path).start()
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()


