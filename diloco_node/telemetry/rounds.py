"""One finished round into the telemetry: its record (telemetry/record.py) from what the round
measured, the status and its history, the stats our presence record publishes, and the swarm table.

Reads what it is handed (the round's report, a snapshot of the peers' published stats) and publishes
nothing itself: the node hands `peer_stats` to the swarm (docs/architecture.md, telemetry ↛ swarm, outer).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco_node.round import RoundReport
from diloco_node.telemetry.meter import Telemetry
from diloco_node.telemetry.planning import Planner
from diloco_node.telemetry.record import RoundRecord, SettledRecord
from diloco_node.telemetry.swarm_table import swarm_row
from diloco_node.telemetry.wire import WireMeter


@dataclass(frozen=True)
class RoundTiming:
    compute: float  # seconds of inner steps
    wait: float  # seconds from the end of the inner phase until the outer step (barrier + exchange)
    data_wait: float = 0.0  # of `compute`: seconds the inner steps waited for their batches (train/prefetch.py)
    moved_at: float | None = None  # unix time the outer step was done (the dashboard's fragment timeline)


@dataclass(frozen=True)
class Traffic:
    sent: int  # payload and state bytes since start
    received: int
    wire: dict[str, int]  # this round's and the cumulative link-layer bytes ({} if unmeasured)


def round_record(round_: int, losses: list[float], eval_loss: float, report: RoundReport, timing: RoundTiming,
                 traffic: Traffic, before: Mapping[str, Any], gossip: bool, digest: str,
                 peak_memory: list[int] | None = None, fragment: int = 0) -> RoundRecord:
    """`before` is the status snapshot from before this round's totals were updated; `fragment`: the
    one this round exchanged and stepped (docs/architecture.md §15)."""
    result, own = report.result, report.own
    tokens = own.tokens if own else 0.0  # what we declared with our Δ (steps × batch × seq_len)
    numel = before["parameters"]
    payload = own.payload_bytes if own else 0
    raw = 4 * numel * (2 if gossip else 1)  # fp32 size of what we sent: NoLoCo sends Δ and φ
    codec_seconds = result.codec_seconds if result else own.codec_seconds if own else 0.0
    clipped, rejected = (result.clipped, result.rejected) if result else ((), ())
    return RoundRecord(
        round=round_, time=time.time(), loss=sum(losses) / len(losses) if losses else None, eval_loss=eval_loss,
        group_size=len(result.group) if result else 0,
        bytes_sent=traffic.sent - before["bytes_sent"], bytes_received=traffic.received - before["bytes_received"],
        bytes_sent_total=traffic.sent, bytes_received_total=traffic.received, **traffic.wire,
        payload_bytes=payload, raw_bytes=raw, compression_ratio=raw / payload if payload else None,
        bytes_per_param=payload / numel, codec_seconds=round(codec_seconds, 4),
        transfer_seconds=round(result.transfer_seconds, 3) if result else None,
        transfer_bytes=result.received_bytes if result else None,
        compute_seconds=round(timing.compute, 3), wait_seconds=round(timing.wait, 3),
        data_wait_seconds=round(timing.data_wait, 4),
        utilization=timing.compute / (timing.compute + timing.wait),
        round_seconds=round(timing.compute + timing.wait, 3),
        clipped=tuple(clipped), rejected=tuple(rejected),
        contributions_clipped=before.get("contributions_clipped", 0) + len(clipped),
        contributions_rejected=before.get("contributions_rejected", 0) + len(rejected),
        group=tuple(result.group) if result else (), consensus_distance=report.consensus_distance if gossip else None,
        digest=digest, peak_memory_bytes=tuple(peak_memory) if peak_memory is not None else None,
        outcome=str(report.outcome), gossip=gossip, last_round_inner_steps=len(losses), last_round_tokens=tokens,
        last_round_tokens_per_second=round(tokens / timing.compute, 1) if timing.compute > 0 else 0.0,
        skipped=not losses, fragment=fragment, moved_at=timing.moved_at,
        last_round_weight=round(result.own_share, 4) if result else 0.0,
        weight_removed=round(result.weight_removed, 4) if result else 0.0,
        group_round=report.group_round if report.group_round not in (None, round_) else None)


class RoundReporter:
    """Records each finished round: the status and its history, the stats for our presence record, the
    swarm table of every peer. Used by the round engine's thread only."""

    def __init__(self, telemetry: Telemetry, wire: WireMeter, label: str, gossip: bool,
                 planner: Planner | None = None, caps: tuple[float, float] = (0.0, 0.0), batch_tokens: int = 0):
        """`planner`: told of every round, says once when the exchange cannot keep up with the caps;
        `caps`: our upload and download limits in bytes/s (0: none), published with our stats;
        `batch_tokens`: the run's tokens per batch, for the swarm table's batches per step."""
        self.telemetry, self.wire, self.label, self.gossip = telemetry, wire, label, gossip
        self.planner, self.caps, self.batch_tokens = planner, caps, batch_tokens
        self.compute_seconds = self.wait_seconds = 0.0  # since start, for utilization
        self.wire_at_last_round = (0, 0)
        self.clipped: Counter[str] = Counter()  # per peer: contributions our aggregator bounded
        self.rejected: Counter[str] = Counter()  # and left out

    def finished(self, round_: int, losses: list[float], eval_loss: float, report: RoundReport,
                 timing: RoundTiming, digest: str, traffic: tuple[int, int],
                 peak_memory: list[int] | None = None, fragment: int = 0) -> RoundRecord:
        """Record the round in the status and its history; `traffic`: (sent, received) payload and
        state bytes since start. Returns the round's record (its event, log line and peer stats)."""
        before = self.telemetry.snapshot()
        sent, received = traffic
        self.compute_seconds += timing.compute
        self.wait_seconds += timing.wait
        record = round_record(round_, losses, eval_loss, report, timing,
                              Traffic(sent, received, self._wire_this_round()), before, self.gossip, digest,
                              peak_memory, fragment)
        self.telemetry.record_round(record.event())
        self.clipped.update(record.clipped)
        self.rejected.update(record.rejected)
        self.telemetry.update(**record.status(self._since_start()))
        if self.planner is not None:
            # the group the exchange was for: an exchange the cap made time out leaves a smaller one
            # in the record, down to ourselves alone (NoLoCo's drawn groups are the record's)
            expected = record.group_size if self.gossip else max(record.group_size, before.get("peers") or 0)
            self.planner.check(record.payload_bytes, expected, record.compute_seconds)
            self.planner.check_state(record.round_seconds)
        return record

    def peer_stats(self, record: RoundRecord) -> dict[str, Any]:
        """What our presence record publishes after `record`'s round (trust/records.py's NodeStats fields)."""
        seconds = record.round_seconds
        def mean_rate(moved: int | None) -> float | None:  # the link's bytes/s over the round, all traffic
            return round(moved / seconds, 1) if moved is not None and seconds > 0 else None

        return {"label": self.label, **record.peer_stats(self._since_start()),
                "upload_limit_bytes_per_second": self.caps[0], "download_limit_bytes_per_second": self.caps[1],
                "egress_bytes_per_second": mean_rate(record.wire_sent),
                "ingress_bytes_per_second": mean_rate(record.wire_received)}

    def settled(self, round_: int, eval_loss: float, digest: str, traffic: tuple[int, int]) -> SettledRecord:
        """An overlapped run's last exchange, applied on leaving: the status, and the settled event's
        record (the bytes that exchange moved after the last round line)."""
        before = self.telemetry.snapshot()
        sent, received = traffic
        self.telemetry.update(eval_loss=eval_loss, model_digest=digest, bytes_sent=sent, bytes_received=received)
        return SettledRecord(round=round_, eval_loss=eval_loss, digest=digest,
                             bytes_sent=sent - before["bytes_sent"], bytes_received=received - before["bytes_received"])

    def swarm_table(self, peers: Mapping[str, Mapping[str, Any]], own_peer_id: str,
                    peak_memory: list[int] | None) -> None:
        """`peers`: each live peer's published stats (ourselves included), by peer id."""
        self.telemetry.update(peers=len(peers), peak_memory_bytes=peak_memory)
        self.telemetry.set_peers([
            swarm_row(peer, stats, peer == own_peer_id, (self.clipped[peer], self.rejected[peer]), self.batch_tokens)
            for peer, stats in peers.items()])

    def _since_start(self) -> dict[str, float]:
        compute, wait = self.compute_seconds, self.wait_seconds
        return {"compute_seconds": round(compute, 3), "wait_seconds": round(wait, 3),
                "utilization": compute / (compute + wait)}

    def _wire_this_round(self) -> dict[str, int]:
        """This round's and the cumulative link-layer bytes (see telemetry/wire.py); {} if unmeasured."""
        self.wire.refresh(max_age=0)
        totals = self.wire.totals()
        if totals is None:
            return {}
        (sent, received), (last_sent, last_received) = totals, self.wire_at_last_round
        self.wire_at_last_round = totals
        return {"wire_sent": sent - last_sent, "wire_received": received - last_received,
                "wire_sent_total": sent, "wire_received_total": received}
