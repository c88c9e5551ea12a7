"""What a member checks of a butterfly's averaged parts before it applies them (docs/architecture.md §3,
'Butterfly parts', and §9).

An owner computes its part's mean for the whole group, and nobody else sees the slices it averaged.
What every member can check is that the part is one the declared contributions allow:
- the owner's report is well formed: `used` ⊆ the group, one counted token count per used peer,
  finite and positive, each equal to what the token cap gives from the declared tokens;
- each used peer's declaration (whole norm, tokens, the norm of each of its parts) is the one most
  parts' reports carry for it: a peer that declared differently to different owners, or an owner
  that misreports a declaration, loses the parts that disagree;
- the part is no longer than its clipped slices allow: the mean of vectors is no longer than the
  longest of them, each used peer's slice i is at most its declared part norm n_i, scaled by the
  clip (outer/aggregate.py's, of the declared whole norms) over its whole norm; a lossy codec's
  re-encoding may lengthen the mean a little (SLACK).
Every member runs these checks on the same bytes (swarm/butterfly.py compares their hashes across
the group first), so every member keeps and skips the same parts and φ stays bit-equal.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco_node.outer.aggregate import TRIM_FRACTION, clip_multiple, reference_norm, token_cap

logger = logging.getLogger(__name__)

SLACK = 0.25  # re-encoding a part's mean with a lossy codec lengthens it (int4: ≈ 0.07 relative)
DECLARATION_TOLERANCE = 1e-4  # float32 rounding between a whole norm and its parts' norms


@dataclass(frozen=True)
class Declared:
    """What a member declared with its part: the same to every owner when it is honest."""

    norm: float
    tokens: float
    norms: tuple[float, ...]

    def as_json(self) -> list[Any]:
        return [self.norm, self.tokens, list(self.norms)]


def declaration_fault(declared: Declared, count: int) -> str | None:
    """Why a declaration is impossible for a butterfly of `count` parts; None when it is consistent."""
    if not (math.isfinite(declared.norm) and declared.norm >= 0):
        return "a non-finite or negative norm"
    if not (math.isfinite(declared.tokens) and declared.tokens > 0):
        return "non-finite or no tokens"
    if len(declared.norms) != count or not all(math.isfinite(n) and n >= 0 for n in declared.norms):
        return f"not {count} finite part norms"
    if abs(math.sqrt(sum(n * n for n in declared.norms)) - declared.norm) > (
            DECLARATION_TOLERANCE * declared.norm + 1e-12):
        return "part norms that do not add up to its whole norm"
    return None


def _parse(value: Any, count: int) -> Declared | None:
    try:
        norm, tokens, norms = value
        declared = Declared(float(norm), float(tokens), tuple(float(n) for n in norms))
    except (TypeError, ValueError):
        return None
    return declared if declaration_fault(declared, count) is None else None


@dataclass(frozen=True)
class _Report:
    used: tuple[str, ...]
    counted: tuple[float, ...]
    declared: dict[str, Declared]


def _report(report: dict[str, Any], group: Sequence[str], count: int,
            max_tokens: float | None) -> _Report | str:
    """The owner's report, checked on its own; a string says why it is refused."""
    used, counted, declared = report.get("used"), report.get("tokens"), report.get("declared")
    if not (isinstance(used, list) and isinstance(counted, list) and isinstance(declared, dict)):
        return "a malformed report"
    if not used or len(used) != len(counted) or not all(isinstance(p, str) for p in used):
        return "a malformed report"
    if used != sorted(set(used)) or not set(used) <= set(group) or set(declared) != set(used):
        return "used peers outside its group, repeated or undeclared"
    parsed = {peer: _parse(declared[peer], count) for peer in used}
    if any(value is None for value in parsed.values()):
        return "an impossible declaration"
    declarations = {peer: value for peer, value in parsed.items() if value is not None}
    try:
        tokens = tuple(float(t) for t in counted)
    except (TypeError, ValueError):
        return "a malformed report"
    cap = token_cap([declarations[peer].tokens for peer in used], max_tokens)
    for peer, count_ in zip(used, tokens, strict=True):
        if not (math.isfinite(count_) and count_ > 0) or abs(count_ - min(declarations[peer].tokens, cap)) > 1e-9 * cap:
            return f"tokens for peer={peer} that the cap does not give"
    return _Report(tuple(used), tokens, declarations)


def _bound(report: _Report, index: int, aggregator: str) -> float:
    """The longest part the used peers' clipped slices allow."""
    wholes = [report.declared[peer].norm for peer in report.used]
    clipping = aggregator != "mean" and len(wholes) > 1
    limit = clip_multiple(len(wholes)) * reference_norm(wholes) if clipping else math.inf
    lengths = [d.norms[index] * (min(1.0, limit / d.norm) if d.norm > 0 else 1.0)
               for d in (report.declared[peer] for peer in report.used)]
    if aggregator == "trimmed" and int(TRIM_FRACTION * len(lengths)):
        return math.sqrt(sum(length * length for length in lengths))  # per coordinate within the extremes
    return max(lengths)


def verified_parts(parts: dict[int, tuple[bytes, dict[str, Any]]], group: Sequence[str], count: int,
                   decode: Callable[[bytes, int], torch.Tensor], bounds: Sequence[tuple[int, int]], aggregator: str,
                   max_tokens: float | None, round_: int) -> dict[int, tuple[torch.Tensor, dict[str, Any]]]:
    """The averaged parts every member keeps, decoded, with their reports; each skipped one logged.
    `decode` raises (CodecError) on bytes it cannot read."""
    reports: dict[int, _Report] = {}
    for index, (averaged, report) in sorted(parts.items()):
        if not averaged or not 0 <= index < count:
            continue
        checked = _report(report, group, count, max_tokens)
        if isinstance(checked, str):
            logger.warning("round=%d skipped averaged part %d: its owner's report has %s", round_, index, checked)
        else:
            reports[index] = checked
    # each used peer's declaration is the one most parts carry (ties: the smallest, so all pick alike)
    seen: dict[str, Counter[tuple[float, float, tuple[float, ...]]]] = {}
    for checked in reports.values():
        for peer, declared in checked.declared.items():
            seen.setdefault(peer, Counter())[(declared.norm, declared.tokens, declared.norms)] += 1
    agreed = {peer: min(counter, key=lambda value: (-counter[value], value)) for peer, counter in seen.items()}
    kept: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
    for index, checked in reports.items():
        start, end = bounds[index]
        liars = [peer for peer, d in checked.declared.items() if (d.norm, d.tokens, d.norms) != agreed[peer]]
        if liars:
            logger.warning("round=%d skipped averaged part %d: declarations of peer=%s differ from the other parts'",
                           round_, index, ",".join(liars))
            continue
        try:
            values = decode(parts[index][0], end - start)
        except Exception as exc:  # the codec's error: every member holds the same bytes, so every member skips it
            logger.warning("round=%d skipped averaged part %d: %s", round_, index, exc)
            continue
        bound = _bound(checked, index, aggregator)
        length = float(values.norm())
        if not math.isfinite(length) or length > bound * (1 + SLACK) + 1e-12:
            logger.warning("round=%d skipped averaged part %d: norm %.3g beyond the %.3g its contributions allow",
                           round_, index, length, bound)
            continue
        kept[index] = values, parts[index][1]
    return kept
