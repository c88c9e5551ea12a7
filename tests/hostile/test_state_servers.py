"""State servers that lie in what the digest does not cover (#28), each a stock hivemind peer in a
process of its own (forger.py), all three at once before one honest node: metadata nested 30,000
deep within the size limit (RecursionError in the joiner before), a round far ahead of the records,
and another server named. The joiner refuses each in one line and takes the honest state. And the
serving side's memory while four joiners download at once (docs/architecture.md §9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from hivemind import DHT

from diloco_node.swarm.statesync import NOT_SHARING, StateRefused, StateService
from diloco_node.swarm.streams import Streams
from tests.hostile.test_forged_records import bootstrap_only, forging_process
from tests.integration.conftest import NodeFactory
from tests.integration.test_swarm import assert_same_digests

pytestmark = pytest.mark.integration

REFUSALS = {"nested": "nested deeper than", "far": "is far ahead of the run's records",
            "named": "it names another server"}


def test_a_joiner_refuses_lying_state_metadata_in_one_line_each(spawn: NodeFactory) -> None:
    options = ("--inner-steps", "5", "--run-id", "hostile")
    a = spawn("a", *options, checkpoint=False)
    a.wait_for_round(1)
    with ExitStack() as stack:
        # all three start at once: each copies a's state before it announces itself, and once one
        # forged record (a copy of a's, ready round and all) is up, a blocking `a` in this fresh
        # run (no proofs) matchmakes for it in vain each round, so one started after another
        # would wait out such a round each
        # bootstrapped from a DHT peer that is no node of the run: no anchor, so the joiner counts
        # every record and asks the forgers (one whose --peer names `a` takes a's state only); it
        # outlives the forgers (their DHT reads hitting a peer just gone would stop them late)
        bootstrap = stack.enter_context(bootstrap_only(a.wait_for_address()))
        servers = {mode: stack.enter_context(forging_process(a.wait_for_address(), mode)) for mode in REFUSALS}
        forgers = {}
        for mode, server in servers.items():
            assert server.stdout is not None
            forgers[mode] = server.stdout.readline().split()[1]
        joiner = spawn("joiner", *options, "--min-peers", "2", "--peer", bootstrap, checkpoint=False)
        first = joiner.wait_joined(150) + 1
        log = joiner.log_text()
        assert joiner.events_of("synced"), log[-3000:]
        for mode, me in forgers.items():
            lines = [line for line in log.splitlines() if f"state from peer={me} not taken" in line]
            assert len(lines) == 1 and REFUSALS[mode] in lines[0], (mode, lines, log[-3000:])
        assert "Traceback" not in log and "RecursionError" not in log
        assert_same_digests([a, joiner], range(first, first + 2))


SERVER = """
import sys, torch
from hivemind import DHT
from diloco_node.swarm.statesync import StateService
from diloco_node.swarm.streams import Streams
numel = int(sys.argv[1])
phi, momentum = torch.randn(numel, generator=torch.Generator().manual_seed(0)), torch.ones(numel)
dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
service = StateService(Streams(dht), "memory", numel, 2,
                       lambda peer: ({"round": 1}, [phi.clone(), momentum.clone()]),  # a fresh copy, as nodes do
                       lambda peer, token: None)
service.attach()
print(dht.get_visible_maddrs()[0], flush=True)
for _ in sys.stdin:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024, flush=True)
"""
NUMEL = 8 << 20  # 32 MiB of φ: the copies stand far above the interpreter's noise
JOINERS = 4


@pytest.mark.timeout(420)  # downloads retried for 180 s (plus one in flight) on a loaded machine
def test_four_joiners_downloading_at_once_hold_at_most_a_few_copies_of_the_state(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    server = subprocess.Popen([sys.executable, str(script), str(NUMEL)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert server.stdin is not None and server.stdout is not None
    joiners: list[DHT] = []
    try:
        address = server.stdout.readline().strip()

        def memory() -> tuple[int, int]:
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write("\n")
            server.stdin.flush()
            rss, peak = server.stdout.readline().split()
            return int(rss), int(peak)

        base, _ = memory()
        joiners = [DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[address], start=True)
                   for _ in range(JOINERS)]
        streams = [Streams(dht) for dht in joiners]
        got: list[torch.Tensor] = []
        refusals: list[str] = []  # why a download was refused, for the message should one never end
        until = time.monotonic() + 180

        def download(host: Streams) -> None:
            client = StateService(host, "memory", NUMEL, 2, lambda peer: None, lambda peer, token: None)
            # a busy server says it is not sharing now, and on a loaded machine a transfer may fail
            # or time out: asked again, as joiners do (what is measured is the server's memory)
            while time.monotonic() < until:
                try:
                    _, vectors = host.run(client.download(address.rsplit("/", 1)[-1], 90), 100)
                    got.append(vectors[1])
                    return
                except StateRefused as exc:
                    if str(exc) != NOT_SHARING:
                        refusals.append(str(exc))
                    threading.Event().wait(0.5)

        threads = [threading.Thread(target=download, args=(host,)) for host in streams]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(until - time.monotonic(), 0) + 100)
        assert len(got) == JOINERS and all(bool((v == 1).all()) for v in got), refusals
        _, peak = memory()
        state = 2 * NUMEL * 4
        print(f"serving node: base {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB, "
              f"φ+momentum {state / 2**20:.0f} MiB, {JOINERS} joiners at once")
        assert peak - base <= 3 * state, (base, peak)
        for host in streams:
            host.close()
    finally:
        # the whole group: a SIGKILL of the script alone orphaned its forked DHT process and p2pd
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
        for dht in joiners:
            dht.shutdown()
