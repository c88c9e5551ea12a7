"""DiLoCo, delayed and eager: the exchange of Δ_t runs during the next inner phase (outer/sync.py
has the rule each step follows and why every Δ is applied exactly once)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from diloco_node.config import NodeConfig
from diloco_node.outer.averaging import AverageResult, Own
from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.sync import Applied, PendingExchanges, correction, fresh_weight
from diloco_node.outer.update import RoundReport, UpdateContext, exchanging

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    verdict: str
    result: AverageResult | None  # None: no mean for the round (stopped at shutdown, or behind)


class OverlappedUpdate:
    def __init__(self, ctx: UpdateContext, optimizer: OuterOptimizer, cfg: NodeConfig):
        self.ctx, self.optimizer = ctx, optimizer
        self.mode, self.proxy, self.sync_timeout = cfg.sync, cfg.eager_proxy, cfg.sync_timeout
        self.pending: PendingExchanges[Outcome] = PendingExchanges()
        self.last_share: float | None = None
        self.restored: list[Applied] = []  # from a checkpoint: applied at the next step, as averaged alone

    def finish_round(self, round_: int, pseudo_gradient: torch.Tensor, tokens: float) -> RoundReport:
        ctx = self.ctx
        own = ctx.averaging.encode(round_, pseudo_gradient, tokens)
        ctx.swarm.offer(round_, own.payload, tokens)
        finished = self.pending.collect(round_ - 1, self.sync_timeout)
        last = finished[-1][1] if finished else None
        if any(outcome is not None and outcome.verdict == "behind" for _, outcome in finished):
            return RoundReport("behind", own, None)  # the round engine re-syncs: nothing here applies
        landed = bool(finished or self.restored)
        step = self._corrections(finished)
        fresh = own.decoded if own.decoded is not None else torch.zeros(ctx.state.numel)
        applied = Applied(round_, fresh, fresh_weight(self.mode, self.proxy, self.last_share,
                                                      len(ctx.swarm.presence.compatible_peers())))
        self.pending.start(applied, lambda: self._exchange(round_, own))
        with ctx.state.lock:
            if landed or applied.weight:  # delayed's first round has nothing to apply: no momentum-only step
                self.optimizer.step(ctx.state.shaped(step + applied.weight * fresh))
            ctx.state.round += 1
        return RoundReport(last.verdict if last else "lost", own, last.result if last else None)

    def _corrections(self, finished: list[tuple[Applied, Outcome | None]]) -> torch.Tensor:
        """Σ (Δ̄_r − w_r·Δ_r) over the exchanges that landed (and those a checkpoint left open)."""
        total = torch.zeros(self.ctx.state.numel)
        for applied in self.restored:
            total += correction(applied, None)
        self.restored = []
        for applied, outcome in finished:
            result = outcome.result if outcome is not None else None
            total += correction(applied, result.mean if result is not None and result.group else None)
            if result is not None and result.group:
                self.last_share = result.own_share
        return total

    def _exchange(self, round_: int, own: Own) -> Outcome:
        """On the exchange's own thread; gives up only at shutdown (a stop settles it instead)."""
        ctx = self.ctx
        with exchanging(ctx.telemetry, round_):
            gathered = ctx.swarm.gather(round_, own.payload is not None, ctx.abandon)
        if gathered.verdict in ("stopped", "behind"):
            return Outcome(gathered.verdict, None)
        ctx.swarm.presence.mark_exchanged(round_)
        return Outcome(gathered.verdict, ctx.averaging.mean(own, gathered))

    def settle(self) -> AverageResult | None:
        """The step the next round would take with nothing new trained (no round advance)."""
        finished = self.pending.collect(None, self.sync_timeout)
        if self.pending.outstanding():
            logger.warning("round=%d the last exchange did not finish; ending without it", self.ctx.state.round)
        if not finished and not self.restored:
            return None
        step = self._corrections(finished)
        with self.ctx.state.lock:
            self.optimizer.step(self.ctx.state.shaped(step))
        last = finished[-1][1] if finished else None
        return last.result if last else None

    def outstanding(self) -> list[Applied]:
        return self.restored + self.pending.outstanding()

    def restore(self, outstanding: list[Applied]) -> None:
        self.restored = list(outstanding)

    def forget(self) -> None:
        self.pending.drop()
        self.restored = []
        self.last_share = None
