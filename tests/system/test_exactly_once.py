"""Every pseudo-gradient applied exactly once under eager, through the real round engine (#13).

With outer momentum 0 and outer lr 1, φ at the end is φ_0 minus the sum of every step a node
applied. If each node applied each round's group mean exactly once — whatever it applied early
as a stand-in, whenever an exchange landed, and for a node that joined mid-run whatever its
server had applied of its own — all nodes end with the same φ, up to float summation order. A
joiner that inherited its server's own pseudo-gradient at full weight would end one Δ away.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from diloco_node.commands.launch import NodeProcess
from diloco_node.daemon.checkpoint import read_checkpoint
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

EXACT = ["--sync", "eager", "--outer-momentum", "0", "--outer-lr", "1.0", "--inner-steps", "30",
         "--max-outer-steps", "14", "--round-timeout", "60"]


# hivemind's matchmaking now and then leaves a node without its group for a round (#16): it then
# averages alone, and its φ differs by design, which says nothing of the ledger. Such an attempt is
# run once more; the second must hold.
ATTEMPTS = 2
MATCHMAKING_FAILED = re.compile(r"round=(\d+) no peer averaged with us")
# a scenario's nodes, each with the first of its exchanges (by round) in which averaging alone would
# matter: one that a node joining later inherits in flight is completed by the joiner as it was
Watched = list[tuple[NodeProcess, int]]


def lone_rounds(node: NodeProcess, since: int) -> list[int]:
    return [int(m.group(1)) for m in MATCHMAKING_FAILED.finditer(node.log_text()) if int(m.group(1)) >= since]


def final_phi(tmp_path: Path, name: str, run_id: str) -> torch.Tensor:
    state = read_checkpoint(tmp_path / name / run_id)
    return torch.cat([p.reshape(-1) for p in state["outer_params"]])


def final_phi_start() -> torch.Tensor:
    from diloco_node.train.model import build_model
    return torch.cat([p.detach().reshape(-1) for p in build_model("tiny", 0).parameters()])


def assert_same_phi(tmp_path: Path, names: list[str], run_id: str) -> None:
    """Every node's φ equal to a's, to float summation order: far below one pseudo-gradient (what a
    missed or doubled Δ costs)."""
    reference = final_phi(tmp_path, names[0], run_id)
    step = float((reference - final_phi_start()).abs().max())
    for name in names[1:]:
        apart = float((final_phi(tmp_path, name, run_id) - reference).abs().max())
        assert apart < 1e-4 * step, f"{name} ended {apart:.3g} from {names[0]} (steps moved φ by {step:.3g})"


def attempts(spawn: NodeFactory, scenario: Callable[[Callable[..., NodeProcess]], Watched],
             tmp_path: Path) -> None:
    for attempt in range(1, ATTEMPTS + 1):
        run_id = f"exact{attempt}"

        def start(name: str, *args: str, peer: NodeProcess | None = None, suffix: int = attempt,
                  run: str = run_id) -> NodeProcess:
            return spawn(f"{name}{suffix}", *args, run_id=run, peer=peer)

        watched = scenario(start)
        nodes = [node for node, _ in watched]
        for node in nodes:
            assert node.wait_exit(timeout=240) == 0, node.log_text()[-3000:]
        alone = [node.name for node, since in watched if lone_rounds(node, since)]
        if alone and attempt < ATTEMPTS:
            print(f"attempt {attempt}: matchmaking left {alone} alone for a round (#16); once more")
            continue
        assert not alone, f"matchmaking left {alone} alone in every attempt\n" + "\n".join(
            f"--- {node.name}:\n" + node.log_text()[-4000:] for node, _ in watched)
        assert_same_phi(tmp_path, [node.name for node in nodes], run_id)
        return


# Rounds of 2 s (by time budget, whatever the load) and a joiner whose state (8 B/param, 3.7 MB)
# takes ~8 s at its download cap, longer than its server and the run wait for its record (half the
# round timeout of 10 s: presence.JOINER_RECORD_SECONDS), while a round's payloads (int4,
# 0.46 B/param) take ~1 s: the state arrives superseded and is caught up on the means of the rounds since
# (docs/architecture.md §14), which must hold the ledger as well. More rounds than the others' (they
# are shorter), for the joiner to join and then exchange a few.
_STEPS, _TIMEOUT = EXACT.index("--inner-steps"), EXACT.index("--round-timeout")
SLOW_JOINER = [*EXACT[:_STEPS], *EXACT[_STEPS + 2:_TIMEOUT], *EXACT[_TIMEOUT + 2:], "--compression", "int4",
               "--round-seconds", "2", "--max-outer-steps", "22", "--round-timeout", "10"]


def test_every_mean_once_also_for_a_joiner(spawn: NodeFactory, tmp_path: Path) -> None:
    def scenario(start: Callable[..., NodeProcess]) -> Watched:
        a = start("a", *SLOW_JOINER, "--min-peers", "2")
        b = start("b", *SLOW_JOINER, "--min-peers", "2", peer=a)
        a.wait_for_round(1, timeout=180)
        # joins mid-run: its server holds its own Δ of the last round early
        c = start("c", *SLOW_JOINER, "--download-limit", "4mbit", peer=a)
        c.wait_exit(timeout=240)
        assert "settled round=22" in c.log_text(), c.log_text()[-3000:]
        if lone_rounds(a, 0) or lone_rounds(b, 0):
            # #16 split a and b before c came: no two servers agreed, and c took a state unchecked
            # instead of catching one up; `attempts` runs the scenario once more
            return [(a, 0), (b, 0), (c, 0)]
        assert "caught up on the means of those rounds" in c.log_text(), c.log_text()[-3000:]
        assert 2 <= (c.joined_round or 0) <= 20, c.log_text()[-2000:]
        return [(a, 0), (b, 0), (c, 0)]

    attempts(spawn, scenario, tmp_path)


def test_every_mean_once_across_a_crash_and_resume(spawn: NodeFactory, tmp_path: Path) -> None:
    """`kill -9` under eager leaves a checkpoint whose φ holds our Δ of the last round in place of
    its mean; the resumed node takes the run's state instead, which holds that mean exactly once."""
    def scenario(start: Callable[..., NodeProcess]) -> Watched:
        a = start("a", *EXACT, "--min-peers", "2")
        b = start("b", *EXACT, "--min-peers", "2", peer=a)
        b.wait_for_round(3, timeout=180)
        b.kill()
        b = start("b", *EXACT, peer=a)
        # while b was gone a averaged alone; b takes a's state, and completes what a had in flight
        back = b.wait_joined()
        b.wait_exit(timeout=240)
        text = b.log_text()
        assert "resumed round=" in text and "synced state from peers" in text, text[-3000:]
        return [(a, back), (b, 0)]

    attempts(spawn, scenario, tmp_path)


def test_every_mean_once_when_an_exchange_lands_late(spawn: NodeFactory, tmp_path: Path) -> None:
    """b frozen for a while (SIGSTOP): a's exchange of that round is still running when a's next round
    ends, so a goes on without it (--sync-timeout) and applies it when it lands, once."""
    def scenario(start: Callable[..., NodeProcess]) -> Watched:
        late = ["--sync-timeout", "0.5", "--min-peers", "2"]
        a = start("a", *EXACT, *late)
        b = start("b", *EXACT, *late, peer=a)
        a.wait_for_round(3, timeout=180)
        assert b.process is not None
        os.kill(b.process.pid, signal.SIGSTOP)
        try:
            a.wait_until(lambda: "it is applied when it lands" in a.log_text(), 60, "a late exchange")
        finally:
            os.kill(b.process.pid, signal.SIGCONT)
        return [(a, 0), (b, 0)]

    attempts(spawn, scenario, tmp_path)
