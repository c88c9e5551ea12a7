"""The terminal view of a node: `diloco-node status` turns /api/status and /api/peers into text.

Pure functions from the server's JSON dicts to strings, so the view is tested without a network.
Every field may be missing or null (a node that has not finished a round yet has no loss, an older
node may not report a newer field); those print as "-" instead of failing. The keys read are
/api/status's (telemetry/meter.STATUS_FIELDS; a round's figures declared once by telemetry/record.py)
and the swarm table's rows (telemetry/swarm_table.py); tests/unit/test_record.py holds them to those.
Every string the server sends is shown escaped and cut (`shown`): a peer's label reaches the swarm
table from its record, and a label carrying terminal escapes (ANSI colours, cursor moves, a
rewritten title) or line breaks would otherwise act on the user's terminal or forge rows
(docs/architecture.md §9).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from diloco_node.trust.shown import TEXT_CHARS, shown

MISSING = "-"
PEER_ID_CHARS = 12  # enough to tell peers apart in a table; the full id is in the node section
LABEL_CHARS = 64  # a label as records bound it (swarm/records.py): an honest one is never cut
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _number(value: Any) -> float | None:
    """A finite number, or None for anything else (missing, null, NaN, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def human_bytes(value: Any) -> str:
    """1536 → '1.5 KiB'; whole bytes below 1 KiB; '-' for a missing value."""
    amount = _number(value)
    if amount is None:
        return MISSING
    if abs(amount) < 1024:
        return f"{amount:.0f} B"
    unit = 0
    while abs(amount) >= 1024 and unit < len(_BYTE_UNITS) - 1:
        amount /= 1024
        unit += 1
    return f"{amount:.1f} {_BYTE_UNITS[unit]}"


def mbit_per_s(bits_per_second: Any) -> str:
    rate = _number(bits_per_second)
    return MISSING if rate is None else f"{rate / 1e6:.2f}"


def percent(fraction: Any) -> str:
    """A 0..1 fraction as a percentage: 0.873 → '87.3%'."""
    share = _number(fraction)
    return MISSING if share is None else f"{share * 100:.1f}%"


def decimal(value: Any, digits: int = 4) -> str:
    number = _number(value)
    return MISSING if number is None else f"{number:.{digits}f}"


def text(value: Any, limit: int = TEXT_CHARS) -> str:
    """A server-sent value shown (`shown`), or '-' for a missing one."""
    return MISSING if value is None or value == "" else shown(value, limit)


def ago(timestamp: Any, now: float) -> str:
    """A unix time as '12s ago' (never negative: clocks of two machines may disagree slightly)."""
    when = _number(timestamp)
    return MISSING if when is None else f"{max(0, round(now - when))}s ago"


def short_peer_id(peer_id: Any) -> str:
    ident = text(peer_id)
    return ident if len(ident) <= PEER_ID_CHARS else ident[:4] + ".." + ident[-(PEER_ID_CHARS - 6):]


def _traffic(payload: Any, wire: Any) -> str:
    """'1.5 MiB payload, 1.7 MiB on the wire', or just the payload where the node can't measure its wire."""
    if _number(wire) is None:
        return human_bytes(payload)
    return f"{human_bytes(payload)} payload, {human_bytes(wire)} on the wire"


def _swarm(status: dict[str, Any], now: float) -> str:
    if status.get("isolated") is not True:
        return "connected" if status.get("isolated") is False else MISSING
    return f"ISOLATED since {ago(status.get('isolated_since'), now)}; training paused, retrying peers"


def format_status(status: dict[str, Any], now: float | None = None) -> str:
    """The node's own state as aligned 'key  value' lines."""
    compression = text(status.get("compression"))
    bytes_per_param = _number(status.get("bytes_per_param"))
    if bytes_per_param is not None:
        compression += f" ({bytes_per_param:.3f} B/param)"
    maddrs = status.get("maddrs") or []
    rows = [
        ("run", text(status.get("run_id"))),
        ("peer id", text(status.get("peer_id"))),
        ("label", text(status.get("label"))),
        ("address", text(maddrs[0]) if isinstance(maddrs, list) and maddrs else MISSING),
        ("round", f"{text(status.get('outer_step'))} (inner step {text(status.get('inner_step'))})"),
        ("loss", f"{decimal(status.get('loss'))} (eval {decimal(status.get('eval_loss'))})"),
        ("sent", _traffic(status.get("bytes_sent"), status.get("wire_bytes_sent"))),
        ("received", _traffic(status.get("bytes_received"), status.get("wire_bytes_received"))),
        ("compression", compression),
        ("utilization", percent(status.get("utilization"))),
        ("round time", MISSING if _number(status.get("round_seconds")) is None
         else f"{decimal(status.get('round_seconds'), 1)}s"),
        ("peers", f"{text(status.get('peers'))} (last group {text(status.get('group_size'))})"),
        ("swarm", _swarm(status, time.time() if now is None else now)),
    ]
    if status.get("algorithm") == "noloco":
        distance = _number(status.get("consensus_distance"))
        rows.append(("algorithm", "noloco (consensus distance "
                     f"{MISSING if distance is None else f'{distance:.2e}'})"))
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


PEER_COLUMNS = ("PEER", "LABEL", "ROUNDS", "SENT", "RECEIVED", "MBIT/S", "UTIL", "LAST SEEN")
_RIGHT_ALIGNED = {"ROUNDS", "SENT", "RECEIVED", "MBIT/S", "UTIL"}


def _first_number(*values: Any) -> Any:
    return next((value for value in values if _number(value) is not None), None)


def _peer_row(peer: dict[str, Any], now: float) -> tuple[str, ...]:
    marker = " *" if peer.get("is_self") else ""
    return (
        short_peer_id(peer.get("peer_id")) + marker,
        text(peer.get("label"), LABEL_CHARS),  # a peer's own word, from its record
        text(peer.get("rounds")),
        human_bytes(_first_number(peer.get("wire_bytes_sent"), peer.get("bytes_sent"))),  # the link's cost
        human_bytes(_first_number(peer.get("wire_bytes_received"), peer.get("bytes_received"))),
        mbit_per_s(peer.get("bandwidth_bps")),
        percent(peer.get("utilization")),
        ago(peer.get("last_seen"), now),
    )


def format_peers(peers: Sequence[dict[str, Any]], now: float) -> str:
    """The swarm as a table, one row per peer; '*' marks this node. `now` is a unix time."""
    if not peers:
        return "no peers seen yet"
    rows = [PEER_COLUMNS, *(_peer_row(peer, now) for peer in peers)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(PEER_COLUMNS))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if name in _RIGHT_ALIGNED else cell.ljust(w)
                 for cell, w, name in zip(row, widths, PEER_COLUMNS, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def render(status: dict[str, Any], peers: dict[str, Any], now: float) -> str:
    """The whole view from the bodies of /api/status and /api/peers."""
    rows = peers.get("peers") if isinstance(peers, dict) else None
    rows = [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []
    return f"{format_status(status, now)}\n\nswarm ({len(rows)} peers)\n{format_peers(rows, now)}"
