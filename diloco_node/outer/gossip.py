"""NoLoCo (docs/architecture.md §3): each round, average with a small drawn group only, then take NoLoCo's step
(momentum on the group's mean Δ plus a pull towards the group's mean φ)."""

from __future__ import annotations

import logging

import torch

from diloco_node.outer.noloco import NoLoCoOptimizer, consensus_distance
from diloco_node.outer.update import NoPending, UpdateContext, exchanging, solo_while_isolated
from diloco_node.round import Outcome, RoundReport, held

logger = logging.getLogger(__name__)


class GossipUpdate(NoPending):
    def __init__(self, ctx: UpdateContext, optimizer: NoLoCoOptimizer):
        self.ctx, self.optimizer = ctx, optimizer

    def finish_round(self, round_: int, pseudo_gradient: torch.Tensor, tokens: float) -> RoundReport:
        ctx = self.ctx
        # Gossip tolerates a round of lag (we then meet nobody, or whoever is as late); a node that
        # everyone else has left two rounds behind re-syncs instead.
        if ctx.swarm.all_past(round_ + 1):
            return RoundReport(Outcome.BEHIND, None, None)
        fragment = ctx.fragment_of(round_)  # docs/architecture.md §15: with fragments, Δ and φ of this one
        averaging = fragment.averaging
        own = averaging.encode(round_, fragment.cut(pseudo_gradient), tokens, fragment.cut(ctx.state.flat()))
        ctx.swarm.offer(round_, own.payload, tokens)
        others = [peer for peer in ctx.swarm.drawn_group(round_) if peer != ctx.swarm.peer_id]
        outcome = Outcome.ALONE
        if held(1 + len(others), ctx.swarm.min_group_size):  # drawn into too small a group (a run that small)
            logger.info("round=%d held: a drawn group of %d is below --min-group-size %d, so no outer step",
                        round_, 1 + len(others), ctx.swarm.min_group_size)
            outcome, result = Outcome.HELD, averaging.nothing(own)
        else:
            # the odd one out of the draw (no partner) goes on alone at once, unless a trusted peer
            # was left partnerless by forged records: they meet under the spare key (swarm/presence.py)
            with exchanging(ctx.telemetry, round_):
                gathered = ctx.swarm.gather(round_, own.payload is not None, ctx.stop, among=others)
            if gathered.outcome == Outcome.STOPPED:
                return RoundReport(Outcome.STOPPED, own, None)
            if gathered.outcome == Outcome.HELD:
                outcome, result = Outcome.HELD, averaging.nothing(own)
            elif gathered.outcome in (Outcome.ALONE, Outcome.BEHIND):
                logger.info("round=%d drawn to average alone" if not others else
                            "round=%d our group has left or moved on; averaging alone", round_)
                result = averaging.alone(own)
            else:
                result = averaging.mean(own, gathered)
                outcome = Outcome.TOGETHER if len(result.group) > 1 else Outcome.ALONE
        if solo_while_isolated(ctx, result, round_):
            return RoundReport(Outcome.ISOLATED, own, result)
        distance = None  # none when this round took no step
        with ctx.state.lock:
            if result.group and result.mean_phi is not None:
                distance = consensus_distance(fragment.cut(torch.cat([p.reshape(-1) for p in ctx.state.phi])),
                                              result.mean_phi)
                self.optimizer.step(fragment.shaped(result.mean, ctx.state.phi),
                                    fragment.shaped(result.mean_phi, ctx.state.phi), fragment.first)
            ctx.state.round += 1
        return RoundReport(outcome, own, result, consensus_distance=distance)
