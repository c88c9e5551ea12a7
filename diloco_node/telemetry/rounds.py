"""One round's statistics: the numbers the status API, the history charts and the round log line
show, from what the round measured."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from diloco_node.outer.update import RoundReport
from diloco_node.swarm.member import SwarmMember
from diloco_node.telemetry.meter import Telemetry
from diloco_node.telemetry.swarm_table import swarm_row
from diloco_node.telemetry.wire import WireMeter


@dataclass(frozen=True)
class RoundTiming:
    compute: float  # seconds of inner steps
    wait: float  # seconds from the end of the inner phase until the outer step (barrier + exchange)


@dataclass(frozen=True)
class Traffic:
    sent: int  # payload and state bytes since start
    received: int
    wire: dict[str, int]  # this round's and the cumulative link-layer bytes ({} if unmeasured)


def round_stats(round_: int, losses: list[float], eval_loss: float, report: RoundReport, timing: RoundTiming,
                traffic: Traffic, before: dict[str, Any], gossip: bool) -> dict[str, Any]:
    """`before` is the status snapshot from before this round's totals were updated."""
    result, own = report.result, report.own
    numel = before["parameters"]
    payload = own.payload_bytes if own else 0
    raw = 4 * numel * (2 if gossip else 1)  # fp32 size of what we sent: NoLoCo sends Δ and φ
    codec_seconds = result.codec_seconds if result else own.codec_seconds if own else 0.0
    stats = {
        "round": round_, "time": time.time(), "loss": sum(losses) / len(losses), "eval_loss": eval_loss,
        "group_size": len(result.group) if result else 0,
        "bytes_sent": traffic.sent - before["bytes_sent"],
        "bytes_received": traffic.received - before["bytes_received"],
        "bytes_sent_total": traffic.sent, "bytes_received_total": traffic.received, **traffic.wire,
        "payload_bytes": payload, "raw_bytes": raw, "compression_ratio": raw / payload if payload else None,
        "bytes_per_param": payload / numel, "codec_seconds": round(codec_seconds, 4),
        "transfer_seconds": round(result.transfer_seconds, 3) if result else None,
        "transfer_bytes": result.received_bytes if result else None,
        "compute_seconds": round(timing.compute, 3), "wait_seconds": round(timing.wait, 3),
        "utilization": timing.compute / (timing.compute + timing.wait),
        "round_seconds": round(timing.compute + timing.wait, 3),
        # peers the aggregator bounded or left out this round, and the totals since start
        "clipped": list(result.clipped) if result else [], "rejected": list(result.rejected) if result else [],
        "contributions_clipped": before.get("contributions_clipped", 0) + (len(result.clipped) if result else 0),
        "contributions_rejected": before.get("contributions_rejected", 0) + (len(result.rejected) if result else 0)}
    if gossip:
        stats.update(group=list(result.group) if result else [], consensus_distance=report.consensus_distance)
    return stats


def round_line(stats: dict[str, Any], digest: str) -> str:
    """The round's log line (key=value, one per round; tests and benchmarks read the JSON status instead)."""
    line = (f"round={stats['round']} loss={stats['loss']:.4f} eval_loss={stats['eval_loss']:.4f} "
            f"group_size={stats['group_size']} sent={stats['bytes_sent']} received={stats['bytes_received']} "
            f"seconds={stats['round_seconds']:.1f} payload={stats['payload_bytes']} "
            f"bytes_per_param={stats['bytes_per_param']:.4f} codec_seconds={stats['codec_seconds']:.3f} "
            f"utilization={stats['utilization']:.3f} transfer={stats['transfer_bytes'] or 0}/"
            f"{stats['transfer_seconds'] or 0.0:.3f}s digest={digest}")
    if "group" in stats:  # NoLoCo: how far φ was from the group's, and who the group was
        distance = stats["consensus_distance"]
        line += (f" consensus_distance={'-' if distance is None else f'{distance:.3e}'}"
                 f" group={','.join(stats['group']) or '-'}")
    return line


class RoundReporter:
    """Publishes each finished round: the status and its history, our presence record's stats (the
    swarm table of every peer), and the round's log line. Used by the round engine's thread only."""

    def __init__(self, telemetry: Telemetry, wire: WireMeter, label: str, gossip: bool):
        self.telemetry, self.wire, self.label, self.gossip = telemetry, wire, label, gossip
        self.compute_seconds = self.wait_seconds = 0.0  # since start, for utilization
        self.wire_at_last_round = (0, 0)
        self.clipped: Counter[str] = Counter()  # per peer: contributions our aggregator bounded
        self.rejected: Counter[str] = Counter()  # and left out

    def finished(self, swarm: SwarmMember, round_: int, losses: list[float], eval_loss: float,
                 report: RoundReport, timing: RoundTiming, digest: str) -> dict[str, Any]:
        """Record the round everywhere; returns its statistics."""
        before = self.telemetry.snapshot()
        sent, received = swarm.traffic()
        self.compute_seconds += timing.compute
        self.wait_seconds += timing.wait
        stats = round_stats(round_, losses, eval_loss, report, timing,
                            Traffic(sent, received, self._wire_this_round()), before, self.gossip)
        self.telemetry.record_round(stats)
        self.clipped.update(stats["clipped"])
        self.rejected.update(stats["rejected"])
        utilization = self.compute_seconds / (self.compute_seconds + self.wait_seconds)
        self.telemetry.update(
            outer_step=round_, loss=stats["loss"], eval_loss=eval_loss, group_size=stats["group_size"],
            group=list(report.result.group) if report.result else [], model_digest=digest, bytes_sent=sent,
            bytes_received=received, last_round_bytes_sent=stats["bytes_sent"],
            last_round_bytes_received=stats["bytes_received"], round_seconds=stats["round_seconds"],
            payload_bytes=stats["payload_bytes"], raw_bytes=stats["raw_bytes"],
            bytes_per_param=stats["bytes_per_param"], compression_ratio=stats["compression_ratio"],
            codec_seconds=stats["codec_seconds"], compute_seconds=round(self.compute_seconds, 3),
            wait_seconds=round(self.wait_seconds, 3), utilization=utilization,
            contributions_clipped=stats["contributions_clipped"],
            contributions_rejected=stats["contributions_rejected"],
            **({"consensus_distance": report.consensus_distance} if self.gossip else {}))
        swarm.presence.publish_stats(
            label=self.label, rounds=round_, bytes_sent=sent, bytes_received=received,
            last_round_bytes_sent=stats["bytes_sent"], last_round_bytes_received=stats["bytes_received"],
            wire_bytes_sent=stats.get("wire_sent_total"), wire_bytes_received=stats.get("wire_received_total"),
            last_exchange_seconds=round(timing.wait, 3), utilization=utilization, time=stats["time"])
        return stats

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

    def swarm_table(self, swarm: SwarmMember, peak_memory: list[int] | None) -> None:
        peers = swarm.presence.compatible_peers()
        self.telemetry.update(peers=len(peers), peak_memory_bytes=peak_memory)
        self.telemetry.set_peers([
            swarm_row(record, peer == swarm.peer_id, (self.clipped[peer], self.rejected[peer]))
            for peer, record in peers.items()])
