"""`GET /metrics`: the telemetry in Prometheus text format, built at scrape time.

A custom collector reads the same snapshot and history as the JSON endpoints, so the numbers
Prometheus sees can never drift from the dashboard's, and training never touches a metric object.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from diloco_node.telemetry.meter import Telemetry
from diloco_node.telemetry.record import ROUND_METRICS

CONTENT_TYPE = CONTENT_TYPE_LATEST


# (status key, kind, name, help) of the node's own series; those of the round's figures are declared
# by the round record. Kinds: a counter is left out while unknown (wire bytes without a readable
# kernel), a gauge is NaN while unknown, a gauge_if_known left out, a flag is 1 when true, else 0.
NODE_METRICS = (
    ("wire_bytes_sent", "counter", "diloco_wire_bytes_sent",
     "link-layer bytes of all swarm traffic sent (headers and control included)"),
    ("wire_bytes_received", "counter", "diloco_wire_bytes_received", "link-layer bytes of all swarm traffic received"),
    ("inner_step", "counter", "diloco_inner_steps", "inner optimizer steps taken"),
    ("upload_limit_bytes_per_second", "gauge", "diloco_upload_limit_bytes_per_second",
     "--upload-limit in bytes/s (0: no cap)"),
    ("download_limit_bytes_per_second", "gauge", "diloco_download_limit_bytes_per_second",
     "--download-limit in bytes/s (0: no cap)"),
    ("egress_bytes_per_second", "gauge_if_known", "diloco_egress_bytes_per_second",
     "link-layer bytes/s sent over the last seconds (headers and DHT traffic included)"),
    ("ingress_bytes_per_second", "gauge_if_known", "diloco_ingress_bytes_per_second",
     "link-layer bytes/s received over the last seconds"),
    ("stream_egress_bytes_per_second", "gauge_if_known", "diloco_stream_egress_bytes_per_second",
     "bytes/s our run's streams sent over the last 5 s (what --upload-limit paces)"),
    ("stream_ingress_bytes_per_second", "gauge_if_known", "diloco_stream_ingress_bytes_per_second",
     "bytes/s our run's streams received over the last 5 s (what --download-limit paces)"),
    ("peers", "gauge", "diloco_peers", "live nodes of this run with our config"),
    ("isolated", "flag", "diloco_isolated", "1 while every peer has vanished and training is paused, else 0"),
    ("isolated_since", "gauge_if_known", "diloco_isolated_since_seconds",
     "unix time at which the node lost its last peer"),
)
METRICS = ROUND_METRICS + NODE_METRICS


class TelemetryCollector:
    def __init__(self, telemetry: Telemetry):
        self._telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        state = self._telemetry.snapshot(fresh=True)
        run = str(state.get("run_id", ""))
        for key, kind, name, doc in sorted(METRICS, key=lambda spec: spec[1] != "counter"):  # counters first
            value = state.get(key)
            if kind == "flag":
                value = 1.0 if value else 0.0
            elif value is None and kind != "gauge":  # not measured on this node, or not (yet) known
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric = family(name, doc, labels=["run"])
            metric.add_metric([run], math.nan if value is None else float(value))
            yield metric
        yield from _peer_streams(run, state.get("peer_streams") or [])
        yield _round_seconds(run, self._telemetry)


# (row key, name, help) of the per-peer series: a label `peer` per row of `peer_streams`, which names
# at most the 16 busiest peers and "other" (swarm/peer_traffic.py), so the label set stays bounded
PEER_METRICS = (
    ("stream_egress_bytes_per_second", "diloco_peer_stream_egress_bytes_per_second",
     "bytes/s our run's streams sent to the peer over the last 5 s (\"other\": the peers not named)"),
    ("stream_ingress_bytes_per_second", "diloco_peer_stream_ingress_bytes_per_second",
     "bytes/s our run's streams received from the peer over the last 5 s (\"other\": the peers not named)"),
)


def _peer_streams(run: str, rows: list[dict[str, object]]) -> Iterator[Metric]:
    for key, name, doc in PEER_METRICS:
        family = GaugeMetricFamily(name, doc, labels=["run", "peer"])
        for row in rows:
            value = row.get(key)
            if isinstance(value, int | float):
                family.add_metric([run, str(row.get("peer_id"))], float(value))
        yield family


def _round_seconds(run: str, telemetry: Telemetry) -> HistogramMetricFamily:
    buckets, count, total = telemetry.round_seconds_histogram()
    family = HistogramMetricFamily("diloco_round_seconds", "wall time of an outer round", labels=["run"])
    family.add_metric([run], [(str(bound), float(n)) for bound, n in buckets] + [("+Inf", float(count))],
                      sum_value=total)
    return family


def render(telemetry: Telemetry) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TelemetryCollector(telemetry))  # type: ignore[arg-type]
    return generate_latest(registry)
