"""The round loop (docs/architecture.md §2): one round top to bottom, the stop, the shutdown.

One round: θ ← φ on the replica; H inner steps; Δ = φ − θ; the outer update (exchange, robust mean,
step on φ); eval; checkpoint. compose.py builds the parts and startup.py joins the run. Anything
that goes wrong inside a round is logged and the round goes on with whoever made it; only a local
rank that dies ends the process (the node then stops without saving and resumes from its last
checkpoint).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict

from diloco_node.daemon.budget import StepClock, deadline, next_batches, warmup_pace
from diloco_node.daemon.checkpoint import export_info
from diloco_node.daemon.compose import Parts
from diloco_node.outer.fragments import Drift, codec_state
from diloco_node.replica import Replica, ReplicaError
from diloco_node.replica.layout import flatten
from diloco_node.round import AverageResult, Outcome, RoundReport
from diloco_node.swarm import HelperTimeout, Swarm
from diloco_node.swarm.spread import RoundClock
from diloco_node.telemetry.rounds import RoundTiming
from diloco_node.train.fit import FitError
from diloco_node.train.prefetch import METER as DATA_METER
from diloco_node.trust.work import DeclaredWork

logger = logging.getLogger(__name__)

# A download waits out the round the run is exchanging (blocking nodes share no state while in it).
STATE_DOWNLOAD_TIMEOUT = 60.0


class Node:
    def __init__(self, parts: Parts, say: Callable[[str], None] = print):
        self.parts, self.cfg, self.say = parts, parts.cfg, say
        self.state, self.telemetry, self.events = parts.state, parts.telemetry, parts.events
        self.stop_requested = parts.signals.requested
        self.inner_step = self.data_position = 0
        self.stream_seed = self.cfg.inputs.seed
        self.joined = False  # start-up finished: φ is the run's (or ours to start it) and worth saving
        self.failure: str | None = None  # a local rank failed: nothing of this run is saved
        self.revoked = False  # the run owner revoked our admission: we stopped
        # why a helper process of hivemind's died (swarm/watchdog.py): we stopped, exit 1; our φ is
        # still whole and is saved, only the swarm is gone
        self.helper_failure: str | None = None
        self.replica: Replica | None = None
        # seconds the last inner phase waited for batches: this process's (local rank 0's) data meter
        self.data_wait = 0.0
        self.round_batches = 0  # batches the last inner phase trained (more than its steps under --speed-spent batch)
        self.step_clock = StepClock()  # --round-seconds: our recent step (or, batch: per-batch) times (budget.py)
        # θ between rounds: reloaded from φ every round, or per fragment (docs/architecture.md §15)
        self.drift = Drift(parts.runs)
        self.claims = DeclaredWork()  # peers' declared tokens against their own published throughput (trust/work.py)
        # fragments under an overlapping sync: each round's payload is served across the next round's
        # inner phase, not in one burst (docs/architecture.md §15); blocking would wait for it instead
        self.round_clock = RoundClock(self.cfg.round_budget, self.cfg.swarm.round_timeout) \
            if self.cfg.outer.fragments > 1 and self.cfg.outer.sync != "blocking" \
            and self.cfg.noloco.algorithm == "diloco" else None

    @property
    def swarm(self) -> Swarm:
        assert self.parts.swarm is not None, "the swarm is joined at start-up"
        return self.parts.swarm

    def run(self) -> int:
        """Rounds until the run's end or a stop; 0, 1 when a local rank or a helper process died or a step
        did not fit in memory at one sequence, 2 when our admission was revoked."""
        try:
            while self.joined and not self.stop_requested.is_set():
                if self.cfg.outer.max_outer_steps and self.state.round >= self.cfg.outer.max_outer_steps:
                    break
                self.run_round()
            if self.joined and not self.helper_failure:  # without the swarm nothing in flight can finish
                self._settle()
        except (ReplicaError, FitError) as exc:  # FitError: a step out of memory at one sequence (train/fit.py)
            self.failure = str(exc)
            logger.error("stopping: %s (this node resumes from its last checkpoint)", exc)
        except HelperTimeout as exc:  # a helper call no caller could do without (the watchdog may have said why)
            if not self.helper_failure:
                self.helper_failure = str(exc)
                logger.error("stopping: %s (exit 1: restart the node; it resumes from its last checkpoint)", exc)
        finally:
            self.shutdown()
        return 1 if self.failure or self.helper_failure else 2 if self.revoked else 0

    def run_round(self) -> None:
        assert self.parts.update is not None and self.replica is not None
        self._wait_while_isolated()
        if self.stop_requested.is_set():
            return
        started = time.monotonic()
        late = self._deadline_passed()
        losses = self._inner_phase(train=not late)
        if losses is None or self._cut_off("after its inner phase"):
            return  # a stop mid-round: the checkpoint keeps the round's start
        computed = time.monotonic()
        if not losses and not late:  # --round-seconds: not one step fits before the deadline (§13)
            estimate = self.step_clock.estimate() or 0.0
            logger.warning("round=%d skipped: one inner step (%.1fs) does not fit before the round's deadline; "
                           "taking the others' mean, trying again next round", self.state.round, estimate)
            self.step_clock.forget()
        if self.round_clock is not None:
            self.round_clock.ran(computed - started)
            self.swarm.spread_offers(self.round_clock)
        self.announce(ready=True)
        delta = flatten(self.drift.delta(self.state.phi, self.replica.theta() or []))
        # tokens 0: no payload, we still take the group's mean (outer/averaging.py); the tokens we trained,
        # steps × their batches (docs/architecture.md §13), so a larger batch weighs as its tokens
        tokens = float(self.round_batches * self.cfg.inputs.batch_size * self.cfg.inputs.seq_len)
        exchanged = self.state.round  # and its fragment (docs/architecture.md §15), for the round record
        report = self.parts.update.finish_round(exchanged, delta, tokens)
        if report.outcome not in (Outcome.BEHIND, Outcome.STOPPED):
            self.drift.ended(self.state.round - 1 if report.stepped else self.state.round)
        if not report.stepped:
            if report.outcome == Outcome.ISOLATED:
                logger.info("round=%d dropped after its exchange: cut off from every peer, no solo step",
                            self.state.round)
            elif report.outcome == Outcome.BEHIND:
                logger.warning("round=%d peers moved on without us; re-syncing instead of sending stale work",
                               self.state.round)
                self.sync_from_peers()
                self.announce(ready=False)
            self.swarm.share_state()
            return
        if report.result is not None:  # whose checked work went into the mean we applied (trust/proofs.py)
            credible = self._credible(report.result, tokens)
            self.swarm.prove(self.state.round, credible)
            self._keep_pace(report.result, credible, len(losses))
        if report.diverged:  # our Δ was still a fine direction to contribute; our φ is what must be replaced
            logger.warning("round=%d our φ differs from the swarm's; re-syncing after this round", self.state.round)
            self.sync_from_peers()
        self._finish_round(losses, report, RoundTiming(computed - started, time.monotonic() - computed,
                                                       data_wait=self.data_wait, moved_at=time.time()),
                           fragment=exchanged % self.cfg.outer.fragments)
        self.announce(ready=False)
        # after announcing, so our own row carries this round's stats
        self.parts.reporter.swarm_table(self.swarm.peer_stats(), self.swarm.peer_id, self.replica.peak_memory())
        self.swarm.share_state()

    def _keep_pace(self, result: AverageResult, credible: list[str], steps: int) -> None:
        """Under --round-seconds, our warmup goes on at the pace of the group's fastest credible member
        (budget.warmup_pace). A butterfly member sees no declarations and keeps its own pace. Where every
        node runs the same H steps (a fixed H, --speed-spent batch) the schedule is common already."""
        if self.cfg.steps_agreed:
            return
        declared = dict(result.declared)
        paced = warmup_pace(self.inner_step, steps, (declared[peer] for peer in credible if peer in declared),
                            self.cfg.inputs.batch_size * self.cfg.inputs.seq_len, self.cfg.inner.warmup_steps)
        if paced > self.inner_step:
            assert self.replica is not None
            self.inner_step = paced
            self.replica.advance_schedule(paced)

    def _credible(self, result: AverageResult, own_tokens: float) -> list[str]:
        """The round's group less the peers whose declared tokens we doubt (trust/work.py), each
        doubt said once."""
        declared = dict(result.declared)
        credible, doubted = self.claims.credible(result.group, declared, self.swarm.peer_stats(),
                                                 self.cfg.round_budget, own_tokens)
        for peer, bound in doubted.items():
            logger.warning("round=%d peer=%s declared %.0f tokens, more than its own records allow a round "
                           "(%.0f): not counted as proven", self.state.round, peer, declared[peer], bound)
        return credible

    def _deadline_passed(self) -> bool:
        """Under --round-seconds, whether the run has already ended its inner phase of our round: a
        joiner whose state arrived between a deadline and the others' exchange starts the round
        the run just ended, and a node whose exchange ended late starts a round a grid slot late.
        Trained to the next deadline, its exchange would come a round late, with nobody left to
        matchmake with; with nothing trained it is in the group at once and takes the mean
        (docs/architecture.md §13). Only peers that decide count (trust/view.py). In a pair the one
        proven partner decides alone, and could say so every round (docs/trust.md)."""
        if not self.cfg.inner.round_seconds or not self.swarm.past_inner_phase(self.state.round):
            return False
        logger.info("round=%d the run's inner phase of this round is over: taking the group's mean "
                    "without training", self.state.round)
        return True

    def _inner_phase(self, train: bool = True) -> list[float] | None:
        """θ ← φ, then H inner steps, or under --round-seconds as many as fit before the round's
        deadline on the swarm's clock (none: the round is skipped; none either unless `train`), or
        under --speed-spent batch H steps of as many batches each as fit before it; None when a stop
        came first."""
        assert self.replica is not None
        with self.state.lock:
            self.replica.load(self.drift.start(self.state.phi))
        losses: list[float] = []
        self.round_batches = 0
        waited = DATA_METER.waited()
        seconds = self.cfg.round_budget  # T, or T/P with fragments: one fragment's round (§15)
        end = deadline(self.swarm.clock(), seconds) if seconds else 0.0
        self._place_schedule()
        while train and (batches := self._next_batches(len(losses), end)):
            if self.stop_requested.is_set():
                return None
            started = time.monotonic()
            losses.append(self.replica.train_step(self.stream_seed, self.data_position, batches))
            # per batch under --speed-spent batch (budget.accumulation sizes k from it); batches is 1 otherwise
            self.step_clock.add((time.monotonic() - started) / batches)
            self.data_position += batches
            self.round_batches += batches
            self.inner_step += 1
            # micro_batch_size: a step that ran out of memory has lowered it (train/inner.py)
            self.telemetry.update(inner_step=self.inner_step, loss=losses[-1],
                                  micro_batch_size=self.replica.micro_batch())
        self.data_wait = DATA_METER.waited() - waited
        return losses

    def _place_schedule(self) -> None:
        """Where this round's inner steps stand in the learning-rate schedule (docs/architecture.md §13).
        Under --round-seconds with speed spent on steps, the decay follows the run's rounds, not our
        steps. Under --speed-spent batch every node's round covers steps round·H .. round·H + H − 1, as
        with a fixed H: a node that fitted fewer last round catches up here, at the same point as the others."""
        assert self.replica is not None
        if not self.cfg.steps_agreed:
            rounds = self.cfg.outer.max_outer_steps
            self.replica.set_progress(self.state.round / rounds if rounds else 0.0)
        elif self.cfg.inner.round_seconds and \
                self.inner_step < (start := self.cfg.inner_steps_before(self.state.round)):
            self.inner_step = start
            self.replica.advance_schedule(start)

    def _next_batches(self, steps: int, end: float) -> int:
        """The batches the inner phase's next step trains, `steps` taken; 0: the phase is over. One, H
        times, or under --round-seconds while one fits before `end`; under --speed-spent batch the
        round's H steps, each of as many batches as fit (budget.next_batches)."""
        if not self.cfg.inner.round_seconds:
            return int(steps < self.cfg.round_inner_steps(self.state.round))
        if self.cfg.inner.speed_spent == "batch":
            return next_batches(self.swarm.clock(), end, steps, self.cfg.round_inner_steps(self.state.round),
                                self.step_clock)
        return int(self.step_clock.fits(self.swarm.clock(), end))

    def _finish_round(self, losses: list[float], report: RoundReport, timing: RoundTiming, fragment: int) -> None:
        """Everything the round leaves behind: its record (status, history, events, log line, our
        row of the swarm table) and a checkpoint. `report.result` is the exchange this round's
        outer step used: this round's when blocking, an earlier round's when overlapped."""
        assert self.replica is not None
        record = self.parts.reporter.finished(self.state.round, losses, self.evaluate(), report, timing,
                                              self.state.digest(), traffic=self.swarm.traffic(),
                                              peak_memory=self.replica.peak_memory(), fragment=fragment)
        self.swarm.publish_stats(self.parts.reporter.peer_stats(record))
        logger.info("%s", record.log_line())
        self.events.emit("round", **record.event())
        every = self.cfg.persistence.checkpoint_every
        if self.parts.store and every and self.state.round % every == 0:
            self.save_checkpoint()

    def _settle(self) -> None:
        """At the end of a delayed or eager run, planned or asked for, apply what is in flight.

        It would otherwise be lost: delayed would never apply the last round's mean, and eager would
        keep its own pseudo-gradient in place of the group's. So a run that is resumed later finds
        no exchange to apply twice.
        """
        assert self.parts.update is not None
        if self.parts.update.settle() is None:
            return
        settled = self.parts.reporter.settled(self.state.round, self.evaluate(), self.state.digest(),
                                              traffic=self.swarm.traffic())
        logger.info("%s", settled.log_line())
        self.events.emit("settled", **settled.event())

    def take_run_state(self, fresh: bool) -> None:
        """At start-up: the run's state (sync_from_peers). A fresh node (no checkpoint) of a run past
        the round its seed builds asks again for as long as no peer shares it in time, a line each
        time: training its own φ0 would only find it behind at its first barrier, to re-sync after
        a round averaged alone, and again while the state still does not arrive."""
        while not self.sync_from_peers(fresh) and fresh and not self.stop_requested.is_set() \
                and self.swarm.ahead_of(self.state.round):
            logger.warning("the run is past round %d and no peer shared its state in time: asking again "
                           "(training from our own φ would only fall behind)", self.state.round)

    def sync_from_peers(self, fresh: bool = False) -> bool:
        """Download φ, outer momentum and the round from a peer; False when we are the first node,
        or (`fresh`: no checkpoint) the run's state is the one we built from the seed already."""
        assert self.replica is not None
        # until the round loop shares again: between the install and `inherit` our state would be
        # the new φ without the rounds in flight it lacks
        self.swarm.stop_sharing()
        # DiLoCo nodes serve the same state (φ under blocking, the settled copy when overlapped),
        # so the one downloaded must be the one most nodes announce; NoLoCo's φ differs by design
        received = self.swarm.download_state(STATE_DOWNLOAD_TIMEOUT + self.cfg.swarm.round_timeout, self.stop_requested,
                                             check_digest=self.cfg.noloco.algorithm != "noloco",
                                             held=self.served() if fresh else None, catch_up=self.parts.catch_up)
        if received is None:
            return False
        installed = self.state.install_shared(*received, self.cfg.fingerprint())
        if installed is None:  # malformed, or farther from our φ than the rounds between allow: said once there
            return False
        if self.parts.update is not None:
            self.parts.update.forget()
            self.parts.update.inherit(*installed)
        self.drift.forget()
        # A joiner's learning-rate schedule follows the run's progress, not its own step count. Under
        # --round-seconds that progress is the round (set each inner phase): it skips the warmup only.
        self.inner_step = max(self.inner_step, self.cfg.inner_steps_before(self.state.round)
                              if self.cfg.steps_agreed else self.cfg.inner.warmup_steps if self.state.round else 0)
        self.replica.advance_schedule(self.inner_step)
        logger.info("synced state from peers round=%d digest=%s", self.state.round, self.state.digest())
        self.events.emit("synced", round=self.state.round, digest=self.state.digest())
        return True

    def _wait_while_isolated(self) -> None:
        """Pause while every peer has vanished (swarm/isolation.py): solo rounds would only take φ
        away from the swarm's. Once a peer is back, re-sync if the run went on without us."""
        if not self.swarm.isolated():
            return
        while self.swarm.isolated():
            if self.stop_requested.wait(1.0):
                return
        if self.swarm.ahead_of(self.state.round):
            self.sync_from_peers()
            self.announce(ready=False)

    def _cut_off(self, stage: str) -> bool:
        """Whether this round must be dropped because we are cut off from every peer; says so."""
        if not self.swarm.isolated():
            return False
        logger.info("round=%d dropped %s: cut off from every peer, no solo step", self.state.round, stage)
        return True

    def announce(self, ready: bool) -> None:
        """Tell the run where we are: training the round (ready=False) or done with its inner phase."""
        self.swarm.announce(self.state.round, ready, self.state.digest(), self.served())

    def served(self) -> tuple[int, str]:
        """The (settled round, digest) of the state we serve joiners, for our record."""
        assert self.parts.update is not None
        served = self.state.served(self.parts.update.served)
        return served.settled_round, served.digest()

    def evaluate(self) -> float:
        assert self.replica is not None
        with self.state.lock:
            self.replica.load(self.state.phi)
        return self.replica.evaluate()

    # --- persistence and shutdown -------------------------------------------------------------

    def save_checkpoint(self) -> None:
        assert self.parts.store is not None and self.replica is not None and self.parts.update is not None
        drift = self.drift.saved()  # with fragments: θ runs ahead of φ between a fragment's exchanges (§15)
        self.parts.store.save({
            "fingerprint": self.cfg.checkpoint_fingerprint(), **self.state.saved(),
            "inner": self.replica.inner_state(), "codec": codec_state(self.parts.codecs),
            "data_position": self.data_position, "stream_seed": self.stream_seed,
            "outstanding": [asdict(a) for a in self.parts.update.outstanding()],
            "export": export_info(self.cfg),  # what `diloco-node export` makes of φ
            **({"drift": drift} if drift is not None else {})})

    def abort(self) -> None:
        """Release what a failed start-up acquired, saving nothing."""
        self.events.close()
        self._release()

    def shutdown(self) -> None:
        self.stop_requested.set()
        self.parts.abandon.set()  # an exchange still waiting on peers gives up
        store = self.parts.store
        if store:
            # a node stopped before it had the run's φ has nothing worth resuming, and one whose
            # rank failed cannot gather its inner state: the last checkpoint stands
            if self.joined and not self.failure:
                self.save_checkpoint()
        if self.parts.update:
            self.parts.update.forget()
        self._release()
        logger.info("left the swarm at round=%d", self.state.round)
        self.events.emit("left", round=self.state.round, failure=self.failure)
        self.events.close()

    def _release(self) -> None:
        if self.parts.store:
            self.parts.store.close()
        if self.replica:
            self.replica.close()
        if self.parts.swarm:
            self.parts.swarm.leave()
        self.parts.wire.stop()
        self.parts.server.stop()
