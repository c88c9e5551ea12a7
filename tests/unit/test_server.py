"""The status server's endpoints through aiohttp's test client (no threads, no fixed ports)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from diloco_node.telemetry.meter import Telemetry
from diloco_node.telemetry.server import build_app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RUN = "test-run"
CHECKPOINT_DIR = "/tmp/diloco-secret-checkpoints"
COUNTERS = ("diloco_bytes_sent", "diloco_bytes_received", "diloco_wire_bytes_sent", "diloco_wire_bytes_received",
            "diloco_outer_steps", "diloco_inner_steps", "diloco_contributions_clipped",
            "diloco_contributions_rejected")
GAUGES = ("diloco_loss", "diloco_eval_loss", "diloco_compute_utilization", "diloco_peers", "diloco_compression_ratio",
          "diloco_isolated", "diloco_last_round_tokens_per_second", "diloco_upload_limit_bytes_per_second",
          "diloco_peer_stream_egress_bytes_per_second", "diloco_peer_stream_ingress_bytes_per_second")


def round_stats(index: int, seconds: float = 12.0) -> dict[str, Any]:
    return {"round": index, "time": 1_700_000_000.0 + index * seconds, "loss": 4.0 - index * 0.1,
            "eval_loss": 4.2 - index * 0.1, "bytes_sent": 1_000_000, "bytes_received": 2_000_000,
            "bytes_sent_total": 1_000_000 * (index + 1), "bytes_received_total": 2_000_000 * (index + 1),
            "payload_bytes": 500_000, "raw_bytes": 8_000_000, "compression_ratio": 16.0,
            "compute_seconds": seconds * 0.9, "wait_seconds": seconds * 0.1, "utilization": 0.9,
            "round_seconds": seconds, "group_size": 2}


def peer_row(index: int, is_self: bool = False) -> dict[str, Any]:
    return {"peer_id": f"12D3KooWabcdefghijklmnopPeer{index:04d}", "label": f"node-{index}", "rounds": 2,
            "bytes_sent": 2_000_000, "bytes_received": 4_000_000, "last_round_bytes_sent": 1_000_000,
            "last_round_bytes_received": 2_000_000, "bandwidth_bps": 8_000_000.0, "utilization": 0.9,
            "last_seen": time.time() - 3, "is_self": is_self}


def filled_telemetry() -> Telemetry:
    """A node two rounds in, as the node would report it (also used by test_status_view)."""
    telemetry = Telemetry(run_id=RUN, label="node-0")
    telemetry.update(peer_id=peer_row(0)["peer_id"], maddrs=["/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWPeer0000"],
                     outer_step=2, inner_step=80, loss=3.9, eval_loss=4.1, peers=2, group_size=2,
                     bytes_sent=2_000_000, bytes_received=4_000_000, wire_bytes_sent=2_150_000,
                     wire_bytes_received=4_300_000, compression="int8", bytes_per_param=1.03,
                     compression_ratio=16.0, utilization=0.9, round_seconds=12.0,
                     peer_streams=[{"peer_id": peer_row(1)["peer_id"], "stream_egress_bytes_per_second": 1000.0,
                                    "stream_ingress_bytes_per_second": 2000.0}])
    telemetry.record_round(round_stats(0, seconds=8.0))
    telemetry.record_round(round_stats(1, seconds=40.0))
    telemetry.set_peers([peer_row(0, is_self=True), peer_row(1)])
    return telemetry


def serve(telemetry: Telemetry, check: Callable[[TestClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with TestClient(TestServer(build_app(telemetry))) as client:
            await check(client)

    asyncio.run(main())


async def get_json(client: TestClient, path: str) -> Any:
    response = await client.get(path)
    assert response.status == 200, path
    assert response.content_type == "application/json"
    return await response.json()


def test_healthz() -> None:
    async def check(client: TestClient) -> None:
        assert await get_json(client, "/healthz") == {"ok": True}

    serve(filled_telemetry(), check)


def test_healthz_answers_503_with_the_reason_once_the_node_is_unhealthy() -> None:
    telemetry = filled_telemetry()
    telemetry.mark_unhealthy("hivemind's DHT process (pid 7) died (exit code -9)")

    async def check(client: TestClient) -> None:
        response = await client.get("/healthz")
        assert response.status == 503
        assert await response.json() == {"ok": False, "reason": "hivemind's DHT process (pid 7) died (exit code -9)"}

    serve(telemetry, check)


def _all_keys_and_strings(value: Any) -> tuple[list[str], list[str]]:
    if isinstance(value, dict):
        nested = [_all_keys_and_strings(v) for v in value.values()]
        return [str(k) for k in value] + [k for ks, _ in nested for k in ks], [s for _, ss in nested for s in ss]
    if isinstance(value, list):
        nested = [_all_keys_and_strings(v) for v in value]
        return [k for ks, _ in nested for k in ks], [s for _, ss in nested for s in ss]
    return [], [value] if isinstance(value, str) else []


def test_status_has_state_and_no_secrets_or_paths() -> None:
    telemetry = filled_telemetry()

    async def check(client: TestClient) -> None:
        status = await get_json(client, "/api/status")
        assert status["run_id"] == RUN and status["outer_step"] == 2 and status["loss"] == 3.9
        assert status["uptime_seconds"] >= 0
        keys, strings = _all_keys_and_strings(status)
        # `last_round_tokens*` count the tokens a round trained (docs/architecture.md §13), no credential
        counted = {"last_round_tokens", "last_round_tokens_per_second"}
        assert not [k for k in keys if ("key" in k.lower() or "secret" in k.lower() or "token" in k.lower())
                    and k not in counted]
        private = (CHECKPOINT_DIR, str(Path.home()), "/root/", "/home/")
        assert not [s for s in strings for p in private if p in s], strings

    serve(telemetry, check)


def test_a_fresh_node_serves_every_status_field_as_null_until_known() -> None:
    from diloco_node.telemetry.meter import STATUS_FIELDS

    async def check(client: TestClient) -> None:
        status = await get_json(client, "/api/status")
        assert set(STATUS_FIELDS) <= set(status)
        assert status["model_digest"] is None and status["peer_id"] is None and status["run_id"] == RUN

    serve(Telemetry(run_id=RUN), check)


def test_history_and_peers() -> None:
    async def check(client: TestClient) -> None:
        history = await get_json(client, "/api/history")
        assert history["run_id"] == RUN
        assert [r["round"] for r in history["rounds"]] == [0, 1]
        assert history["rounds"][1]["round_seconds"] == 40.0
        peers = await get_json(client, "/api/peers")
        assert peers["run_id"] == RUN
        assert [p["is_self"] for p in peers["peers"]] == [True, False]
        assert peers["peers"][1]["label"] == "node-1"

    serve(filled_telemetry(), check)


def test_dashboard_and_static_files() -> None:
    async def check(client: TestClient) -> None:
        index = await client.get("/")
        assert index.status == 200 and index.content_type == "text/html"
        assert "<html" in (await index.text()).lower()
        assert (await client.get("/static/no-such-file.js")).status == 404
        for attempt in ("/static/../meter.py", "/static/%2e%2e/meter.py", "/static/..%2fmeter.py",
                        "/static/../server.py", "/static/%2e%2e/%2e%2e/cli.py"):
            response = await client.get(attempt)
            body = await response.text()
            assert response.status in (403, 404), attempt
            assert "Telemetry" not in body and "import" not in body, attempt

    serve(filled_telemetry(), check)


def test_only_get_is_allowed() -> None:
    async def check(client: TestClient) -> None:
        for path in ("/healthz", "/api/status", "/api/history", "/api/peers", "/metrics", "/"):
            assert (await client.post(path, data=b"{}")).status == 405, path
            assert (await client.delete(path)).status == 405, path

    serve(filled_telemetry(), check)


def test_metrics_parse_back_with_run_label() -> None:
    async def check(client: TestClient) -> None:
        response = await client.get("/metrics")
        assert response.status == 200 and response.content_type.startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(await response.text())}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in families.values() for s in f.samples}

        def value(name: str, **labels: str) -> float:
            return samples[(name, tuple(sorted({"run": RUN, **labels}.items())))]

        for name in COUNTERS:
            assert families[name].type == "counter", name
        for name in GAUGES:
            assert families[name].type == "gauge", name
        assert families["diloco_round_seconds"].type == "histogram"
        assert value("diloco_bytes_sent_total") == 2_000_000
        assert value("diloco_bytes_received_total") == 4_000_000
        assert value("diloco_wire_bytes_sent_total") == 2_150_000
        assert value("diloco_wire_bytes_received_total") == 4_300_000
        assert value("diloco_outer_steps_total") == 2
        assert value("diloco_inner_steps_total") == 80
        assert value("diloco_contributions_clipped_total") == 0  # there from the start, not once one is clipped
        assert value("diloco_loss") == 3.9 and value("diloco_eval_loss") == 4.1
        assert value("diloco_compute_utilization") == 0.9
        assert value("diloco_peers") == 2 and value("diloco_compression_ratio") == 16.0
        assert value("diloco_round_seconds_count") == 2 and value("diloco_round_seconds_sum") == 48.0
        buckets = {float(s.labels["le"]): s.value for s in families["diloco_round_seconds"].samples
                   if s.name == "diloco_round_seconds_bucket"}
        assert buckets[10.0] == 1  # the 8 s round, not the 40 s one
        assert buckets[float("inf")] == 2
        assert list(buckets.values()) == sorted(buckets.values())  # cumulative
        for family in families.values():
            assert all(s.labels.get("run") == RUN for s in family.samples), family.name

    serve(filled_telemetry(), check)


def test_unmeasured_wire_bytes_are_left_out_not_reported_as_zero() -> None:
    telemetry = Telemetry(run_id=RUN)  # a node without iproute2 never sets wire_bytes_*

    async def check(client: TestClient) -> None:
        names = {f.name for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        assert "diloco_bytes_sent" in names
        assert not {"diloco_wire_bytes_sent", "diloco_wire_bytes_received"} & names
        assert "diloco_consensus_distance" not in names  # DiLoCo: one φ per group, nothing to measure

    serve(telemetry, check)


def test_an_isolated_node_says_so_and_since_when() -> None:
    async def check(client: TestClient) -> None:
        text = await (await client.get("/metrics")).text()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["diloco_isolated"].samples[0].value == 1.0
        assert families["diloco_isolated_since_seconds"].samples[0].value == 1_700_000_000.0

    serve(Telemetry(run_id=RUN, isolated=True, isolated_since=1_700_000_000.0), check)

    async def check_connected(client: TestClient) -> None:
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        assert families["diloco_isolated"].samples[0].value == 0.0
        assert "diloco_isolated_since_seconds" not in families

    serve(Telemetry(run_id=RUN, isolated=False), check_connected)


def test_noloco_consensus_distance_is_a_gauge() -> None:
    telemetry = Telemetry(run_id=RUN, algorithm="noloco", consensus_distance=0.0042)

    async def check(client: TestClient) -> None:
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        family = families["diloco_consensus_distance"]
        assert family.type == "gauge" and [s.value for s in family.samples] == [0.0042]
        status = await (await client.get("/api/status")).json()
        assert status["algorithm"] == "noloco" and status["consensus_distance"] == 0.0042

    serve(telemetry, check)


def test_status_and_metrics_refresh_live_figures_before_answering() -> None:
    telemetry = Telemetry(run_id=RUN)
    refreshes: list[int] = []

    def refresh() -> None:  # what the wire meter does: sample now, publish the new totals
        refreshes.append(1)
        telemetry.update(wire_bytes_sent=100 * len(refreshes))

    telemetry.refresh_with(refresh)

    async def check(client: TestClient) -> None:
        assert (await get_json(client, "/api/status"))["wire_bytes_sent"] == 100
        await client.get("/metrics")
        assert (await get_json(client, "/api/status"))["wire_bytes_sent"] == 300

    serve(telemetry, check)


def test_large_history_and_swarm_are_served_whole() -> None:
    telemetry = filled_telemetry()
    telemetry.set_peers([peer_row(i, is_self=i == 0) for i in range(500)])
    for index in range(2, 2000):
        telemetry.record_round(round_stats(index))

    async def check(client: TestClient) -> None:
        peers = await get_json(client, "/api/peers")
        assert len(peers["peers"]) == 500
        assert len({p["peer_id"] for p in peers["peers"]}) == 500
        history = await get_json(client, "/api/history")
        assert [r["round"] for r in history["rounds"]] == list(range(2000))
        assert json.loads(json.dumps(history)) == history  # plain JSON all the way down
        metrics = await client.get("/metrics")
        text = await metrics.text()
        count = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "diloco_round_seconds_count"]
        assert count == [2000]

    serve(telemetry, check)


def _metrics_sample_names(telemetry: Telemetry) -> set[str]:
    names: set[str] = set()

    async def check(client: TestClient) -> None:
        text = await (await client.get("/metrics")).text()
        names.update(s.name for f in text_string_to_metric_families(text) for s in f.samples)

    serve(telemetry, check)
    return names


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "diloco-dashboard.json").read_text())
    assert dashboard["schemaVersion"] >= 36
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    (run_variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    assert run_variable["query"]["query"] == "label_values(diloco_outer_steps_total, run)"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 7
    exprs = []
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        exprs += [target["expr"] for target in panel["targets"]]
    return exprs


def test_grafana_dashboard_uses_only_served_metrics() -> None:
    exprs = _dashboard_exprs()
    noloco = filled_telemetry()
    noloco.update(algorithm="noloco", consensus_distance=0.004)
    served = _metrics_sample_names(filled_telemetry()) | _metrics_sample_names(noloco)
    allowed = {f"{name}_total" for name in COUNTERS} | set(GAUGES) | {"diloco_consensus_distance"} | {
        f"diloco_round_seconds_{suffix}" for suffix in ("bucket", "sum", "count")}
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\bdiloco_[a-z_]+", expr))
        assert names, expr
        assert names <= allowed, expr
        assert '$run' in expr, expr  # every panel follows the run picker
        used |= names
    assert used <= served
    assert {"diloco_bytes_sent_total", "diloco_bytes_received_total", "diloco_round_seconds_bucket",
            "diloco_consensus_distance"} <= used
    assert any("histogram_quantile(0.95" in e for e in exprs)
    assert any("rate(diloco_bytes_sent_total" in e for e in exprs)


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        message = "promtool not found (apt-get install prometheus): deploy/prometheus and PromQL NOT checked"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        warnings.warn(message, stacklevel=2)
        pytest.skip(message)
    return promtool


def test_prometheus_config_is_valid() -> None:
    result = subprocess.run([_promtool(), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert "127.0.0.1:7780" in config and "127.0.0.1:7781" in config and "job_name: diloco-node" in config


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every panel query, written as recording rules with the run picker filled in."""
    promtool = _promtool()
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for index, expr in enumerate(_dashboard_exprs()):
        rules += [f"      - record: dashboard:query{index}", f"        expr: {json.dumps(expr.replace('$run', '.*'))}"]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(rules) + "\n")
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_swarm_rows_count_what_our_aggregator_bounded_per_peer() -> None:
    from diloco_node.telemetry.swarm_table import swarm_row

    stats = {"label": "x"}
    assert (swarm_row("peer", stats, False)["clipped"], swarm_row("peer", stats, False)["rejected"]) == (0, 0)
    row = swarm_row("peer", stats, False, bounded=(3, 1))
    assert (row["clipped"], row["rejected"]) == (3, 1)


def test_swarm_rows_read_the_published_stats() -> None:
    from diloco_node.telemetry.swarm_table import swarm_row

    stats = {"label": "n", "rounds": 4, "bytes_sent": 10, "bytes_received": 20, "last_round_bytes_sent": 3,
             "last_round_bytes_received": 5, "wire_bytes_sent": 11, "wire_bytes_received": None,
             "last_exchange_seconds": 2.0, "utilization": 0.5, "time": 1_700_000_000.0,
             "upload_limit_bytes_per_second": 250_000.0, "egress_bytes_per_second": 1_000.5}
    assert swarm_row("me", stats, True) == {
        "peer_id": "me", "label": "n", "rounds": 4, "bytes_sent": 10, "bytes_received": 20,
        "last_round_bytes_sent": 3, "last_round_bytes_received": 5, "wire_bytes_sent": 11,
        "wire_bytes_received": None, "utilization": 0.5, "bandwidth_bps": 32.0, "last_seen": 1_700_000_000.0,
        "is_self": True, "clipped": 0, "rejected": 0, "last_round_inner_steps": None, "last_round_tokens": None,
        "last_round_tokens_per_second": None,
        # its own caps and link rates (docs/architecture.md §14); None where it did not publish them
        "upload_limit_bytes_per_second": 250_000.0, "download_limit_bytes_per_second": None,
        "egress_bytes_per_second": 1_000.5, "ingress_bytes_per_second": None, "last_round_weight": None,
        "last_round_weight_removed": None, "batches_per_step": None}
    # k, the batches a step trained (--speed-spent batch), from its steps and tokens and the run's batch
    assert swarm_row("fast", {"last_round_inner_steps": 4, "last_round_tokens": 3 * 4 * 512.0}, False,
                     batch_tokens=512)["batches_per_step"] == 3.0
    assert swarm_row("fast", {"last_round_inner_steps": 0, "last_round_tokens": 0.0}, False,
                     batch_tokens=512)["batches_per_step"] is None
    assert swarm_row("new", {}, False) == {
        "peer_id": "new", "label": "", "rounds": 0, "bytes_sent": 0, "bytes_received": 0,
        "last_round_bytes_sent": 0, "last_round_bytes_received": 0, "wire_bytes_sent": None,
        "wire_bytes_received": None, "utilization": None, "bandwidth_bps": None, "last_seen": None,
        "is_self": False, "clipped": 0, "rejected": 0, "last_round_inner_steps": None, "last_round_tokens": None,
        "last_round_tokens_per_second": None, "upload_limit_bytes_per_second": None,
        "download_limit_bytes_per_second": None, "egress_bytes_per_second": None, "ingress_bytes_per_second": None,
        "last_round_weight": None, "last_round_weight_removed": None, "batches_per_step": None}


# --- the Host check: a DNS-rebinding page cannot read the status ---------------------------------

ROUTES = ("/", "/healthz", "/api/status", "/api/history", "/api/peers", "/metrics", "/static/dashboard.js")


@pytest.mark.parametrize("host", ["evil.example", "evil.example:7781", "127.0.0.1.nip.io", "localhost.evil.example",
                                  "EVIL.example.", ""])
def test_a_forged_host_is_refused_on_every_route(host: str) -> None:
    async def check(client: TestClient) -> None:
        for path in ROUTES:
            response = await client.get(path, headers={"Host": host})
            assert response.status == 421, (host, path)
            body = await response.text()
            assert RUN not in body and "diloco_" not in body  # nothing of the node's state

    serve(filled_telemetry(), check)


@pytest.mark.parametrize("host", ["127.0.0.1:7781", "127.0.0.1", "10.1.2.3:9100", "[::1]:7781", "::1", "localhost:7781",
                                  "LOCALHOST", "localhost."])
def test_ip_literals_and_localhost_are_served_prometheus_included(host: str) -> None:
    async def check(client: TestClient) -> None:
        assert (await client.get("/api/status", headers={"Host": host})).status == 200
        response = await client.get("/metrics", headers={"Host": host})
        assert response.status == 200 and "diloco_loss" in await response.text()
        assert (await client.get("/", headers={"Host": host})).status == 200

    serve(filled_telemetry(), check)


def test_the_bound_and_announced_names_are_served() -> None:
    from diloco_node.telemetry.server import allowed_hosts, announced_hosts

    hosts = allowed_hosts("status.internal", announced_hosts(["/dns4/node.example.org/tcp/31337",
                                                              "/ip4/1.2.3.4/tcp/31337"]))

    async def main() -> None:
        async with TestClient(TestServer(build_app(filled_telemetry(), hosts))) as client:
            for host in ("status.internal:7781", "node.example.org", "Node.Example.Org.:80"):
                assert (await client.get("/api/status", headers={"Host": host})).status == 200, host
            assert (await client.get("/api/status", headers={"Host": "evil.example"})).status == 421

    asyncio.run(main())
