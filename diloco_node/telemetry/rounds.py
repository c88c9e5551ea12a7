"""One round's statistics: the numbers the status API, the history charts and the round log line
show, from what the round measured."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from diloco_node.outer.update import RoundReport


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
        "round_seconds": round(timing.compute + timing.wait, 3)}
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
