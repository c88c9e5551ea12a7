"""DiLoCo, delayed and eager: the exchange of Δ_t runs during the next inner phase (outer/sync.py
has the rule each step follows and why every Δ is applied exactly once).

With fragments (docs/architecture.md §15) the same ledger runs per fragment: round t steps only its
fragment f, with the corrections of f's rounds that landed since f last stepped (`owed`) plus
w_t·Δ_t of f; a mean that lands for another fragment waits in `owed` for that fragment's next round.
So each fragment's momentum takes one step per P rounds, as each round's does with one fragment."""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from diloco_node.config import NodeConfig
from diloco_node.outer.diloco import OuterOptimizer
from diloco_node.outer.fragments import Fragment
from diloco_node.outer.state import OuterState, Served
from diloco_node.outer.sync import Applied, PendingExchanges, correction, fresh_weight
from diloco_node.outer.update import UpdateContext, exchanging
from diloco_node.replica.layout import flatten
from diloco_node.round import AverageResult, Outcome, Own, RoundReport

# The longest mean of a round inherited from a state's server, in our own Δ's norms (per value, so
# a round of another fragment compares alike): every other round's mean went through the group's
# clip, but a server's group may be itself alone, or itself and one more identity of its own. An
# honest server's round is about as long as ours: speeds 4x apart under --round-seconds (§13), a
# joiner's first phase a quarter of a round (MIN_SHARE), fragments whose values moved unevenly; 16
# leaves that room. A longer one is scaled down, and a server that lied then differs from us and
# is found `diverged` (a re-sync: the whole cost of its lie), where it had moved φ by 3e7.
INHERITED_CLIP_MULTIPLE = 16.0

logger = logging.getLogger(__name__)


class SettledCopy:
    """φ and the momentum with each landed round's mean applied in round order and nothing else:
    what a blocking node would hold. It is what we serve joiners, and it is the same, bit for bit,
    on the nodes that applied the same means (our φ is not: each node's own Δ went in early), so
    a joiner can check what it downloads against the digests most nodes announce."""

    def __init__(self, state: OuterState, optimizer: OuterOptimizer):
        self.phi = [p.clone() for p in state.phi]
        self.optimizer = optimizer.copy(self.phi)

    def step(self, fragment: Fragment, mean: torch.Tensor) -> None:
        self.optimizer.step(fragment.shaped(mean, self.phi), fragment.first)


@dataclass(frozen=True)
class Landed:
    outcome: Outcome
    result: AverageResult | None  # None: no mean for the round (stopped at shutdown, or behind)


class OverlappedUpdate:
    def __init__(self, ctx: UpdateContext, optimizer: OuterOptimizer, cfg: NodeConfig):
        self.ctx, self.optimizer = ctx, optimizer
        self.mode, self.proxy, self.sync_timeout = cfg.outer.sync, cfg.outer.eager_proxy, cfg.outer.sync_timeout
        # settling has no next round to go on with: it waits as long as an exchange can take
        self.settle_timeout = max(cfg.outer.sync_timeout, cfg.swarm.round_timeout)
        self.pending: PendingExchanges[Landed] = PendingExchanges()
        self.last_share: float | None = None
        self.restored: list[Applied] = []  # from a checkpoint: applied at their fragment's next step, as averaged alone
        # landed (or failed) exchanges whose fragment has not stepped since, in round order (§15)
        self.owed: list[tuple[Applied, Landed | None]] = []
        self.inherited: list[tuple[str, Applied]] = []  # from a state download: (server, its round in flight)
        # our exchanges a re-sync dropped, by round: one of a round we inherit gives its mean (inherit)
        self.dropped: dict[int, Future[Landed]] = {}
        self.settled: SettledCopy | None = None  # made from φ when nothing of ours is in it early
        self.last_group: tuple[str, ...] = ()  # of the last exchange of ours that landed
        self.own_norm: float | None = None  # our last Δ's norm per value: what bounds an inherited mean

    def finish_round(self, round_: int, pseudo_gradient: torch.Tensor, tokens: float) -> RoundReport:
        ctx = self.ctx
        fragment = ctx.fragment_of(round_)
        own = fragment.averaging.encode(round_, fragment.cut(pseudo_gradient), tokens)
        ctx.swarm.offer(round_, own.payload, tokens, fragment.averaging.parts(round_, own))
        fresh = own.decoded if own.decoded is not None else torch.zeros(fragment.numel)
        self.pending.wait(round_ - 1, self.sync_timeout)
        self.pending.make_room(self.settle_timeout)
        self.own_norm = _norm_per_value(fresh) or self.own_norm
        inherited = self._resolve_inherited(self.own_norm)
        diverged = self._diverged()
        # taking the landed exchanges and applying them is one step under φ's lock: a joiner's state
        # (served) sees each exchange either pending or applied, never neither
        with ctx.state.lock:
            self._settled_copy()
            self.inherited = []  # under the lock: served() lists them in flight until their means are in
            finished = inherited + self.pending.take_finished()
            last = finished[-1][1] if finished else None
            if any(outcome is not None and outcome.outcome == Outcome.BEHIND for _, outcome in finished):
                return RoundReport(Outcome.BEHIND, own, None)  # the round engine re-syncs: nothing here applies
            self._land(finished)
            owed = self._owed_by(fragment)
            step = self._corrections(fragment, owed)
            weight = fresh_weight(self.mode, self.proxy, self.last_share, ctx.swarm.peer_count())
            if owed or weight:  # delayed's first round has nothing to apply: no momentum-only step
                self.optimizer.step(fragment.shaped(step + weight * fresh, ctx.state.phi), fragment.first)
                ctx.state.steps += 1
            ctx.state.round += 1
            applied = Applied(round_, fresh, weight, ctx.state.steps)
            self.pending.start(applied, lambda: self._exchange(round_, own))
        return RoundReport(last.outcome if last else Outcome.LOST, own, last.result if last else None,
                           diverged=diverged, group_round=finished[-1][0].round + 1 if finished else None)

    def _diverged(self) -> bool:
        """Whether the state we serve differs from the one our last group serves, settled up to the
        same round: an exchange that failed on one side only (averaged alone) splits it for good,
        and our φ with it. Compared before this round's take, so the group has had a round to
        announce the state we have held since the last one (our record announced it as the inner
        phase ended, and nothing has stepped the settled copy since)."""
        return bool(self.last_group) and self.ctx.swarm.served_diverged(self.last_group)

    def _settled_copy(self) -> SettledCopy:
        """Under φ's lock. Made when φ holds nothing of ours early: at the start, after a state
        download, and after a resume (whose open rounds count as averaged alone, as in φ)."""
        if self.settled is None:
            self.settled = SettledCopy(self.ctx.state, self.optimizer)
            for fragment in self._fragments():
                if restored := [a for a in self.restored if self.ctx.fragment_of(a.round).index == fragment.index]:
                    self.settled.step(fragment, torch.stack([correction(a, None) for a in restored]).sum(0))
        return self.settled

    def _fragments(self) -> list[Fragment]:
        return self.ctx.fragments.all

    def _land(self, finished: list[tuple[Applied, Landed | None]]) -> None:
        """Each landed mean steps the settled copy, in round order, and is owed to its fragment's
        next step (at once with one fragment)."""
        settled = self._settled_copy()
        for applied, outcome in finished:
            self.owed.append((applied, outcome))
            if outcome is not None and outcome.outcome == Outcome.HELD:
                continue  # a held round steps nothing: a blocking node holds φ as it was, and so does the copy
            mean = _mean(outcome)
            settled.step(self.ctx.fragment_of(applied.round), mean if mean is not None else applied.own)
            if outcome is not None and outcome.result is not None and outcome.result.own_share > 0:
                self.last_share = outcome.result.own_share  # ours, not an inherited round's
                self.last_group = outcome.result.group

    def _owed_by(self, fragment: Fragment) -> list[tuple[Applied, Landed | None]]:
        """Taken: what `fragment`'s next step applies, those a checkpoint left open first (as averaged
        alone), then the landed ones in round order."""
        def of_it(applied: Applied) -> bool:
            return self.ctx.fragment_of(applied.round).index == fragment.index
        owed: list[tuple[Applied, Landed | None]] = [(a, None) for a in self.restored if of_it(a)]
        owed += [(a, outcome) for a, outcome in self.owed if of_it(a)]
        self.restored = [a for a in self.restored if not of_it(a)]
        self.owed = [(a, outcome) for a, outcome in self.owed if not of_it(a)]
        return owed

    def _corrections(self, fragment: Fragment, owed: list[tuple[Applied, Landed | None]]) -> torch.Tensor:
        """Σ (Δ̄_r − w_r·Δ_r) over `fragment`'s rounds owed."""
        total = torch.zeros(fragment.numel)
        for applied, outcome in owed:
            if outcome is not None and outcome.outcome == Outcome.HELD:
                # a held round steps nothing (round.held): take back what we applied of it early
                total -= applied.weight * applied.own
                continue
            total += correction(applied, _mean(outcome))
        return total

    def _exchange(self, round_: int, own: Own) -> Landed:
        """On the exchange's own thread; gives up only at shutdown (a stop settles it instead)."""
        ctx = self.ctx
        averaging = ctx.fragment_of(round_).averaging
        with exchanging(ctx.telemetry, round_):
            gathered = ctx.swarm.gather(round_, own.payload is not None, ctx.abandon)
        if gathered.outcome in (Outcome.STOPPED, Outcome.BEHIND):
            return Landed(gathered.outcome, None)
        ctx.swarm.mark_exchanged(round_)
        if gathered.outcome == Outcome.HELD:
            return Landed(Outcome.HELD, averaging.nothing(own))
        return Landed(gathered.outcome, averaging.mean(own, gathered))

    def settle(self) -> AverageResult | None:
        """The step the next round would take with nothing new trained (no round advance): with
        the rounds a state download handed us in flight, too (a re-sync in the run's last round);
        with fragments, one for each fragment something is owed to."""
        self.pending.wait(None, self.settle_timeout)
        inherited = self._resolve_inherited(self.own_norm)
        with self.ctx.state.lock:
            self._settled_copy()
            self.inherited = []
            finished = inherited + self.pending.take_finished()
            if self.pending.outstanding():
                logger.warning("round=%d the last exchange did not finish; ending without it", self.ctx.state.round)
            if not finished and not self.restored and not self.owed:
                return None
            self._land(finished)
            for fragment in self._fragments():
                if owed := self._owed_by(fragment):
                    step = self._corrections(fragment, owed)
                    self.optimizer.step(fragment.shaped(step, self.ctx.state.phi), fragment.first)
                    self.ctx.state.steps += 1
        last = finished[-1][1] if finished else None
        return last.result if last else None

    def served(self) -> Served:
        """Under φ's lock, for a joiner (OuterState.served): the settled copy, and the rounds whose
        means it lacks, which the joiner fetches itself (`inherit`). It then holds each round's
        mean exactly once, and none of our own Δs."""
        settled = self._settled_copy()
        in_flight = [a.round for a, _ in self.pending.peek()] + [a.round for _, a in self.inherited]
        return Served(self.ctx.state.round, flatten(settled.phi), flatten(settled.optimizer.momentum_buffers()),
                      settled.optimizer.has_momentum(), sorted(in_flight))

    def inherit(self, server: str, in_flight: list[Applied]) -> None:
        """After a state download: the rounds `server` had in flight are ours to complete (nothing of
        ours in them: zeros the length of each round's fragment)."""
        self.inherited = [(server, replace(applied, own=torch.zeros(self.ctx.fragment_of(applied.round).numel)))
                          for applied in in_flight]

    def _resolve_inherited(self, ours: float | None) -> list[tuple[Applied, Landed | None]]:
        """The means of the inherited rounds, fetched from their groups (a round that cannot be
        fetched is lost for us, and says so), each at most INHERITED_CLIP_MULTIPLE × `ours`, our own
        Δ's norm per value (None: no Δ of ours yet, as a joiner whose state came after its round's
        deadline: taken as it is, since a lie then costs us a re-sync and no more).
        A round we averaged in ourselves (we re-synced while its exchange ran) holds our payload
        too, which we fetch from our own offer."""
        resolved: list[tuple[Applied, Landed | None]] = []
        for server, applied in self.inherited:
            if (own := self._own_mean(applied.round, server)) is not None:
                resolved.append((applied, own))
                continue
            gathered = self.ctx.swarm.gather_group_of(applied.round, server)
            mean = self.ctx.fragment_of(applied.round).averaging.mean_of(gathered, server)
            if mean is not None:
                mean = _bounded(mean, ours, applied.round, server)
            if mean is None:
                logger.warning("round=%d could not fetch the mean our state's server had in flight; "
                               "that round is lost for us", applied.round)
                resolved.append((applied, None))
                continue
            resolved.append((applied, Landed(Outcome.TOGETHER, AverageResult(tuple(sorted(gathered.payloads)), mean,
                                                                         0.0, 0.0))))
        return resolved  # the caller clears `inherited` as it applies them, under φ's lock

    def _own_mean(self, round_: int, server: str) -> Landed | None:
        """The mean of a round we inherit from our own exchange of it, which a re-sync dropped while
        it ran (an eager re-sync after `diverged`): when `server` was in our group, it is the mean
        the server applies, and it needs no payload fetched again (at the run's end the server
        may have left once we had fetched its payload)."""
        future = self.dropped.pop(round_, None)
        if future is None:
            return None
        try:
            landed = future.result(timeout=self.settle_timeout)
        except Exception:  # still running, or failed (the exchange logged it): the group is asked instead
            return None
        result = landed.result
        if landed.outcome not in (Outcome.TOGETHER, Outcome.TIMEOUT) or result is None or server not in result.group:
            return None
        return Landed(Outcome.TOGETHER, AverageResult(result.group, result.mean, 0.0, 0.0))

    def outstanding(self) -> list[Applied]:
        """Counted back from the current step, as a checkpoint keeps them (install restarts the count)."""
        steps = self.ctx.state.steps
        # owed: landed for a fragment that has not stepped since; a resume counts them as averaged alone
        owed = [applied for applied, _ in self.owed]
        return [replace(a, at_step=a.at_step - steps)
                for a in sorted(self.restored + owed, key=lambda a: a.round) + self.pending.outstanding()]

    def restore(self, outstanding: list[Applied]) -> None:
        self.restored = list(outstanding)
        self.settled = None

    def forget(self) -> None:
        self.dropped = self.pending.drop()
        self.restored, self.inherited, self.owed = [], [], []
        self.last_share, self.last_group = None, ()
        self.settled = None  # φ was replaced: the next copy is made from it


def _mean(outcome: Landed | None) -> torch.Tensor | None:
    """The round's mean, None when it has none (failed, or only our own was missing)."""
    result = outcome.result if outcome is not None else None
    return result.mean if result is not None and result.group else None


def _norm_per_value(delta: torch.Tensor) -> float | None:
    """‖Δ‖ / √n: a norm that compares Δs of fragments of different sizes; None for no Δ (zeros)."""
    value = float(delta.norm()) / math.sqrt(max(delta.numel(), 1))
    return value if value > 0 and math.isfinite(value) else None


def _bounded(mean: torch.Tensor, ours: float | None, round_: int, server: str) -> torch.Tensor:
    """An inherited round's mean scaled down to INHERITED_CLIP_MULTIPLE × our own Δ's norm (per
    value); as it is while we have none to measure it by."""
    if ours is None:
        return mean
    limit = INHERITED_CLIP_MULTIPLE * ours * math.sqrt(mean.numel())
    length = float(mean.norm())
    if length <= limit:
        return mean
    logger.warning("round=%d clipped the mean inherited from peer=%s: %.4g long, more than %g times our own Δ",
                   round_, server[:60], length, INHERITED_CLIP_MULTIPLE)
    return mean * (limit / length)
