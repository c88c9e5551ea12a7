"""The `spawn` fixture: real `diloco-node join` processes that are killed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from diloco_node.commands.launch import NodeProcess
from harness.nodes import FAST

NodeFactory = Callable[..., NodeProcess]


def starter(tmp_path: Path, started: list[NodeProcess]) -> NodeFactory:
    """Starts nodes with their logs and checkpoints under `tmp_path`, each added to `started`."""
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

    return start


def tell_if_failed(request: pytest.FixtureRequest, nodes: list[NodeProcess]) -> None:
    """Every node's last log lines when the test failed (tests/conftest.py): the failure itself
    shows only the node it waited on, and a flake in CI is read from this report alone."""
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed:
        return
    for node in nodes:
        print(f"\n--- {node.name}: last log lines ---\n{node.tail(60)}")


@pytest.fixture
def spawn(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NodeFactory]:
    """Start nodes; whatever a test leaves running is killed afterwards."""
    started: list[NodeProcess] = []
    yield starter(tmp_path, started)
    tell_if_failed(request, started)
    for node in started:
        node.kill()


@pytest.fixture(scope="module")
def spawn_shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeFactory]:
    """`spawn` for nodes that several tests of a module read (a module-scoped fixture of its own):
    killed after the module's last test."""
    started: list[NodeProcess] = []
    yield starter(tmp_path_factory.mktemp("shared"), started)
    for node in started:
        node.kill()
