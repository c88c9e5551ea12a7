"""docker/compose.yaml on a real Docker engine: build the images, bring three shaped regions up,
and check what an operator relies on.

One compose project for the module (building and starting it is most of the cost); the checks run
in order against it and the last one takes it down. Without an engine the suite skips, except in
CI (CI=true), where a missing engine is a failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

from harness.docker import (
    GATEWAYS,
    NODES,
    RATES_MBIT,
    WAN_ADDRESS,
    EngineMissing,
    Islands,
    counters,
    ensure_base_image,
    ensure_engine,
    host_veth,
    run,
    stage_build_inputs,
)

# the first test's setup builds the base image (debootstrap) and the images on a fresh machine:
# 5 minutes and more on CI's machines, beyond the suite's default of 300 s a test
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1500)]

SETTINGS = {"INNER_STEPS": "10", "COMPRESSION": "none", "ROUND_TIMEOUT": "60", "PROMETHEUS_PORT": "19090"}


@pytest.fixture(scope="module")
def islands() -> Iterator[Islands]:
    try:
        if os.geteuid() != 0:
            raise EngineMissing("the docker suite runs as root (dockerd, host veth counters)")
        ensure_engine()
        ensure_base_image()
    except EngineMissing as exc:
        if os.environ.get("CI"):
            pytest.fail(f"in CI the docker suite must run: {exc}")
        pytest.skip(str(exc))
    stage_build_inputs()
    project = f"dilocotest{os.getpid()}"
    islands = Islands(project, env=SETTINGS)
    try:
        islands.build()
        print(f"images built in {islands.build_seconds:.0f} s")
        islands.up()
        yield islands
    finally:
        islands.down()


def rounds(islands: Islands, service: str) -> dict[int, int]:
    """round -> group size, from the node's log (all of its runs, restarts included)."""
    return {round_: line.group_size for round_, line in islands.rounds(service).items()}


def wait_for(what: str, predicate, timeout: float, islands: Islands, service: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{service}: {what} not reached in {timeout:.0f}s\n"
                                 f"{islands.node_log(service)[-3000:]}")
        time.sleep(2)


def test_every_node_reaches_round_3_with_the_full_group(islands: Islands) -> None:
    for service in NODES:
        wait_for("round 3 with all four nodes", lambda s=service: rounds(islands, s).get(3) == 4, 300, islands, service)
    assert "Traceback" not in "".join(islands.node_log(s) for s in NODES)


def peak_mbit(series: list[tuple[float, int]], window: float) -> float:
    """The highest rate over any `window` seconds of (time, byte counter) samples."""
    best, start = 0.0, 0
    for end in range(len(series)):
        while series[end][0] - series[start][0] > window:
            start += 1
        span = series[end][0] - series[start][0]
        if span >= window * 0.9:
            best = max(best, (series[end][1] - series[start][1]) * 8 / span / 1e6)
    return best


def test_region_uplinks_are_shaped_during_the_exchange(islands: Islands) -> None:
    gateways = {region: host_veth(islands.container(gw), WAN_ADDRESS[gw]) for region, gw in GATEWAYS.items()}
    samples: list[tuple[float, dict[str, int]]] = []
    deadline = time.monotonic() + 40  # several rounds' exchanges (ap's share takes ~4 s at 10 Mbit/s)
    while time.monotonic() < deadline:
        samples.append((time.monotonic(), {region: counters(veth)[0] for region, veth in gateways.items()}))
        time.sleep(0.05)
    figures = {region: peak_mbit([(t, sent[region]) for t, sent in samples], window=1.0) for region in RATES_MBIT}
    print(f"peak egress per region over 1 s (Mbit/s): { {r: round(f, 1) for r, f in figures.items()} }")
    for region, rate in RATES_MBIT.items():
        assert figures[region] <= rate * 1.1, f"{region} sent {figures[region]:.1f} Mbit/s, uplink {rate} Mbit/s"
    # the measurement is real: the slowest region's uplink was busy at close to its rate
    assert figures["ap"] >= RATES_MBIT["ap"] * 0.5, figures


def test_traffic_inside_a_region_is_not_shaped(islands: Islands) -> None:
    """60 MB from eu-1 to eu-2 over their region's network, timed by eu-2's interface counters."""
    size = 60_000_000
    sender = subprocess.Popen(["docker", "exec", islands.container("eu-1"), "python3", "-c",
                               "import socket; s = socket.create_server(('0.0.0.0', 9999)); c, _ = s.accept(); "
                               f"c.sendall(bytes({size})); c.close()"])
    time.sleep(3)
    veth = host_veth(islands.container("eu-2"), NODES["eu-2"])
    before, started = counters(veth)[1], time.monotonic()
    received = run("docker", "exec", islands.container("eu-2"), "python3", "-c",
                   f"import socket\nc = socket.create_connection(('{NODES['eu-1']}', 9999))\nn = 0\n"
                   "while chunk := c.recv(1 << 20):\n    n += len(chunk)\nprint(n)", timeout=120)
    mbit = (counters(veth)[1] - before) * 8 / (time.monotonic() - started) / 1e6
    assert sender.wait(timeout=30) == 0
    assert int(received) == size
    print(f"eu-1 -> eu-2 inside the region: {mbit:.0f} Mbit/s (eu's uplink: {RATES_MBIT['eu']:.0f})")
    assert mbit > RATES_MBIT["eu"] * 1.1, f"traffic inside eu ran at {mbit:.1f} Mbit/s"


def test_prometheus_sees_every_node_up_with_its_outer_steps(islands: Islands) -> None:
    def query(expression: str) -> list[dict]:  # type: ignore[type-arg]
        url = f"http://127.0.0.1:{SETTINGS['PROMETHEUS_PORT']}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expression})
        with urllib.request.urlopen(url, timeout=10) as response:
            return list(json.loads(response.read())["data"]["result"])

    expected = {f"{service}:7780" for service in NODES}
    deadline = time.monotonic() + 60
    while True:
        up = {r["metric"]["instance"] for r in query("up == 1")}
        steps = {r["metric"]["instance"]: float(r["value"][1]) for r in query("diloco_outer_steps_total")}
        if up >= expected and all(steps.get(i, 0) >= 1 for i in expected) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert up >= expected, up
    assert all(steps.get(i, 0) >= 1 for i in expected), steps


def test_a_killed_node_leaves_the_others_training_and_comes_back_with_its_peer_id(islands: Islands) -> None:
    before = re.findall(r"peer address: \S+/p2p/(\w+)", islands.node_log("us-1"))
    assert before, islands.node_log("us-1")[-2000:]
    survivor_round = max(rounds(islands, "eu-1"))
    run("docker", "kill", islands.container("us-1"))
    wait_for("two more rounds without us-1", lambda: max(rounds(islands, "eu-1")) >= survivor_round + 2,
             240, islands, "eu-1")
    run("docker", "start", islands.container("us-1"))
    wait_for("a second start", lambda: len(re.findall(r"peer address: ", islands.node_log("us-1"))) >= 2,
             120, islands, "us-1")
    after = re.findall(r"peer address: \S+/p2p/(\w+)", islands.node_log("us-1"))
    assert set(after) == {before[0]}, after
    back = max(rounds(islands, "eu-1"))
    wait_for("a full group again", lambda: any(r > back and size == 4 for r, size in rounds(islands, "eu-1").items()),
             300, islands, "eu-1")


def test_docker_stop_saves_and_exits_cleanly(islands: Islands) -> None:
    # docker stop sends SIGTERM to tini, which passes it on; the node settles, saves and leaves
    container = islands.container("eu-2")
    started = time.monotonic()
    run("docker", "stop", "--time", "60", container, timeout=120)
    took = time.monotonic() - started
    code = int(run("docker", "inspect", "--format", "{{.State.ExitCode}}", container).strip())
    log = islands.node_log("eu-2")
    assert code == 0, f"exit {code} after docker stop\n{log[-3000:]}"
    assert took < 60, f"docker stop took {took:.0f}s: the node was killed at the grace period"
    assert "received SIGTERM; stopping" in log and "left the swarm at round=" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    print(f"docker stop: exit 0 in {took:.1f} s")


def test_down_leaves_nothing_behind(islands: Islands) -> None:
    islands.down()
    assert islands.leftovers() == {"containers": [], "networks": [], "volumes": []}
