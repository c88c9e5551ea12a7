"""The bounded, token-weighted mean of the group's pseudo-gradients (docs/architecture.md §3, 'Robust mean';
`--weighting` may weight by √tokens or equally instead: §13, 'Weights').

Every node computes it from the same contributions in the same (peer id) order with the same
operations, so every node gets a bit-identical result and φ stays equal across the group.

Aggregators (`--aggregator`):
- mean: Σ w_m Δ_m / Σ w_m; no bound on any one peer (a trusted cluster's choice).
- clip (default): each Δ_m scaled down to at most NORM_CLIP_MULTIPLE × a reference norm first.
  It bounds one peer's pull to that multiple over its token share, costs one pass, and changes
  nothing in an honest group whose norms lie within the multiple of the median, so φ stays bit-equal.
- trimmed: clip, then per coordinate drop the ⌊TRIM_FRACTION·M⌋ largest and smallest values
  (unweighted mean of the rest); with fewer than 1/TRIM_FRACTION members it trims nothing.
- centered-clip: start from clip's mean v and CENTERED_CLIP_ITERATIONS times move it by the
  token-weighted mean of each Δ_m − v clipped to the reference norm: a peer far from the
  others moves v by at most that norm times its share, however far it is.

The reference norm is the group's median norm (the middle element of the sorted norms, the upper one
of an even group, as the token cap's median declaration). In a group of two the median is the mean of the two
norms, which a single huge contribution drags up with it, so there it is the smaller norm: the same
on both sides, so an honest pair stays bit-equal whatever its norms. A pair cannot tell which of
the two lies, so there the clip is the smaller norm itself (PAIR_CLIP_MULTIPLE): both count alike
and the mean is never against either member's own Δ, h·(h + a) ≥ 0 when ‖a‖ ≤ ‖h‖.

Why 1.25 and 1 (docs/architecture.md §3, 'Bound'): one contributor pulls the mean by at most
(its weight share) × (its clipped norm). With the cap at the median declaration its share is at
most 1/M among equal honest peers, and with the clip at 1.25 median norms an attacker that knows
the honest mean and aims its worst direction leaves cos(mean, honest mean) ≥ 0.5 at M = 3 and
≥ 0.8 at M = 8 (tests/unit/test_aggregate.py measures it); at 4× and 4× it reversed the mean.
Honest peers with equal tokens and norms within 1.25× the median are not touched.

A butterfly part's owner (swarm/butterfly.py) aggregates one slice of each Δ: clipping then scales
the slice by the whole Δ's norm its peer declared (outer/averaging.py drops a slice longer than that),
so it scales exactly as the whole would. centered-clip measures distances between whole vectors and
so runs over all-gather only.

Declared tokens count at most TOKEN_CAP_MULTIPLE × the group's median declaration (of two: the
smaller) and at most the run's `max_tokens_per_round` when set: a peer that claims more is counted
at the cap (and reported as clipped), so it cannot outweigh the group. Nodes may differ in H and
batch size, so the run's config fixes no token count by itself.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

AGGREGATORS = ("mean", "clip", "trimmed", "centered-clip")
# How counted tokens (after the caps) become weights (docs/architecture.md §13, 'Weights'): w ∝ n,
# w ∝ √n, or w = 1/M. The default is the one benchmarks/heterogeneous.py measured best.
WEIGHTINGS = ("tokens", "sqrt-tokens", "equal")
NORM_CLIP_MULTIPLE = 1.25  # a contribution longer than this many reference norms is scaled down
# A pair cannot tell who lies: each Δ is clipped to the shorter norm, so the mean never points
# against either member's own Δ (an attacker can cancel a step, never reverse it).
PAIR_CLIP_MULTIPLE = 1.0
TOKEN_CAP_MULTIPLE = 1.0  # declared tokens count at most this many times the group's typical count
FAR_OVER_BOUND = 2.0  # a clip or cap of a contribution this many times the bound or more is logged as a warning
# NoLoCo's φ̄: how far (in reference norms of Δ) a member's φ may pull from ours. φs differ by the
# drift of several rounds, not one Δ, so this stays wider than the Δ clip.
PHI_RADIUS_MULTIPLE = 4.0
TRIM_FRACTION = 0.2
CENTERED_CLIP_ITERATIONS = 3


@dataclass(frozen=True)
class Contribution:
    peer_id: str
    tokens: float
    pseudo_gradient: torch.Tensor  # flat fp32: the whole Δ, or one butterfly part of it
    norm: float | None = None  # the whole Δ's norm when `pseudo_gradient` is a part (declared by the peer)


@dataclass(frozen=True)
class Aggregate:
    mean: torch.Tensor
    used: tuple[str, ...]  # peers whose contributions are in the mean, in peer order
    tokens: tuple[float, ...]  # the tokens each of them counted for (after the caps)
    weights: tuple[float, ...]  # each one's share of the mean (by the weighting; they sum to 1)
    clipped: tuple[str, ...]  # scaled down, or counted at the token cap
    rejected: tuple[str, ...]  # non-finite values or no tokens: left out
    reference_norm: float  # what clipping measured against (NoLoCo bounds φ's pull with it)
    removed: float = 0.0  # the share of the group's declared work the caps and the clip took away (removed_share)


def aggregate(contributions: list[Contribution], method: str = "clip", max_tokens: float | None = None,
              weighting: str = "tokens") -> Aggregate:
    """The group's mean by `method` (see the module's docstring), each contribution weighted by
    `weighting` of its counted tokens; ValueError when none is usable."""
    if method not in AGGREGATORS:
        raise ValueError(f"unknown aggregator '{method}'")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting '{weighting}'")
    ordered = sorted(contributions, key=lambda c: c.peer_id)
    finite = [c for c in ordered
              if torch.isfinite(c.pseudo_gradient).all() and math.isfinite(c.tokens) and c.tokens > 0]
    rejected = tuple(sorted({c.peer_id for c in ordered} - {c.peer_id for c in finite}))
    for peer in rejected:
        logger.warning("rejected contribution from peer=%s: non-finite values or tokens, or no tokens", peer)
    if not finite:
        raise ValueError("no usable contribution")
    declared = [c.tokens for c in finite]
    finite, capped = _cap_tokens(finite, max_tokens)
    norms = torch.stack([c.pseudo_gradient.norm() if c.norm is None else torch.tensor(c.norm) for c in finite])
    reference = _reference_norm(norms)
    removed = removed_share(declared, [float(n) for n in norms], method, max_tokens, weighting)
    weights = weights_of([c.tokens for c in finite], weighting)
    scaled: list[str] = []
    if method == "mean":
        mean = _weighted([c.pseudo_gradient for c in finite], weights)
    else:
        vectors, scaled = _clipped(finite, norms, clip_multiple(len(finite)) * reference)
        trim = int(TRIM_FRACTION * len(vectors)) if method == "trimmed" else 0
        if method == "centered-clip":
            mean = _centered_clip(vectors, weights, _weighted(vectors, weights), reference)
        elif trim:
            mean = _trimmed(vectors, trim)
            # a coordinate-wise trimmed mean weighs every kept value alike: that is each one's share
            weights = [1.0 / len(vectors)] * len(vectors)
        else:
            mean = _weighted(vectors, weights)
    clipped = tuple(sorted(set(capped) | set(scaled)))
    return Aggregate(mean, tuple(c.peer_id for c in finite), tuple(c.tokens for c in finite), tuple(weights),
                     clipped, rejected, float(reference), removed)


def removed_share(declared: list[float], norms: list[float], method: str = "clip", max_tokens: float | None = None,
                  weighting: str = "tokens") -> float:
    """How much of a group's work the token cap and the norm clip took away, from what the members
    declared (tokens > 0, the whole Δs' norms) alone, so every member of a butterfly computes it from
    an owner's report alike: Σ max(0, w_m·n_m − w'_m·n'_m) / Σ w_m·n_m, with w the shares the declared
    tokens would have had, w' those the capped tokens got, n the norms and n' the clipped ones. 0 in an
    honest group of equal work; a pair of Δs 2:1 in norm loses 1/3 (the pair clips to the shorter)."""
    counted_cap = token_cap(declared, max_tokens)
    intended = weights_of(declared, weighting)
    applied = weights_of([min(tokens, counted_cap) for tokens in declared], weighting)
    limit = clip_multiple(len(norms)) * reference_norm(norms) if method != "mean" and len(norms) > 1 else math.inf
    work = [w * n for w, n in zip(intended, norms, strict=True)]
    total = sum(work)
    if not total > 0:
        return 0.0
    kept = [w * min(n, limit) for w, n in zip(applied, norms, strict=True)]
    return sum(max(0.0, before - after) for before, after in zip(work, kept, strict=True)) / total


def weights_of(counted: list[float], weighting: str = "tokens") -> list[float]:
    """Each contribution's share of the mean from its counted tokens (all > 0), in the given order:
    n_m / Σn, √n_m / Σ√n, or 1/M (docs/architecture.md §13)."""
    values = (counted if weighting == "tokens" else [math.sqrt(n) for n in counted] if weighting == "sqrt-tokens"
              else [1.0] * len(counted))
    total = sum(values)
    return [value / total for value in values]


def _cap_tokens(finite: list[Contribution], max_tokens: float | None) -> tuple[list[Contribution], list[str]]:
    """Declared tokens capped at `max_tokens` and at TOKEN_CAP_MULTIPLE × the group's median (of two:
    the smaller); computed from the contributions alone, so every member caps alike."""
    cap = token_cap([c.tokens for c in finite], max_tokens)
    capped = [c.peer_id for c in finite if c.tokens > cap]
    for contribution in finite:
        if contribution.tokens > cap:
            # a little over the cap is ordinary between honest peers (under --round-seconds a faster
            # node declares more every round; weight_removed reports the cost); far over it, a warning
            level = logging.WARNING if contribution.tokens > FAR_OVER_BOUND * cap else logging.INFO
            logger.log(level, "capped the tokens of peer=%s at %.0f", contribution.peer_id, cap)
    return [Contribution(c.peer_id, min(c.tokens, cap), c.pseudo_gradient, c.norm) for c in finite], capped


def token_cap(declared: list[float], max_tokens: float | None) -> float:
    """The most tokens one of these declarations counts for (members check owners' reports with it)."""
    ordered = sorted(declared)
    typical = ordered[0] if len(ordered) == 2 else ordered[len(ordered) // 2]
    return TOKEN_CAP_MULTIPLE * typical if max_tokens is None else min(max_tokens, TOKEN_CAP_MULTIPLE * typical)


def _clipped(finite: list[Contribution], norms: torch.Tensor,
             limit: torch.Tensor) -> tuple[list[torch.Tensor], list[str]]:
    vectors, scaled = [], []
    for contribution, norm in zip(finite, norms, strict=True):
        if len(finite) > 1 and norm > limit:
            # a little over the bound is ordinary between honest peers (a pair clips the longer Δ
            # every round); far over it is worth the operator's attention
            level = logging.WARNING if norm > FAR_OVER_BOUND * limit else logging.INFO
            logger.log(level, "clipped contribution from peer=%s: norm %.3g > %.3g", contribution.peer_id, norm, limit)
            vectors.append(contribution.pseudo_gradient * float(limit / norm))
            scaled.append(contribution.peer_id)
        else:
            vectors.append(contribution.pseudo_gradient)
    return vectors, scaled


def _trimmed(vectors: list[torch.Tensor], trim: int) -> torch.Tensor:
    ordered = torch.stack(vectors).sort(dim=0).values
    return ordered[trim:len(vectors) - trim].mean(dim=0)


def _centered_clip(vectors: list[torch.Tensor], weights: list[float], start: torch.Tensor,
                   radius: torch.Tensor) -> torch.Tensor:
    center = start
    for _ in range(CENTERED_CLIP_ITERATIONS):
        step = torch.zeros_like(center)
        for vector, weight in zip(vectors, weights, strict=True):
            offset = vector - center
            norm = offset.norm()
            step += offset * (weight * min(1.0, float(radius / norm)) if norm > 0 else 0.0)
        center = center + step
    return center


def clip_multiple(members: int) -> float:
    """How many reference norms a contribution may reach in a group of `members`."""
    return PAIR_CLIP_MULTIPLE if members == 2 else NORM_CLIP_MULTIPLE


def reference_norm(norms: list[float]) -> float:
    """What clipping measures against, from the norms alone (members check owners' parts with it)."""
    return float(_reference_norm(torch.tensor(norms, dtype=torch.float32)))


def _reference_norm(norms: torch.Tensor) -> torch.Tensor:
    # the middle element, as token_cap takes it: with an even group (torch's lower median would be the
    # one below) half the group slower than the rest made ρ a slow node's norm, and a fast node's Δ
    # was clipped to 1.25 of the slowest's (docs/architecture.md §13, "Warmup")
    return norms.min() if len(norms) == 2 else norms.sort().values[len(norms) // 2]


def _weighted(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = torch.zeros_like(tensors[0])
    for tensor, weight in zip(tensors, weights, strict=True):
        total += tensor * weight
    return total


def weighted_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Σ w_i x_i / Σ w_i in the given order (callers pass peer order, so every node gets the same bits)."""
    weight_sum = sum(weights)
    return _weighted(tensors, [weight / weight_sum for weight in weights])


def bounded_phi_mean(phis: list[torch.Tensor], weights: list[float], own: torch.Tensor,
                     radius: float) -> tuple[torch.Tensor, list[int]]:
    """NoLoCo's φ̄ with no member pulling it further than `radius` from our own φ: each φ_m − φ_own
    clipped to `radius` before the weighted mean. Honest members (within the radius) change nothing.
    Returns φ̄ and the indices of the members clipped."""
    clipped, offsets = [], []
    for index, phi in enumerate(phis):
        offset = phi - own
        norm = float(offset.norm())
        if norm > radius:
            offset = offset * (radius / norm)
            clipped.append(index)
        offsets.append(offset)
    return own + weighted_mean(offsets, weights), clipped
