"""--upload-limit on real nodes (docs/architecture.md §13): a node serving its state to two joiners
at once keeps its egress on the wire, DHT and record traffic included, within 1.1x the cap in every
1-second window, and both joiners still take its state.

The server's egress is read the way the node reads its own (telemetry/wire.py: the kernel's TCP
counters of every connection of its libp2p daemon), sampled here every 0.1 s. The joiners are of
other seeds, so they start from another φ0 and must download the server's (the server trains a very
long first round meanwhile and shares its φ0 all along).
"""

from __future__ import annotations

import threading
import time

import pytest

from diloco_node.telemetry.wire import WireMeter
from harness.wire import windows
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

CAP = "8mbit"
CAP_BYTES = 1_000_000  # bytes/s
SAMPLE_SECONDS = 0.1
LONG_ROUND = ("--inner-steps", "100000")  # nobody finishes a round: the state served stays φ0


def sample(meter: WireMeter, samples: list[tuple[float, int]], stop: threading.Event) -> None:
    while not stop.is_set():
        meter.sample()
        totals = meter.totals()
        if totals is not None:
            samples.append((time.monotonic(), totals[0]))
        stop.wait(SAMPLE_SECONDS)


def test_serving_two_joiners_at_once_keeps_the_upload_cap(spawn: NodeFactory) -> None:
    server = spawn("server", *LONG_ROUND, "--upload-limit", CAP, run_id="capped")
    server.wait_for_address()  # its libp2p daemon runs: the joiners start while it finishes starting
    meter = WireMeter(server.process.pid)
    assert meter.available, "the kernel's socket statistics cannot be read here"
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(meter, samples, stop), daemon=True)
    sampler.start()
    try:
        joiners = [spawn(f"joiner{seed}", *LONG_ROUND, "--seed", str(seed), run_id="capped", peer=server)
                   for seed in (1, 2)]
        for joiner in joiners:
            joiner.wait_joined(timeout=120)
    finally:
        stop.set()
        sampler.join(timeout=5)
    served = str(server.events_of("joined")[0]["digest"])
    for joiner in joiners:
        assert "downloading state from peers" in joiner.log_text(), joiner.tail()
        assert str(joiner.events_of("joined")[0]["digest"]) == served, joiner.tail()  # took the server's φ
    rates = windows(samples)
    sent = samples[-1][1] - samples[0][1]
    logs = f"windows (kB/s): {[round(r / 1000) for r in rates]}\n{server.tail(30)}"
    assert sent > 2 * 4 * server.status()["parameters"], logs  # both states went out while we watched
    assert max(rates) <= 1.1 * CAP_BYTES, logs
    assert max(rates) >= 0.5 * CAP_BYTES, logs  # the cap was what held it, not a slow transfer
