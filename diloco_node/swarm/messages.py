"""The parsing of our stream protocols' small JSON messages, one pure function per message.

Each takes the bytes a peer sent and returns the message's fields, checked (types, ranges, sizes),
or the reason it is malformed: a handler refuses it in one line and nothing else changes. Pure so
that a property-based test can drive each with adversarial input (tests/hostile/test_handler_fuzz.py):
nothing a peer sends may raise out of a handler (docs/architecture.md §9).

The state protocol's messages are parsed in statesync.py (parse_request, parse_header,
trust/state.py's metadata_refusal); the payload answer's metadata in exchange.py (`_parse_meta`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from diloco_node.swarm.streams import parse_json
from diloco_node.trust.seals import Seal, parse_seal

MAX_ROUND = 1 << 40  # trust/records.py's MAX_ROUND: no run gets near
MAX_GROUP = 256  # members named in a group: far above any group a run forms
MAX_PEER_ID_CHARS = 64  # libp2p's base58 ids are 46 or 52 characters
MAX_TOKEN_CHARS = 1024  # admission.MAX_TOKEN_CHARS
# Tokens and norms a peer declares: finite, ≥ 0 and below this (a round trains far fewer tokens;
# a sum of a group's declarations must stay finite, or the mean turns NaN)
MAX_DECLARED = 1e15


def _round(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value <= MAX_ROUND else None


def _declared(value: Any) -> float | None:
    # compared before math.isfinite, which raises OverflowError for an int beyond a float's range
    if type(value) not in (int, float) or not 0 <= value <= MAX_DECLARED or not math.isfinite(value):
        return None
    return float(value)


def _token(value: Any) -> str | None:
    return value if isinstance(value, str) and len(value) <= MAX_TOKEN_CHARS else None


def peer_ids(value: Any) -> tuple[str, ...] | None:
    """A list of distinct peer ids, as a tuple; None for anything else."""
    if not (isinstance(value, list) and len(value) <= MAX_GROUP
            and all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID_CHARS for p in value)):
        return None
    return tuple(value) if len(set(value)) == len(value) else None


def _object(data: bytes) -> dict[str, Any] | None:
    try:
        fields = parse_json(data)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


@dataclass(frozen=True)
class PayloadRequest:
    """A fetch of our payload (exchange.py)."""

    round: int
    token: str
    group_only: bool = False  # the offer's tokens and group, no payload: a joiner polling for a group

    def encode(self) -> bytes:
        """As the fetcher sends it (parse_payload_request reads it back)."""
        return json.dumps({"round": self.round, "admission": self.token,
                           **({"group_only": True} if self.group_only else {})}).encode()


def parse_payload_request(data: bytes) -> PayloadRequest | str:
    fields = _object(data)
    if fields is None:
        return "malformed request"
    round_, token = _round(fields.get("round")), _token(fields.get("admission", ""))
    group_only = fields.get("group_only", False)
    if round_ is None or token is None or not isinstance(group_only, bool):
        return "malformed request"
    return PayloadRequest(round_, token, group_only)


@dataclass(frozen=True)
class Push:
    """A member's push of its part to that part's owner (butterfly.py); its body comes after."""

    round: int
    part: int
    group: tuple[str, ...]
    tokens: float
    norm: float
    token: str
    norms: tuple[float, ...] = ()  # the pusher's norm of each part, the same list to every owner (§3)

    def encode(self) -> bytes:
        """As the pusher sends it (parse_push reads it back)."""
        return json.dumps({"round": self.round, "part": self.part, "group": list(self.group), "admission": self.token,
                           "tokens": self.tokens, "norm": self.norm, "norms": list(self.norms)}).encode()


def parse_push(data: bytes) -> Push | str:
    fields = _object(data)
    if fields is None:
        return "malformed push"
    round_, part, group = _round(fields.get("round")), fields.get("part"), peer_ids(fields.get("group"))
    tokens, norm, token = _declared(fields.get("tokens")), _declared(fields.get("norm")), \
        _token(fields.get("admission", ""))
    if round_ is None or group is None or token is None:
        return "malformed push"
    if type(part) is not int or not 0 <= part < len(group):
        return "malformed push (part)"
    if tokens is None or norm is None:
        return "malformed push (tokens or norm not a finite number in range)"
    listed = fields.get("norms", [])
    norms = tuple(_declared(n) for n in listed) if isinstance(listed, list) and len(listed) <= MAX_GROUP else None
    if norms is None or any(n is None for n in norms):
        return "malformed push (norms)"
    return Push(round_, part, group, tokens, norm, token, tuple(n for n in norms if n is not None))


@dataclass(frozen=True)
class PartRequest:
    """A request for an averaged part we hold (butterfly.py)."""

    round: int
    part: int
    token: str

    def encode(self) -> bytes:
        """As a member or a joiner sends it (parse_part_request reads it back)."""
        return json.dumps({"round": self.round, "part": self.part, "admission": self.token}).encode()


def parse_part_request(data: bytes) -> PartRequest | str:
    fields = _object(data)
    if fields is None:
        return "malformed part request"
    round_, part, token = _round(fields.get("round")), fields.get("part"), _token(fields.get("admission", ""))
    if round_ is None or type(part) is not int or not 0 <= part < MAX_GROUP or token is None:
        return "malformed part request"
    return PartRequest(round_, part, token)


@dataclass(frozen=True)
class Told:
    """What a member holds of one averaged part: its hash and its owner's seal over it."""

    hash: str  # SHA-256 in hex (butterfly.digest)
    seal: Seal

    def to_wire(self) -> dict[str, Any]:
        return {"hash": self.hash, "seal": self.seal.to_wire()}


@dataclass(frozen=True)
class DigestsRequest:
    """A member's hashes of a round's averaged parts, compared before applying them (butterfly.py)."""

    round: int
    token: str
    digests: tuple[Told | None, ...]  # one per part; None for a part it lacks

    def encode(self) -> bytes:
        """As a member sends it (parse_digests_request reads it back)."""
        return json.dumps({"round": self.round, "admission": self.token,
                           "digests": told_on_wire(self.digests)}).encode()


def told_on_wire(told: Sequence[Told | None]) -> list[dict[str, Any] | None]:
    """Parts' hashes as a request or an answer carries them (told_list reads them back)."""
    return [entry.to_wire() if entry else None for entry in told]


def told_list(value: Any, count: int) -> tuple[Told | None, ...] | None:
    """`count` parts' hashes with their seals (None for a part not held); None when malformed."""
    if not (isinstance(value, list) and len(value) == count):
        return None
    told: list[Told | None] = []
    for entry in value:
        if entry is None:
            told.append(None)
            continue
        if not (isinstance(entry, dict) and set(entry) == {"hash", "seal"} and isinstance(entry["hash"], str)
                and len(entry["hash"]) == 64 and (seal := parse_seal(entry["seal"])) is not None):
            return None
        told.append(Told(entry["hash"], seal))
    return tuple(told)


def parse_digests_request(data: bytes) -> DigestsRequest | str:
    fields = _object(data)
    if fields is None:
        return "malformed hash request"
    round_, token, digests = _round(fields.get("round")), _token(fields.get("admission", "")), fields.get("digests")
    if round_ is None or token is None or not isinstance(digests, list) or len(digests) > MAX_GROUP:
        return "malformed hash request"
    told = told_list(digests, len(digests))
    if told is None:
        return "malformed hash request (digests)"
    return DigestsRequest(round_, token, told)


def parse_report(data: bytes) -> dict[str, Any]:
    """An owner's report on the part it averaged: `used`, `clipped`, `rejected` (peer ids),
    `tokens` (one finite declared weight per used peer), and, on a part request, the `group` and
    the count of `parts`. ValueError on anything else (e.g. `{"used": 5}`, which reached
    outer/averaging.py as a TypeError); the part is then taken as not delivered."""
    report = _object(data)
    if report is None:
        raise ValueError("the answer's report is not a JSON object")
    for key in ("used", "clipped", "rejected", "group"):
        if key in report and peer_ids(report[key]) is None:
            raise ValueError(f"the answer's report has a malformed {key!r}")
    tokens = report.get("tokens", [])
    if not (isinstance(tokens, list) and len(tokens) == len(report.get("used", []))
            and all(_declared(t) is not None for t in tokens)):
        raise ValueError("the answer's report has malformed 'tokens'")
    if "parts" in report and (type(report["parts"]) is not int or not 0 < report["parts"] <= MAX_GROUP):
        raise ValueError("the answer's report has a malformed 'parts'")
    return report


def parse_dial_back(data: bytes, max_addresses: int) -> list[str] | str:
    """A dial-back request → the addresses to dial (at most `max_addresses`), or why malformed."""
    fields = _object(data)
    addresses = fields.get("addresses") if fields is not None else None
    if not (isinstance(addresses, list) and all(isinstance(a, str) and len(a) <= 256 for a in addresses)):
        return "malformed dial-back request"
    return addresses[:max_addresses]
