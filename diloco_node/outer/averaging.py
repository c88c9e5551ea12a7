"""From our pseudo-gradient to the group's mean (DESIGN §2): encode ours, decode the payloads the
transport gathered, and take the bounded robust mean. Every update (blocking, overlapped, NoLoCo)
averages through this one class.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from diloco_node.codec import Codec, CodecError, split_first
from diloco_node.outer.aggregate import NORM_CLIP_MULTIPLE, Contribution, aggregate, bounded_phi_mean
from diloco_node.swarm.member import Gathered

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Own:
    """Our contribution to a round."""

    payload: bytes | None  # what we offer; None when our Δ could not be encoded (non-finite)
    decoded: torch.Tensor | None  # flat Δ as peers decode it (so every node averages the same values)
    tokens: float
    codec_seconds: float
    # NoLoCo: our exact flat φ. Unlike Δ, the group need not agree on the mean φ to the bit, and our
    # own rounding in it would pull φ toward the codec's grid through the consensus term.
    phi: torch.Tensor | None = None

    @property
    def payload_bytes(self) -> int:
        return len(self.payload) if self.payload else 0


@dataclass(frozen=True)
class AverageResult:
    group: tuple[str, ...]  # peer ids whose contributions made the mean, ourselves included
    mean: torch.Tensor  # flat Δ̄
    own_share: float  # our token weight in the mean (1/M for equal tokens)
    codec_seconds: float  # encoding ours and decoding everyone's
    transfer_seconds: float = 0.0  # fetching the others' payloads, once the group had formed
    received_bytes: int = 0  # the others' payloads we fetched
    mean_phi: torch.Tensor | None = None  # NoLoCo: the group's mean φ
    clipped: tuple[str, ...] = ()  # peers whose Δ (or φ, or declared tokens) the aggregator bounded
    rejected: tuple[str, ...] = ()  # peers whose payload was undecodable, non-finite or tokenless


class Averaging:
    def __init__(self, codec: Codec, numel: int, peer_id: str, phi_codec: Codec | None = None,
                 aggregator: str = "clip", max_tokens: float | None = None):
        """`phi_codec`, given for NoLoCo, encodes the φ that travels after each Δ (its consensus term);
        `aggregator` and `max_tokens` bound each peer's weight (outer/aggregate.py)."""
        self.codec, self.phi_codec = codec, phi_codec
        self.numel, self.peer_id = numel, peer_id
        self.aggregator, self.max_tokens = aggregator, max_tokens

    def encode(self, round_: int, pseudo_gradient: torch.Tensor, tokens: float,
               phi: torch.Tensor | None = None) -> Own:
        """Our flat Δ (and, for NoLoCo, our flat φ after it) as a payload.

        Our own contribution is what peers decode from our payload, not the exact Δ: every node
        then averages the same values, and top-k's error feedback keeps what was not sent.
        """
        started = time.perf_counter()
        try:
            payload = self.codec.encode(pseudo_gradient)
            decoded = self.codec.decode(payload, self.numel)
            if self.phi_codec is not None:
                assert phi is not None, "NoLoCo contributions carry φ"
                payload += self.phi_codec.encode(phi)
        except CodecError as exc:  # our inner phase blew up (NaN/inf): send nothing, take the others'
            logger.warning("round=%d not contributing: %s", round_, exc)
            return Own(None, None, tokens, time.perf_counter() - started)
        return Own(payload, decoded, tokens, time.perf_counter() - started, phi)

    def alone(self, own: Own) -> AverageResult:
        """The 'mean' of a round we average by ourselves."""
        return self.mean(own, Gathered("alone"))

    def mean_of(self, gathered: Gathered, member: str) -> torch.Tensor | None:
        """The mean `member` computed over its group's payloads (all gathered, its own included):
        what a joiner needs for a round its server averaged (OverlappedUpdate.inherit)."""
        contributions = []
        for peer, (payload, tokens) in sorted(gathered.payloads.items()):
            try:
                contributions.append(Contribution(peer, tokens, self.codec.decode(payload, self.numel)))
            except CodecError as exc:
                logger.warning("round=%d dropped payload from peer=%s: %s", gathered.round, peer, exc)
        if member not in {c.peer_id for c in contributions}:
            return None
        return aggregate(contributions, self.aggregator, own=member, max_tokens=self.max_tokens).mean

    def mean(self, own: Own, gathered: Gathered) -> AverageResult:
        """The bounded token-weighted mean over ours and the gathered payloads (NoLoCo: and mean φ)."""
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
        result = aggregate(contributions, self.aggregator, own=self.peer_id, max_tokens=self.max_tokens)
        counted = dict(zip(result.used, result.tokens, strict=True))
        share = counted.get(self.peer_id, 0.0) / sum(result.tokens)
        clipped, mean_phi = set(result.clipped), None
        if own.phi is not None:
            used = [p for p in result.used if p in phis]
            radius = NORM_CLIP_MULTIPLE * result.reference_norm
            mean_phi, far = bounded_phi_mean([phis[p] for p in used], [counted[p] for p in used], own.phi, radius)
            for index in far:
                logger.warning("round=%d clipped φ from peer=%s: further than %.3g from ours",
                               gathered.round, used[index], radius)
            clipped |= {used[index] for index in far}
        return AverageResult(result.used, result.mean, share, codec_seconds, gathered.transfer_seconds,
                             gathered.received_bytes, mean_phi, tuple(sorted(clipped)),
                             tuple(sorted(set(result.rejected) | set(undecodable))))
