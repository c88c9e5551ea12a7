"""The round record (telemetry/record.py): one declaration of a round's figures, read by the event, the
log line, /api/status, /metrics, the presence stats, the swarm table, the status view and the dashboard."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_node.round import AverageResult, Outcome, Own, RoundReport
from diloco_node.telemetry.meter import STATUS_FIELDS, Telemetry
from diloco_node.telemetry.record import (
    GOSSIP_FIELDS,
    PEER_STATS_FIELDS,
    WIRE_FIELDS,
    RoundRecord,
    SettledRecord,
    round_fields,
)
from diloco_node.telemetry.rounds import RoundReporter, RoundTiming
from diloco_node.telemetry.swarm_table import swarm_row

PACKAGE = Path(__file__).resolve().parents[2] / "diloco_node"
# the round event's keys before the record (its log line and history entry), in their order
EVENT_KEYS = ("round", "time", "loss", "eval_loss", "group_size", "bytes_sent", "bytes_received", "bytes_sent_total",
              "bytes_received_total", "payload_bytes", "raw_bytes", "compression_ratio", "bytes_per_param",
              "codec_seconds", "transfer_seconds", "transfer_bytes", "compute_seconds", "wait_seconds", "utilization",
              "round_seconds", "clipped", "rejected", "contributions_clipped", "contributions_rejected")


def sample(**changes: Any) -> RoundRecord:
    values: dict[str, Any] = dict(
        round=4, time=1_795_000_004.25, loss=2.98123, eval_loss=2.78, group_size=2, bytes_sent=1644398,
        bytes_received=1644397, bytes_sent_total=6_000_000, bytes_received_total=6_100_000, payload_bytes=1644370,
        raw_bytes=1_849_000, compression_ratio=1.1244, bytes_per_param=3.55712, codec_seconds=0.0201,
        transfer_seconds=0.139, transfer_bytes=1644370, compute_seconds=2.1, wait_seconds=3.023, utilization=0.4123,
        round_seconds=5.123, clipped=("b",), rejected=(), contributions_clipped=3, contributions_rejected=0,
        group=("a", "b"), digest="546cabc", peak_memory_bytes=(123, 456), outcome="together")
    return RoundRecord(**{**values, **changes})


@pytest.mark.parametrize("record", [
    sample(),
    sample(wire_sent=10, wire_received=20, wire_sent_total=100, wire_received_total=200),
    sample(gossip=True, consensus_distance=0.00123),
    sample(gossip=True, group=(), consensus_distance=None, transfer_seconds=None, transfer_bytes=None,
           compression_ratio=None, peak_memory_bytes=None, outcome="alone"),
], ids=["diloco", "wire", "noloco", "noloco-alone"])
def test_event_round_trips_through_json_and_from_event(record: RoundRecord) -> None:
    event = json.loads(json.dumps({"event": "round", **record.event()}))
    carried = record if record.gossip else dataclasses.replace(record, group=())  # DiLoCo's event has no group
    assert RoundRecord.from_event(event) == carried
    assert RoundRecord.from_event({**event, "a_newer_field": 1}) == carried  # tolerant of what it doesn't know
    assert RoundRecord.from_event(event).event() == record.event()


def test_event_keeps_todays_keys_and_leaves_out_what_was_never_there() -> None:
    tail = ("digest", "peak_memory_bytes", "outcome", "data_wait_seconds", "last_round_inner_steps",
            "last_round_tokens", "last_round_tokens_per_second", "skipped", "fragment", "moved_at",
            "last_round_weight", "weight_removed", "group_round")
    assert tuple(sample().event()) == EVENT_KEYS + tail
    measured = sample(wire_sent=10, wire_received=20, wire_sent_total=100, wire_received_total=200).event()
    assert tuple(measured) == EVENT_KEYS[:9] + WIRE_FIELDS + EVENT_KEYS[9:] + tail
    noloco = sample(gossip=True, consensus_distance=None).event()
    assert tuple(noloco) == EVENT_KEYS + GOSSIP_FIELDS + tail
    assert noloco["group"] == ["a", "b"] and noloco["consensus_distance"] is None
    assert sample().event()["clipped"] == ["b"] and sample().event()["peak_memory_bytes"] == [123, 456]
    assert set(round_fields()) == {spec.name for spec in dataclasses.fields(RoundRecord)} - {"gossip"}


def test_an_older_event_reads_with_nones_for_what_it_lacks() -> None:
    event = {key: value for key, value in sample().event().items() if key not in ("outcome", "peak_memory_bytes")}
    record = RoundRecord.from_event(event)
    assert record.outcome is None and record.peak_memory_bytes is None and record.wire_sent is None
    assert not record.gossip and record.group == ()  # a DiLoCo event never carried its group


def test_log_line_is_todays_format() -> None:
    head = ("round=4 loss=2.9812 eval_loss=2.7800 group_size=2 sent=1644398 received=1644397 seconds=5.1 "
            "payload=1644370 bytes_per_param=3.5571 codec_seconds=0.020 utilization=0.412 ")
    trained = " inner_steps=0 tokens=0"
    assert sample().log_line() == head + "transfer=1644370/0.139s digest=546cabc" + trained
    unfetched = sample(transfer_bytes=None, transfer_seconds=None, digest="d")
    assert unfetched.log_line() == head + "transfer=0/0.000s digest=d" + trained
    assert sample(gossip=True, consensus_distance=0.00123, digest="d").log_line() == (
        head + "transfer=1644370/0.139s digest=d" + trained + " consensus_distance=1.230e-03 group=a,b")
    # --round-seconds (docs/architecture.md §13): what the round trained, and a round that trained nothing
    assert sample(last_round_inner_steps=7, last_round_tokens=7168.0).log_line().endswith(
        "digest=546cabc inner_steps=7 tokens=7168")
    skipped = sample(loss=None, skipped=True).log_line()
    assert skipped.startswith("round=4 loss=- eval_loss=2.7800 ") and skipped.endswith("tokens=0 skipped")
    assert sample(gossip=True, group=(), digest="d").log_line() == (
        head + "transfer=1644370/0.139s digest=d" + trained + " consensus_distance=- group=-")
    # eager and delayed: the group is that of the exchange that landed, an earlier round's
    assert sample(group_round=3).log_line().startswith("round=4 loss=2.9812 eval_loss=2.7800 group_size=2 "
                                                       "group_round=3 sent=1644398 ")


def test_settled_record_spells_bytes_as_the_round_event() -> None:
    settled = SettledRecord(round=9, eval_loss=2.5, digest="abc", bytes_sent=10, bytes_received=20)
    assert settled.event() == {"round": 9, "eval_loss": 2.5, "digest": "abc", "bytes_sent": 10, "bytes_received": 20}
    assert settled.log_line() == "settled round=9 eval_loss=2.5000 sent=10 received=20 digest=abc"
    assert SettledRecord.from_event({"event": "settled", **settled.event()}) == settled
    older = {"event": "settled", "round": 9, "eval_loss": 2.5, "digest": "abc", "sent": 10, "received": 20}
    assert SettledRecord.from_event(older) == settled


class FakeWire:
    def __init__(self, totals: tuple[int, int] | None):
        self._totals = totals

    def refresh(self, max_age: float = 0) -> None:
        pass

    def totals(self) -> tuple[int, int] | None:
        return self._totals


def _report(gossip: bool) -> RoundReport:
    own = Own(payload=b"x" * 500, decoded=None, tokens=1.0, codec_seconds=0.01)
    result = AverageResult(group=("me", "b"), mean=torch.zeros(1), own_share=0.5, codec_seconds=0.0234567,
                           transfer_seconds=0.13912, received_bytes=480, clipped=("b",), weight_removed=0.25)
    return RoundReport(Outcome.TOGETHER, own, result, consensus_distance=0.0012 if gossip else None)


@pytest.mark.parametrize("gossip", [False, True], ids=["diloco", "noloco"])
def test_reporter_feeds_status_history_peer_stats_and_swarm_table(gossip: bool) -> None:
    telemetry = Telemetry(run_id="r", parameters=1000)
    reporter = RoundReporter(telemetry, FakeWire((1000, 2000)), "lbl", gossip,  # type: ignore[arg-type]
                             caps=(250_000.0, 0.0))
    record = reporter.finished(3, [1.0, 2.0], 1.7, _report(gossip),
                               RoundTiming(2.0, 0.5, data_wait=0.25, moved_at=1_795_000_000.5), "dig",
                               traffic=(5000, 7000), peak_memory=[123], fragment=2)
    assert (record.fragment, record.moved_at) == (2, 1_795_000_000.5)  # the dashboard's fragment timeline
    first = reporter.peer_stats(record)  # the link's mean rates over the round: its wire bytes / 2.5 s
    assert (first["egress_bytes_per_second"], first["ingress_bytes_per_second"]) == (400.0, 800.0)
    assert (record.round, record.loss, record.group_size, record.outcome) == (3, 1.5, 2, "together")
    assert (record.bytes_sent, record.bytes_sent_total, record.payload_bytes) == (5000, 5000, 500)
    assert (record.raw_bytes, record.compression_ratio) == (8000 if gossip else 4000, 16.0 if gossip else 8.0)
    assert (record.wire_sent, record.wire_received_total, record.codec_seconds) == (1000, 2000, 0.0235)
    assert (record.transfer_seconds, record.transfer_bytes, record.utilization) == (0.139, 480, 0.8)
    assert record.clipped == ("b",) and record.contributions_clipped == 1 and record.gossip is gossip
    assert ("consensus_distance=1.200e-03 group=me,b" in record.log_line()) is gossip
    status = telemetry.snapshot()
    assert {key: status[key] for key in ("outer_step", "bytes_sent", "last_round_bytes_sent", "model_digest",
                                         "group", "compute_seconds", "utilization", "contributions_clipped")} == {
        "outer_step": 3, "bytes_sent": 5000, "last_round_bytes_sent": 5000, "model_digest": "dig",
        "group": ["me", "b"], "compute_seconds": 2.0, "utilization": 0.8, "contributions_clipped": 1}
    assert status["consensus_distance"] == (0.0012 if gossip else None)
    assert status["data_wait_seconds"] == record.data_wait_seconds == 0.25  # the last round's, not a total
    assert telemetry.history() == [record.event()]
    assert record.group_round is None  # the round's own exchange: nothing to say
    late = dataclasses.replace(_report(gossip), group_round=2)  # an overlapped round's exchange lands a round late
    record = reporter.finished(4, [1.0], 1.6, late, RoundTiming(1.0, 1.5), "dig2", traffic=(6000, 9000))
    status = telemetry.snapshot()
    assert record.group_round == status["group_round"] == 2 and "group_size=2 group_round=2 " in record.log_line()
    assert (status["compute_seconds"], status["wait_seconds"], status["utilization"]) == (3.0, 2.0, 0.6)
    assert status["data_wait_seconds"] == 0.0
    trained = (status["last_round_inner_steps"], status["last_round_tokens"], status["last_round_skipped"])
    assert trained == (1, 1.0, False)
    assert (record.bytes_sent, record.bytes_received, record.utilization, status["contributions_clipped"]) == (
        1000, 2000, 0.4, 2)
    stats = reporter.peer_stats(record)
    assert stats == {"label": "lbl", "rounds": 4, "bytes_sent": 6000, "bytes_received": 9000,
                     "last_round_bytes_sent": 1000, "last_round_bytes_received": 2000, "wire_bytes_sent": 1000,
                     "wire_bytes_received": 2000, "last_exchange_seconds": 1.5, "utilization": 0.6, "time": record.time,
                     # what the round trained: 1 step, the tokens we declared (1.0), over 1 s of compute
                     "last_round_inner_steps": 1, "last_round_tokens": 1.0, "last_round_tokens_per_second": 1.0,
                     # our caps, and the link's mean rates over the round (no wire bytes moved since round 3)
                     "upload_limit_bytes_per_second": 250_000.0, "download_limit_bytes_per_second": 0.0,
                     "egress_bytes_per_second": 0.0, "ingress_bytes_per_second": 0.0,
                     "last_round_weight": 0.5,  # our share of the mean we applied
                     "last_round_weight_removed": 0.25}  # what our caps and clip took from the group
    reporter.swarm_table({"me": stats, "b": {"label": "other"}}, "me", [77])
    rows = {row["peer_id"]: row for row in telemetry.peers()}
    assert rows["me"]["is_self"] and rows["me"]["rounds"] == 4 and rows["me"]["bandwidth_bps"] == 8 * 3000 / 1.5
    assert (rows["b"]["clipped"], rows["b"]["rejected"], rows["b"]["label"]) == (2, 0, "other")
    assert telemetry.snapshot()["peers"] == 2 and telemetry.snapshot()["peak_memory_bytes"] == [77]
    settled = reporter.settled(4, 1.5, "dig3", traffic=(6500, 9100))
    assert settled == SettledRecord(round=4, eval_loss=1.5, digest="dig3", bytes_sent=500, bytes_received=100)
    assert (telemetry.snapshot()["bytes_sent"], telemetry.snapshot()["model_digest"]) == (6500, "dig3")


def test_unmeasured_wire_publishes_none_and_leaves_the_event_without_wire_keys() -> None:
    reporter = RoundReporter(Telemetry(parameters=10), FakeWire(None), "", False)  # type: ignore[arg-type]
    record = reporter.finished(1, [1.0], 1.0, _report(False), RoundTiming(1.0, 1.0), "d", traffic=(1, 2))
    assert not set(WIRE_FIELDS) & set(record.event())
    stats = reporter.peer_stats(record)
    assert stats["wire_bytes_sent"] is None and stats["wire_bytes_received"] is None
    assert stats["egress_bytes_per_second"] is None and stats["ingress_bytes_per_second"] is None


def test_presence_stats_are_the_fields_the_swarm_validates() -> None:
    from diloco_node.trust.records import NodeStats  # the record's schema of what we publish

    assert set(PEER_STATS_FIELDS) == set(NodeStats.__fields__)


# --- readers that are not Python: each round, status and peer field they read is declared --------

def _swarm_row_keys() -> set[str]:
    return set(swarm_row("p", {}, False))


def test_the_dashboard_reads_only_declared_fields() -> None:
    script = (PACKAGE / "telemetry" / "static" / "dashboard.js").read_text()
    charts = script[script.index("// --- charts"):script.index("// --- swarm table")]  # one r per round there
    per_round = set(re.findall(r"\br\.([a-z_]+)", charts))
    assert per_round and per_round <= set(round_fields()), per_round - set(round_fields())
    status = set(re.findall(r"\bs\.([a-z_]+)", script))
    assert status and status <= set(STATUS_FIELDS), status - set(STATUS_FIELDS)
    peers = set(re.findall(r"\bp\.([a-z_]+)", script)) | set(re.findall(r"p\[`([a-z_]+)\$\{way\}`\]", script))
    expanded = {name + way if name.endswith("_") else name for name in peers for way in ("sent", "received")}
    assert expanded and expanded <= _swarm_row_keys(), expanded - _swarm_row_keys()


def test_the_status_view_reads_only_declared_fields() -> None:
    source = (PACKAGE / "commands/status_view.py").read_text()
    status = set(re.findall(r"status\.get\([\"']([a-z_]+)[\"']\)", source))
    assert status and status <= set(STATUS_FIELDS), status - set(STATUS_FIELDS)
    peers = set(re.findall(r"peer\.get\([\"']([a-z_]+)[\"']\)", source))
    assert peers and peers <= _swarm_row_keys(), peers - _swarm_row_keys()
