"""DiLoCo, blocking: exchange Δ_t, wait for the group, apply Δ̄_t (docs/architecture.md §3); with fragments,
the round's fragment of each (§15)."""

from __future__ import annotations

import torch

from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.update import NoPending, UpdateContext, exchanging, solo_while_isolated
from diloco_node.round import Outcome, RoundReport


class BlockingUpdate(NoPending):
    def __init__(self, ctx: UpdateContext, optimizer: OuterOptimizer):
        self.ctx, self.optimizer = ctx, optimizer

    def finish_round(self, round_: int, pseudo_gradient: torch.Tensor, tokens: float) -> RoundReport:
        ctx = self.ctx
        fragment = ctx.fragment_of(round_)
        averaging = fragment.averaging
        own = averaging.encode(round_, fragment.cut(pseudo_gradient), tokens)
        ctx.swarm.offer(round_, own.payload, tokens, averaging.parts(round_, own))
        with exchanging(ctx.telemetry, round_):
            # Once the group forms, a joiner that downloaded φ would hold this round's start while
            # the group goes on without it: it would average alone and split off. It retries until
            # we have stepped (the node shares again after every round). Before, during the wait for
            # the others, it is welcome: it is counted in and waited for.
            gathered = ctx.swarm.gather(round_, own.payload is not None, ctx.stop, on_ready=ctx.swarm.stop_sharing)
        if gathered.outcome in (Outcome.STOPPED, Outcome.BEHIND):
            return RoundReport(gathered.outcome, own, None)
        result = averaging.nothing(own) if gathered.outcome == Outcome.HELD else averaging.mean(own, gathered)
        if solo_while_isolated(ctx, result, round_):
            return RoundReport(Outcome.ISOLATED, own, result)
        # compared before the step: the records of this round carry the φ every member started it from
        diverged = ctx.swarm.diverged(round_, ctx.state.digest(), result.group)
        with ctx.state.lock:
            if result.group:
                self.optimizer.step(fragment.shaped(result.mean, ctx.state.phi), fragment.first)
            ctx.state.round += 1
        # only now: a joiner that sees this round exchanged must also find φ past it
        ctx.swarm.mark_exchanged(round_)
        return RoundReport(gathered.outcome, own, result, diverged=diverged)
