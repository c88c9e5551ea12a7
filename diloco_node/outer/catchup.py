"""Catching a downloaded state up to the run's (docs/architecture.md §14).

Where the run's rounds are shorter than a state download (a capped server, a slow link), every
state a joiner downloads is some rounds old when it arrives. It is still a state of the run: the
run's state since is that one with the means of the rounds between applied, in round order, by
the outer optimizer, as every node applied them (a blocking node to φ, an overlapped one to its
settled copy). Those means are recomputed here from the payloads of the rounds' groups, fetched
from their members as the rounds a server had in flight are (OverlappedUpdate.inherit), and the
result is taken only if it is, bit for bit, the state the run's records agree on
(swarm/statesync.caught_up)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.update import UpdateContext
from diloco_node.replica.layout import flatten

logger = logging.getLogger(__name__)

SharedState = tuple[dict[str, Any], list[torch.Tensor]]  # metadata; φ and momentum, flat (outer/state.py)


def catch_up(ctx: UpdateContext, server: str, shared: SharedState, settled: int, round_: int) -> SharedState | None:
    """`shared` (from `server`, its metadata checked by trust/state.py's metadata_refusal) with the mean of
    each round before `settled` that it lacks applied: the state `server` serves at `round_`, whose
    rounds from `settled` on are in flight (the joiner inherits them as from any state). None when
    a mean cannot be had: its group's payloads are gone, or the state is not of our model's size."""
    metadata, vectors = shared
    optimizer = ctx.state.optimizer
    if not isinstance(optimizer, OuterOptimizer) or len(vectors) != 2 \
            or any(v.numel() != ctx.state.numel for v in vectors):
        return None
    lacking = {*metadata.get("in_flight", []), *range(metadata["round"], settled)}
    phi = ctx.state.shaped(vectors[0].clone())
    twin = optimizer.copy(phi)
    twin.load_momentum(ctx.state.shaped(vectors[1]) if metadata.get("has_momentum") else None)
    for r in sorted(r for r in lacking if r < settled):
        if ctx.stop.is_set() or ctx.abandon.is_set():  # a stop asked for: no more fetching
            return None
        fragment = ctx.fragment_of(r)
        mean = fragment.averaging.mean_of(ctx.swarm.gather_group_of(r, server), server)
        if mean is None:
            logger.warning("round=%d the mean of peer=%s's group cannot be had to catch a state up", r, server)
            return None
        twin.step(fragment.shaped(mean, phi), fragment.first)
    caught = {**metadata, "round": round_, "in_flight": list(range(settled, round_)),
              "has_momentum": twin.has_momentum()}
    return caught, [flatten(phi), flatten(twin.momentum_buffers())]
