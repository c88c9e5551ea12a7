"""Records any peer can publish, with a key of its own, must not halt or steer a run (#15): a stock
hivemind peer (forger.py) copies an honest record and claims a far-ahead round in it. Honest nodes
used to re-sync every half second, zero rounds, for as long as it stayed."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hivemind import DHT

from tests.integration.conftest import NodeFactory
from tests.integration.test_swarm import assert_same_digests

pytestmark = pytest.mark.integration

FORGER = Path(__file__).with_name("forger.py")
STOP_SECONDS = 15


def test_a_forged_far_ahead_record_does_not_halt_the_run(spawn: NodeFactory) -> None:
    options = ("--inner-steps", "5", "--min-peers", "2", "--run-id", "hostile")
    a = spawn("a", *options, checkpoint=False)
    b = spawn("b", *options, peer=a, checkpoint=False)
    b.wait_for_round(1)
    with forging(a.wait_for_address(), "ahead"):
        a.wait_until(lambda: a.status().get("peers") == 3, 30, "the forged record among the run's")
        since = len(a.stderr_lines), len(b.stderr_lines)
        start = max(max(a.rounds), max(b.rounds)) + 1
        assert_same_digests([a, b], range(start, start + 4))
        assert all(node.rounds[r].group_size == 2 for node in (a, b) for r in range(start, start + 4))
        assert a.status().get("peers") == 3, "the forged record should still be there"
        for node, first in zip((a, b), since, strict=True):
            assert "re-sync" not in "".join(node.stderr_lines[first:]), node.log_text()[-3000:]


def test_a_record_with_another_config_does_not_keep_joiners_out(spawn: NodeFactory) -> None:
    """It used to make every new joiner refuse to start ("incompatible config")."""
    options = ("--inner-steps", "5", "--run-id", "hostile")
    a = spawn("a", *options, checkpoint=False)
    with forging(a.wait_for_address(), "config"):
        a.wait_until(lambda: "refused peer" in a.log_text(), 30, "a refusing the forged record")
        joiner = spawn("joiner", *options, "--min-peers", "2", peer=a, checkpoint=False)
        first = joiner.wait_joined() + 1
        assert_same_digests([a, joiner], range(first + 1, first + 3))  # the first one may re-sync


@contextlib.contextmanager
def forging(peer: str, mode: str) -> Iterator[None]:
    with forging_process(peer, mode) as forger:
        assert forger.stdout is not None and forger.stdout.readline().startswith("forging ")
        yield


@contextlib.contextmanager
def forging_process(peer: str, mode: str) -> Iterator[subprocess.Popen[str]]:
    """forger.py in `mode` against the run `hostile`; stopped with SIGTERM (exit 0 within 15 s)."""
    forger = subprocess.Popen([sys.executable, str(FORGER), peer, "hostile", mode],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield forger
    finally:
        forger.terminate()
        started = time.monotonic()
        assert forger.wait(STOP_SECONDS) == 0
        assert time.monotonic() - started < STOP_SECONDS


@contextlib.contextmanager
def bootstrap_only(peer: str) -> Iterator[str]:
    """A plain hivemind DHT peer joined to `peer`'s DHT, no node of the run; its multiaddr. A joiner
    naming it with --peer has no anchor (trust/proofs.py): every record counts for the state it
    takes, as for a joiner bootstrapped from a public DHT peer (the known limit of §9)."""
    dht = DHT(initial_peers=[peer], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        yield str(dht.get_visible_maddrs()[0])
    finally:
        dht.shutdown()
