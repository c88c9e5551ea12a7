"""Free identities decide nothing (#28, must-hold 2): one stock hivemind process (forger.py,
mode `sybils`) publishes 3 or 10 validly signed records beside two honest nodes. Each follows the
honest round but never becomes ready (it used to hold every barrier for the round timeout),
claims a far-ahead exchanged round (it used to make honest nodes re-sync every round), and
announces a state shifted by 1 that one of them serves (a joiner used to download it: most
records announced it). Only proven peers decide (trust/proofs.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from diloco_node.swarm.presence import NEWCOMER_GRACE
from tests.hostile.test_forged_records import FORGER, STOP_SECONDS
from tests.integration.conftest import NodeFactory
from tests.integration.test_swarm import assert_same_digests

pytestmark = pytest.mark.integration

ROUND_TIMEOUT = "30"  # a record that held the barrier would make a round wait this long
MATCHMAKING_SECONDS = 10.0  # a round's matchmaking and transfer on a loaded machine, beyond any wait


@pytest.mark.parametrize("count", [3, 10])
def test_forged_identities_neither_resync_nor_stall_nor_poison_a_joiner(spawn: NodeFactory, count: int) -> None:
    options = ("--inner-steps", "5", "--min-peers", "2", "--run-id", "hostile", "--round-timeout", ROUND_TIMEOUT)
    a = spawn("a", *options, checkpoint=False)
    b = spawn("b", *options, peer=a, checkpoint=False)
    a.wait_for_round(1), b.wait_for_round(1)  # a and b proved each other's work: the run is under way
    since, since_round = (len(a.stderr_lines), len(b.stderr_lines)), max(a.rounds)
    with sybils(a.wait_for_address(), count):  # on return, every forged record is stored
        joiner = spawn("joiner", *options, peer=a, checkpoint=False)
        joiner.wait_joined()
        # its first round may miss its group and re-sync (as without forged records; on a loaded
        # machine once more), and so may a or b when the joiner's arrival splits that round's group
        # (hivemind's matchmaking, with or without forged records): from the second round after the
        # last download of any of them on, all three average together
        def last_synced() -> int:
            return max(event["round"] for node in (a, b, joiner) for event in node.events_of("synced"))

        joiner.wait_until(lambda: len([r for r in joiner.rounds if r > last_synced()]) >= 3, 150,
                          "three rounds after the last state download")
        joined = min(event["round"] for event in joiner.events_of("synced"))
        first = last_synced() + 1
        assert_same_digests([a, b, joiner], range(first + 1, first + 3))
        synced = joiner.events_of("synced")
        assert synced, "the joiner downloaded the run's state"
        for event in synced:  # every state it took is one an honest node held, never the forged one
            # (a and b may hold different states for a while when the joiner's arrival split a
            # round on a loaded machine: it then takes one of theirs, unchecked, after a wait)
            honest = {node.wait_for_round(event["round"]).digest for node in (a, b)}
            assert event["digest"] in honest, joiner.log_text()[-3000:]
        assert all(node.rounds[r].group_size == 3 for node in (a, b, joiner) for r in range(first + 1, first + 3))
        assert a.status().get("peers") == 3 + count, "the forged records should still be there"
        for node, start in zip((a, b), since, strict=True):
            log = "".join(node.stderr_lines[start:])
            # no re-sync but one where the joiner's first round split the group (above)
            resyncs = [int(line.split("round=")[1].split()[0]) for line in log.splitlines()
                       if "re-sync" in line and "round=" in line]
            assert len(resyncs) <= 1 and all(r <= joined + 2 for r in resyncs), node.log_text()[-3000:]
            assert "barrier timed out" not in log, node.log_text()[-3000:]
            # a forged identity that took our state is waited for once, for the newcomer grace only
            assert log.count("not waiting longer for newcomer") <= 1, node.log_text()[-3000:]
            # rounds keep their length: none is held for the round timeout (~35 s with matchmaking);
            # the longest wait is the newcomer grace of the identity that took our state, once
            under_attack = [r for r in node.rounds.values() if r.round > since_round]
            assert under_attack, node.log_text()[-3000:]
            longest = max(r.wait_seconds for r in under_attack)
            print(f"\nHOSTILE REPORT {node.name} under attack: {len(under_attack)} rounds, max wait {longest:.1f} s, "
                  f"{log.count('not waiting longer for newcomer')} newcomer graces waited out, "
                  f"{len(resyncs)} re-syncs")
            assert longest < NEWCOMER_GRACE * float(ROUND_TIMEOUT) + MATCHMAKING_SECONDS, longest


@contextlib.contextmanager
def sybils(peer: str, count: int) -> Iterator[list[str]]:
    """forger.py in mode `sybils` with `count` identities against the run `hostile`; their peer ids."""
    forger = subprocess.Popen([sys.executable, str(FORGER), peer, "hostile", "sybils", str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert forger.stdout is not None
        line = forger.stdout.readline()
        assert line.startswith("forging "), line
        yield line.split()[1:]
    finally:
        forger.terminate()
        started = time.monotonic()
        assert forger.wait(STOP_SECONDS) == 0
        assert time.monotonic() - started < STOP_SECONDS
