"""From our pseudo-gradient to the group's mean (docs/architecture.md §2): encode ours, decode the payloads the
transport gathered, and take the bounded robust mean. Every update (blocking, overlapped, NoLoCo)
averages through this one class.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from diloco_node.codec import Codec, CodecError, split_first
from diloco_node.outer.aggregate import (
    PHI_RADIUS_MULTIPLE,
    Contribution,
    aggregate,
    bounded_phi_mean,
    removed_share,
    weights_of,
)
from diloco_node.outer.verify import Declared, declaration_fault, verified_parts
from diloco_node.round import AverageResult, Gathered, Outcome, Own, PartIn, PartSource, part_bounds

logger = logging.getLogger(__name__)


class Averaging:
    def __init__(self, codec: Codec, numel: int, peer_id: str, phi_codec: Codec | None = None,
                 aggregator: str = "clip", max_tokens: float | None = None, part_align: int | None = None,
                 weighting: str = "tokens"):
        """`phi_codec`, given for NoLoCo, encodes the φ that travels after each Δ (its consensus term);
        `aggregator` and `max_tokens` bound each peer's weight (outer/aggregate.py); `part_align`, when
        the run may exchange by butterfly, is where parts may be cut (the codec's block size);
        `weighting`: how counted tokens become weights (outer/aggregate.py)."""
        self.codec, self.phi_codec = codec, phi_codec
        self.numel, self.peer_id = numel, peer_id
        self.aggregator, self.max_tokens = aggregator, max_tokens
        self.part_align, self.weighting = part_align, weighting

    def encode(self, round_: int, pseudo_gradient: torch.Tensor, tokens: float,
               phi: torch.Tensor | None = None) -> Own:
        """Our flat Δ (and, for NoLoCo, our flat φ after it) as a payload.

        Our own contribution is what peers decode from our payload, not the exact Δ: every node
        then averages the same values, and top-k's error feedback keeps what was not sent.
        """
        started = time.perf_counter()
        if tokens <= 0:  # a round we trained no step of (--round-seconds, docs/architecture.md §13)
            return Own(None, None, tokens, 0.0)
        try:
            payload = self.codec.encode(pseudo_gradient)
            decoded = self.codec.decode(payload, self.numel)
            if self.phi_codec is not None:
                assert phi is not None, "NoLoCo contributions carry φ"
                payload += self.phi_codec.encode(phi)
        except CodecError as exc:  # our inner phase blew up (NaN/inf): send nothing, take the others'
            logger.warning("round=%d not contributing: %s", round_, exc)
            return Own(None, None, tokens, time.perf_counter() - started)
        delta = pseudo_gradient.detach().reshape(-1).float() if self.part_align else None
        return Own(payload, decoded, tokens, time.perf_counter() - started, phi, delta)

    # --- butterfly (swarm/butterfly.py): we encode our parts and reduce the one we own ------------

    def parts(self, round_: int, own: Own) -> PartSource | None:
        """What we bring to `round_` if its group exchanges by butterfly; None when the run never does."""
        if not self.part_align:
            return None
        delta, decoded = (own.delta, own.decoded) if own.decoded is not None else (None, None)
        encode = (lambda start, end: self.codec.encode(delta[start:end])) if delta is not None else None
        norm = float(decoded.norm()) if decoded is not None else 0.0

        def norms(bounds: tuple[tuple[int, int], ...]) -> tuple[float, ...]:
            return tuple(float(decoded[start:end].norm()) for start, end in bounds) if decoded is not None else ()
        return PartSource(own.tokens, norm, encode, self.reduce_part, self.part_align, norms, self.numel)

    def reduce_part(self, round_: int, index: int, layout: tuple[tuple[int, int], ...],
                    parts: list[PartIn]) -> tuple[bytes, dict[str, Any]]:
        """The bounded mean of part `index` of the group's Δs, encoded with the run's codec, and what went
        into it: who, with how many tokens, and what each declared (members check the part against it,
        outer/verify.py). A part longer than its peer's declared part norm, or a declaration whose part
        norms do not add up to its whole norm, is a lie and left out."""
        start, end = layout[index]
        contributions, rejected, declared = [], [], {}
        for part in parts:
            if not part.payload:
                continue  # that member had nothing to contribute this round
            declaration = Declared(part.norm, part.tokens, part.norms)
            if (why := declaration_fault(declaration, len(layout))) is not None:
                logger.warning("round=%d dropped part from peer=%s: it declared %s", round_, part.peer, why)
                rejected.append(part.peer)
                continue
            try:
                values = self.codec.decode(part.payload, end - start)
            except CodecError as exc:
                logger.warning("round=%d dropped part from peer=%s: %s", round_, part.peer, exc)
                rejected.append(part.peer)
                continue
            if float(values.norm()) > part.norms[index] * (1 + 1e-4) + 1e-12:
                logger.warning("round=%d dropped part from peer=%s: longer than the norm %.3g it declared",
                               round_, part.peer, part.norms[index])
                rejected.append(part.peer)
                continue
            contributions.append(Contribution(part.peer, part.tokens, values, part.norm))
            declared[part.peer] = declaration.as_json()
        report: dict[str, Any] = {"used": [], "tokens": [], "clipped": [], "rejected": sorted(rejected)}
        if not contributions:
            return b"", report
        try:
            result = aggregate(contributions, self.aggregator, self.max_tokens, self.weighting)
        except ValueError:  # every part non-finite or tokenless (aggregate logged each): nothing to average
            report["rejected"] = sorted({p.peer for p in parts if p.payload})
            return b"", report
        report.update(used=list(result.used), tokens=list(result.tokens), clipped=list(result.clipped),
                      rejected=sorted(set(rejected) | set(result.rejected)),
                      declared={peer: declared[peer] for peer in result.used})
        return self.codec.encode(result.mean), report

    def _combined(self, gathered: Gathered) -> tuple[torch.Tensor, list[str], dict[int, dict[str, Any]]]:
        """The mean Δ from a butterfly's averaged parts that pass every member's checks (outer/verify.py;
        a part nobody delivered or that fails them stays zero: every member skips it alike), the parts'
        members that contributed to them, and the reports of the parts kept."""
        reduced = gathered.reduced
        assert reduced is not None and self.part_align
        bounds = part_bounds(self.numel, reduced.count, self.part_align)
        kept = verified_parts(reduced.parts, reduced.group, reduced.count, self.codec.decode, bounds,
                              self.aggregator, self.max_tokens, gathered.round)
        mean, used = torch.zeros(self.numel), set[str]()
        for index, (values, report) in kept.items():
            start, end = bounds[index]
            mean[start:end] = values
            used.update(report["used"])
        return mean, sorted(used & set(reduced.group)), {index: report for index, (_, report) in kept.items()}

    def alone(self, own: Own) -> AverageResult:
        """The 'mean' of a round we average by ourselves."""
        return self.mean(own, Gathered(Outcome.ALONE))

    def nothing(self, own: Own) -> AverageResult:
        """The 'mean' of a held round (round.held): no contribution at all, so no step."""
        return AverageResult((), torch.zeros(self.numel), 0.0, own.codec_seconds)

    def mean_of(self, gathered: Gathered, member: str) -> torch.Tensor | None:
        """The mean `member` computed over its group's payloads (all gathered, its own included):
        what a joiner needs for a round its server averaged (OverlappedUpdate.inherit)."""
        if gathered.reduced is not None:
            mean, used, _ = self._combined(gathered)
            return mean if member in used else None
        contributions = []
        for peer, (payload, tokens) in sorted(gathered.payloads.items()):
            try:
                contributions.append(Contribution(peer, tokens, self.codec.decode(payload, self.numel)))
            except CodecError as exc:
                logger.warning("round=%d dropped payload from peer=%s: %s", gathered.round, peer, exc)
        if member not in {c.peer_id for c in contributions}:
            return None
        return aggregate(contributions, self.aggregator, self.max_tokens, self.weighting).mean

    def mean(self, own: Own, gathered: Gathered) -> AverageResult:
        """The bounded token-weighted mean over ours and the gathered payloads (NoLoCo: and mean φ)."""
        if gathered.reduced is not None:
            return self._butterfly_mean(own, gathered)
        contributions = [Contribution(self.peer_id, own.tokens, own.decoded)] if own.decoded is not None else []
        phis = {self.peer_id: own.phi} if own.phi is not None else {}
        undecodable = []
        started = time.perf_counter()
        for peer, (payload, tokens) in sorted(gathered.payloads.items()):
            try:
                if self.phi_codec is not None:
                    payload, phi_payload = split_first(payload)
                    phis[peer] = self.phi_codec.decode(phi_payload, self.numel)
                contributions.append(Contribution(peer, tokens, self.codec.decode(payload, self.numel)))
            except CodecError as exc:
                phis.pop(peer, None)
                undecodable.append(peer)
                logger.warning("round=%d dropped payload from peer=%s: %s", gathered.round, peer, exc)
        codec_seconds = own.codec_seconds + time.perf_counter() - started
        if not contributions:
            return AverageResult((), torch.zeros(self.numel), 0.0, codec_seconds, rejected=tuple(undecodable))
        result = aggregate(contributions, self.aggregator, self.max_tokens, self.weighting)
        counted = dict(zip(result.used, result.weights, strict=True))
        share = counted.get(self.peer_id, 0.0)
        clipped, mean_phi = set(result.clipped), None
        if own.phi is not None:
            used = [p for p in result.used if p in phis]
            radius = PHI_RADIUS_MULTIPLE * result.reference_norm
            mean_phi, far = bounded_phi_mean([phis[p] for p in used], [counted[p] for p in used], own.phi, radius)
            for index in far:
                logger.warning("round=%d clipped φ from peer=%s: further than %.3g from ours",
                               gathered.round, used[index], radius)
            clipped |= {used[index] for index in far}
        return AverageResult(result.used, result.mean, share, codec_seconds, gathered.transfer_seconds,
                             gathered.received_bytes, mean_phi, tuple(sorted(clipped)),
                             tuple(sorted(set(result.rejected) | set(undecodable))),
                             tuple((peer, tokens) for peer, (_, tokens) in sorted(gathered.payloads.items())),
                             weight_removed=result.removed)

    def _butterfly_mean(self, own: Own, gathered: Gathered) -> AverageResult:
        """The mean from the averaged parts; clipped and rejected peers are those of the part we
        reduced (each owner counts its own), and our share that part's token weight of ours."""
        started = time.perf_counter()
        mean, used, reports = self._combined(gathered)
        reduced = gathered.reduced
        assert reduced is not None
        held = reports.get(reduced.own_index) if reduced.own_index is not None else None
        report = held if held is not None else next(iter(reports.values()), {})
        share = _share(report, self.peer_id, self.weighting)
        codec_seconds = own.codec_seconds + time.perf_counter() - started
        return AverageResult(tuple(used), mean, share, codec_seconds, gathered.transfer_seconds,
                             gathered.received_bytes, clipped=_names(report, "clipped") if held else (),
                             rejected=_names(report, "rejected") if held else (),
                             weight_removed=self._removed(report))

    def _removed(self, report: dict[str, Any]) -> float:
        """What the caps and the clip took from a verified part's group (outer/verify.py checked its
        declarations): the same for every part, since both act on whole Δs."""
        declared = report.get("declared")
        if not isinstance(declared, dict) or not declared:
            return 0.0
        values = [declared[peer] for peer in sorted(declared)]
        tokens, norms = [float(d[1]) for d in values], [float(d[0]) for d in values]
        return removed_share(tokens, norms, self.aggregator, self.max_tokens, self.weighting)


def _names(report: dict[str, Any], key: str) -> tuple[str, ...]:
    """The peer ids an owner's report lists under `key` (nothing when it is not a list of them)."""
    names = report.get(key)
    return tuple(names) if isinstance(names, list) and all(isinstance(p, str) for p in names) else ()


def _share(report: dict[str, Any], peer: str, weighting: str = "tokens") -> float:
    """Our weight in a part's mean, from its owner's report of counted tokens (0 when we are not in it)."""
    used, tokens = report.get("used", []), report.get("tokens", [])
    try:
        counted = [float(t) for t in tokens]
        if len(counted) != len(used) or peer not in used or not all(math.isfinite(t) and t > 0 for t in counted):
            return 0.0
        return min(1.0, max(0.0, weights_of(counted, weighting)[used.index(peer)]))
    except (TypeError, ValueError):  # a malformed report from a peer: no share taken from it
        return 0.0
