"""The robust, token-weighted mean of the group's pseudo-gradients (DESIGN §3, 'Robust mean').

Every node computes it from the same contributions in the same (peer id) order with the same
operations, so every node gets a bit-identical result and φ stays equal across the group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

NORM_CLIP_MULTIPLE = 4.0  # a contribution longer than this many reference norms is scaled down


@dataclass(frozen=True)
class Contribution:
    peer_id: str
    tokens: float
    pseudo_gradient: torch.Tensor  # flat fp32


def robust_weighted_mean(contributions: list[Contribution], own: str | None = None) -> torch.Tensor:
    """Σ w_m Δ_m / Σ w_m over finite contributions, each clipped to NORM_CLIP_MULTIPLE × a reference norm.

    The reference is the group's median norm. In a group of two the median is the mean of the two
    norms, which a single huge contribution drags up with it, so there the reference is our own Δ's
    norm (`own`, our peer id), or the smaller norm when ours is not among them. Honest pairs, whose
    norms lie well within the multiple of each other, clip nothing and so still agree bit for bit.
    """
    ordered = sorted(contributions, key=lambda c: c.peer_id)
    finite = [c for c in ordered if torch.isfinite(c.pseudo_gradient).all() and c.tokens > 0]
    for rejected in set(c.peer_id for c in ordered) - set(c.peer_id for c in finite):
        logger.warning("rejected contribution from peer=%s: non-finite values or no tokens", rejected)
    if not finite:
        raise ValueError("no usable contribution")
    norms = torch.stack([c.pseudo_gradient.norm() for c in finite])
    limit = NORM_CLIP_MULTIPLE * _reference_norm(finite, norms, own)
    total = torch.zeros_like(finite[0].pseudo_gradient)
    weight_sum = sum(c.tokens for c in finite)
    for contribution, norm in zip(finite, norms, strict=True):
        scale = contribution.tokens / weight_sum
        if len(finite) > 1 and norm > limit:
            logger.warning("clipped contribution from peer=%s: norm %.3g > %.3g", contribution.peer_id, norm, limit)
            scale *= float(limit / norm)
        total += contribution.pseudo_gradient * scale
    return total


def _reference_norm(finite: list[Contribution], norms: torch.Tensor, own: str | None) -> torch.Tensor:
    if len(finite) != 2:
        return norms.median()
    mine = [norm for c, norm in zip(finite, norms, strict=True) if c.peer_id == own]
    return mine[0] if mine else norms.min()


def weighted_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Σ w_i x_i / Σ w_i in the given order (callers pass peer order, so every node gets the same bits)."""
    total = torch.zeros_like(tensors[0])
    weight_sum = sum(weights)
    for tensor, weight in zip(tensors, weights, strict=True):
        total += tensor * (weight / weight_sum)
    return total
