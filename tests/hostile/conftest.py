"""Hostile peers are stock hivemind peers in processes of their own; honest nodes come from `spawn`.

Every test that spawns honest nodes reports, when it ends, what the attack cost them (#28,
must-hold 8): per node, the rounds it finished, the rounds lost once every node is in (any outcome
but averaging with a group: alone, held, behind, timed out, isolated), the longest barrier wait,
whether the honest nodes' φ agreed on their common rounds, and the node's peak memory. Run with
`-s` to see the line; docs/trust.md's table quotes it. φ's deviation from a clean twin run needs
a second run of the same nodes, which only test_deviation.py and test_butterfly_owner.py pay for
(they print it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco_node.commands.launch import NodeProcess
from tests.integration import conftest as integration
from tests.integration.conftest import NodeFactory
from tests.integration.test_butterfly import trio  # noqa: F401  (a fixture: three butterfly peers in this process)

AVERAGED = "together"  # round.Outcome.TOGETHER's word: the round took a group's mean


def report(nodes: list[NodeProcess]) -> str:
    """One line: what each node's rounds show of the attack. Rounds lost and the longest barrier
    wait are counted from the first round every node took part in (before it, the first node of a
    run averages alone by itself, which is no cost of the attack)."""
    common = set.intersection(*(set(n.rounds) for n in nodes)) if nodes else set()
    since = min(common, default=None)
    parts = []
    for node in nodes:
        rounds = list(node.rounds.values())
        if not rounds:
            parts.append(f"{node.name}: no round")
            continue
        peak = max((max(r.peak_memory_bytes) for r in rounds if r.peak_memory_bytes), default=0)
        shared = [r for r in rounds if since is not None and r.round >= since]
        lost = sum(r.outcome != AVERAGED for r in shared)
        wait = max((r.wait_seconds for r in shared), default=0.0)
        parts.append(f"{node.name}: {len(rounds)} rounds, {lost} of {len(shared)} lost since all were in, "
                     f"max wait {wait:.1f} s, peak {peak >> 20} MiB")
    split = [r for r in sorted(common) if len({n.rounds[r].digest for n in nodes}) > 1]
    agreed = "no common round" if not common else \
        (f"φ equal in {len(common)} common rounds" if not split else f"φ differs in rounds {split}")
    return "; ".join(parts) + f"; {agreed}"


@pytest.fixture
def spawn(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NodeFactory]:
    """integration's `spawn`, reporting at the end what the attack cost the nodes it started."""
    started: list[NodeProcess] = []
    factory = integration.spawn.__wrapped__(tmp_path, request)  # type: ignore[attr-defined]
    start = next(factory)

    def spawn_and_track(*args, **kwargs) -> NodeProcess:  # type: ignore[no-untyped-def]
        node = start(*args, **kwargs)
        started.append(node)
        return node

    yield spawn_and_track
    print(f"\nHOSTILE REPORT {request.node.name}: {report(started)}")
    next(factory, None)  # integration's teardown: kill what is left
