"""One finished round as one typed record: the `round` event, the status history, `/api/status`,
`/metrics`, our DHT stats and the round log line are all read off it (docs/architecture.md).

Each figure of a round is declared here once, as a field of `RoundRecord`, with one spelling. A
field's metadata says where else it shows, under which name:

- `status`: its key in `/api/status` (meter.STATUS_FIELDS lists these among the node's own keys);
- `peer`: its key in the stats our presence record publishes (the swarm table's columns);
- `since_start`: where (`status`, `peer`) the value is the running total since start, not this round's;
- `metric`: (kind, Prometheus name, help) of the series `/metrics` serves from that status key; kind
  is `counter`, `gauge` (NaN while unknown) or `gauge_if_known` (left out while unknown).

Some figures exist only sometimes: the wire bytes where the node can measure its link, and NoLoCo's
`group` and `consensus_distance`. The record holds None for an unmeasured wire figure, and the
`round` event leaves such keys out (as it always did), so readers that ask `"group" in event` or
`"wire_sent" in event` keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

STATUS, SINCE_START, PEER, METRIC = "status", "since_start", "peer", "metric"
# keys the round event carries only when known: wire figures when measured, NoLoCo's when gossiping
WIRE_FIELDS = ("wire_sent", "wire_received", "wire_sent_total", "wire_received_total")
GOSSIP_FIELDS = ("group", "consensus_distance")


def _shows(status: str | None = None, *, peer: str | None = None, since_start: tuple[str, ...] = (),
           metric: tuple[str, str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {SINCE_START: since_start}
    if status:
        meta[STATUS] = status
    if peer:
        meta[PEER] = peer
    if metric:
        meta[METRIC] = metric
    return meta


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """What one finished round leaves behind (the `round` event's fields, in its order)."""

    round: int = field(metadata=_shows("outer_step", peer="rounds",
                                       metric=("counter", "diloco_outer_steps", "outer rounds completed")))
    time: float = field(metadata=_shows(peer="time"))  # unix time the round finished
    # None: a round we trained no step of (skipped, docs/architecture.md §13)
    loss: float | None = field(metadata=_shows(
        "loss", metric=("gauge", "diloco_loss", "mean training loss of the last round")))
    eval_loss: float = field(metadata=_shows(
        "eval_loss", metric=("gauge", "diloco_eval_loss", "held-out eval loss of φ")))
    group_size: int = field(metadata=_shows("group_size"))
    # payload and shared-state bytes: this round's (since the last round line) and since start
    bytes_sent: int = field(metadata=_shows("last_round_bytes_sent", peer="last_round_bytes_sent"))
    bytes_received: int = field(metadata=_shows("last_round_bytes_received", peer="last_round_bytes_received"))
    bytes_sent_total: int = field(metadata=_shows(
        "bytes_sent", peer="bytes_sent",
        metric=("counter", "diloco_bytes_sent", "payload and state bytes this node sent")))
    bytes_received_total: int = field(metadata=_shows(
        "bytes_received", peer="bytes_received",
        metric=("counter", "diloco_bytes_received", "payload and state bytes this node received")))
    # link-layer bytes (telemetry/wire.py): this round's and since start; None where unmeasured
    wire_sent: int | None = None
    wire_received: int | None = None
    wire_sent_total: int | None = field(default=None, metadata=_shows(peer="wire_bytes_sent"))
    wire_received_total: int | None = field(default=None, metadata=_shows(peer="wire_bytes_received"))
    payload_bytes: int = field(metadata=_shows("payload_bytes"))  # our encoded contribution
    raw_bytes: int = field(metadata=_shows("raw_bytes"))  # its fp32 size
    compression_ratio: float | None = field(metadata=_shows(
        "compression_ratio",
        metric=("gauge", "diloco_compression_ratio", "fp32 bytes / payload bytes of the last round")))
    bytes_per_param: float = field(metadata=_shows("bytes_per_param"))
    codec_seconds: float = field(metadata=_shows("codec_seconds"))
    transfer_seconds: float | None  # fetching the others' payloads of the exchange applied (None: none)
    transfer_bytes: int | None
    compute_seconds: float = field(metadata=_shows("compute_seconds", since_start=(STATUS,)))
    wait_seconds: float = field(metadata=_shows("wait_seconds", since_start=(STATUS,), peer="last_exchange_seconds"))
    utilization: float = field(metadata=_shows(  # this round's; status, metric and peer stats: since start
        "utilization", peer="utilization", since_start=(STATUS, PEER),
        metric=("gauge", "diloco_compute_utilization", "compute / (compute + wait), cumulative")))
    round_seconds: float = field(metadata=_shows("round_seconds"))
    # peers our aggregator bounded or left out this round, and the totals since start
    clipped: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    contributions_clipped: int = field(metadata=_shows(
        "contributions_clipped",
        metric=("counter", "diloco_contributions_clipped",
                "peers' contributions the aggregator scaled down or counted at the token cap")))
    contributions_rejected: int = field(metadata=_shows(
        "contributions_rejected", metric=("counter", "diloco_contributions_rejected",
                                          "peers' contributions left out: undecodable, non-finite or tokenless")))
    # who averaged (the round event carries it only under NoLoCo, see `gossip`)
    group: tuple[str, ...] = field(default=(), metadata=_shows("group"))
    consensus_distance: float | None = field(default=None, metadata=_shows(  # NoLoCo: ‖φ − φ̄‖ / ‖φ̄‖
        "consensus_distance", metric=("gauge_if_known", "diloco_consensus_distance",
                                      "‖φ − group mean φ‖ / ‖group mean φ‖ of the last round")))
    digest: str = field(metadata=_shows("model_digest"))  # of φ after the round
    peak_memory_bytes: tuple[int, ...] | None = field(default=None, metadata=_shows("peak_memory_bytes"))
    outcome: str  # the round's outcome word (round.Outcome's value)
    # last (newer than the event's other keys): of this round's compute, the seconds the inner loop
    # found no batch ready and waited for the data
    data_wait_seconds: float = field(default=0.0, metadata=_shows(
        "data_wait_seconds", metric=("gauge", "diloco_data_wait_seconds",
                                     "seconds the inner loop of the last round waited for data")))
    # last (newer still): what this round trained, which under --round-seconds differs per node and
    # round (docs/architecture.md §13): inner steps, the tokens declared with our Δ, their rate over the
    # compute seconds; `skipped`: not one step fitted before the round's deadline
    last_round_inner_steps: int = field(default=0, metadata=_shows(
        "last_round_inner_steps", peer="last_round_inner_steps",
        metric=("gauge", "diloco_last_round_inner_steps", "inner steps trained in the last round")))
    last_round_tokens: float = field(default=0.0, metadata=_shows(
        "last_round_tokens", peer="last_round_tokens",
        metric=("gauge", "diloco_last_round_tokens", "tokens trained in the last round")))
    last_round_tokens_per_second: float = field(default=0.0, metadata=_shows(
        "last_round_tokens_per_second", peer="last_round_tokens_per_second",
        metric=("gauge", "diloco_last_round_tokens_per_second", "tokens per compute second in the last round")))
    skipped: bool = field(default=False, metadata=_shows("last_round_skipped"))
    # last (newer still): the fragment this round exchanged and stepped (docs/architecture.md §15; 0:
    # the whole model) and the unix time its outer step was done (None in older events): the
    # dashboard's timeline of when each fragment moved
    fragment: int = 0
    moved_at: float | None = None
    # last (newer still): our share of the mean this round's outer step applied (our counted tokens over the
    # group's, after the caps: docs/architecture.md §13); 0 when nothing of ours went in
    last_round_weight: float = field(default=0.0, metadata=_shows(
        "last_round_weight", peer="last_round_weight",
        metric=("gauge", "diloco_last_round_weight", "our share of the mean applied in the last round")))
    # last (newest): the share of the group's declared work our aggregator's token cap and norm clip took
    # away this round (outer/aggregate.py, removed_share): what the trust bounds cost honest peers
    weight_removed: float = field(default=0.0, metadata=_shows(
        "last_round_weight_removed", peer="last_round_weight_removed",
        metric=("gauge", "diloco_last_round_weight_removed",
                "share of the group's declared work the token cap and the clip took away in the last round")))
    # last (newest): the round whose exchange `group_size` and `group` describe, where it is an earlier
    # one (delayed and eager apply an exchange a round late; a joiner's first round applies its server's
    # round in flight, whose group it was not in). None: this round's own
    group_round: int | None = field(default=None, metadata=_shows("group_round"))
    # NoLoCo (gossip) runs: the event carries `group` and `consensus_distance`, the log line ends with them
    gossip: bool = field(default=False, repr=False)

    # --- the round event ----------------------------------------------------------------------

    def event(self) -> dict[str, Any]:
        """The `round` event's fields (besides `event`): JSON-able, in today's keys and order."""
        values: dict[str, Any] = {}
        for name in round_fields():
            value = getattr(self, name)
            if (name in WIRE_FIELDS and value is None) or (name in GOSSIP_FIELDS and not self.gossip):
                continue
            values[name] = list(value) if isinstance(value, tuple) else value
        return values

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> RoundRecord:
        """A record from a `round` event (or history entry); unknown keys (`event`, newer fields) are
        ignored, a key an older node did not write takes the field's default (None where it has none)."""
        values: dict[str, Any] = {}
        for spec in dataclasses.fields(cls):
            if spec.name == "gossip":
                continue
            value = event.get(spec.name, _default(spec))
            values[spec.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values, gossip="group" in event)

    # --- the other views ----------------------------------------------------------------------

    def log_line(self) -> str:
        """The round's log line (key=value, one per round; readers use the events instead)."""
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        line = (f"round={self.round} loss={loss} eval_loss={self.eval_loss:.4f} "
                f"group_size={self.group_size}{'' if self.group_round is None else f' group_round={self.group_round}'}"
                f" sent={self.bytes_sent} received={self.bytes_received} "
                f"seconds={self.round_seconds:.1f} payload={self.payload_bytes} "
                f"bytes_per_param={self.bytes_per_param:.4f} codec_seconds={self.codec_seconds:.3f} "
                f"utilization={self.utilization:.3f} transfer={self.transfer_bytes or 0}/"
                f"{self.transfer_seconds or 0.0:.3f}s digest={self.digest} "
                f"inner_steps={self.last_round_inner_steps} tokens={self.last_round_tokens:.0f}"
                f"{' skipped' if self.skipped else ''}"
                f"{f' weight_removed={self.weight_removed:.3f}' if self.weight_removed > 0 else ''}")
        if self.gossip:  # NoLoCo: how far φ was from the group's, and who the group was
            distance = self.consensus_distance
            line += (f" consensus_distance={'-' if distance is None else f'{distance:.3e}'}"
                     f" group={','.join(self.group) or '-'}")
        return line

    def status(self, since_start: Mapping[str, Any]) -> dict[str, Any]:
        """The `/api/status` fields this round sets; `since_start`: the running totals of the fields
        marked so (compute_seconds, wait_seconds, utilization), by field name."""
        return self._view(STATUS, since_start)

    def peer_stats(self, since_start: Mapping[str, Any]) -> dict[str, Any]:
        """The stats of our presence record this round sets (all but `label`); `since_start` as for status."""
        return self._view(PEER, since_start)

    def _view(self, where: str, since_start: Mapping[str, Any]) -> dict[str, Any]:
        return {key: since_start[name] if where in meta[SINCE_START] else _plain(getattr(self, name))
                for name, key, meta in _shown(where)}


def _default(spec: dataclasses.Field[Any]) -> Any:
    return None if spec.default is dataclasses.MISSING else spec.default


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _shown(where: str) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """(field, its name there, its metadata) of each round field that shows `where`."""
    for spec in dataclasses.fields(RoundRecord):
        if where in spec.metadata:
            yield spec.name, spec.metadata[where], spec.metadata


def round_fields() -> tuple[str, ...]:
    """The round event's (and status history entry's) keys, as the record declares them."""
    return tuple(spec.name for spec in dataclasses.fields(RoundRecord) if spec.name != "gossip")


# Derived once from the record: /api/status keys the round sets, the presence stats it publishes,
# and the Prometheus series read from those status keys: (status key, kind, name, help).
ROUND_STATUS_FIELDS = tuple(status for _, status, _ in _shown(STATUS))
# Besides the round's figures our presence stats carry our caps (0: none) and our link's mean rates over
# the last round (None: unmeasured), so every node's swarm table shows each peer's egress and ingress
# against its caps (docs/architecture.md §14)
LINK_STATS = ("upload_limit_bytes_per_second", "download_limit_bytes_per_second", "egress_bytes_per_second",
              "ingress_bytes_per_second")
PEER_STATS_FIELDS = ("label", *(peer for _, peer, _ in _shown(PEER)), *LINK_STATS)
ROUND_METRICS = tuple((meta[STATUS], *meta[METRIC]) for _, _, meta in _shown(METRIC))


# --- the settled event ----------------------------------------------------------------------------

@dataclass(frozen=True)
class SettledRecord:
    """An overlapped run's last exchange, applied when the node leaves: numbered like the round lines
    (the exchange of the round that logged round=N); the bytes that exchange moved after the last
    round line, spelled as in the round event."""

    round: int
    eval_loss: float
    digest: str
    bytes_sent: int
    bytes_received: int

    def event(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> SettledRecord:
        """Also reads the events of older nodes, which spelled the bytes `sent` / `received`."""
        old = {"bytes_sent": "sent", "bytes_received": "received"}
        return cls(**{spec.name: event.get(spec.name, event.get(old.get(spec.name, spec.name)))
                      for spec in dataclasses.fields(cls)})

    def log_line(self) -> str:
        return (f"settled round={self.round} eval_loss={self.eval_loss:.4f} sent={self.bytes_sent} "
                f"received={self.bytes_received} digest={self.digest}")
