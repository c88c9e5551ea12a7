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

CONTENT_TYPE = CONTENT_TYPE_LATEST


class TelemetryCollector:
    def __init__(self, telemetry: Telemetry):
        self._telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        state = self._telemetry.snapshot(fresh=True)
        run = str(state.get("run_id", ""))
        counters = {
            "diloco_bytes_sent": ("payload and state bytes this node sent", state.get("bytes_sent")),
            "diloco_bytes_received": ("payload and state bytes this node received", state.get("bytes_received")),
            "diloco_outer_steps": ("outer rounds completed", state.get("outer_step")),
            "diloco_wire_bytes_sent": ("link-layer bytes of all swarm traffic sent (headers and control included)",
                                       state.get("wire_bytes_sent")),
            "diloco_wire_bytes_received": ("link-layer bytes of all swarm traffic received",
                                           state.get("wire_bytes_received")),
            "diloco_inner_steps": ("inner optimizer steps taken", state.get("inner_step")),
            "diloco_contributions_clipped": ("peers' contributions the aggregator scaled down or counted at the "
                                             "token cap", state.get("contributions_clipped", 0)),
            "diloco_contributions_rejected": ("peers' contributions left out: undecodable, non-finite or tokenless",
                                              state.get("contributions_rejected", 0)),
        }
        for name, (doc, value) in counters.items():
            if value is None:  # not measured on this node (wire bytes without iproute2)
                continue
            counter = CounterMetricFamily(name, doc, labels=["run"])
            counter.add_metric([run], float(value or 0))
            yield counter
        gauges = {
            "diloco_loss": ("mean training loss of the last round", state.get("loss")),
            "diloco_eval_loss": ("held-out eval loss of φ", state.get("eval_loss")),
            "diloco_compute_utilization": ("compute / (compute + wait), cumulative", state.get("utilization")),
            "diloco_peers": ("live nodes of this run with our config", state.get("peers")),
            "diloco_compression_ratio": ("fp32 bytes / payload bytes of the last round",
                                         state.get("compression_ratio")),
            "diloco_isolated": ("1 while every peer has vanished and training is paused, else 0",
                                1.0 if state.get("isolated") else 0.0),
        }
        if state.get("isolated_since") is not None:
            gauges["diloco_isolated_since_seconds"] = ("unix time at which the node lost its last peer",
                                                       state.get("isolated_since"))
        if state.get("consensus_distance") is not None:  # NoLoCo only: DiLoCo's group shares one φ
            gauges["diloco_consensus_distance"] = ("‖φ − group mean φ‖ / ‖group mean φ‖ of the last round",
                                                   state.get("consensus_distance"))
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(name, doc, labels=["run"])
            gauge.add_metric([run], math.nan if value is None else float(value))
            yield gauge
        yield _round_seconds(run, self._telemetry)


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
