"""Free identities decide nothing (trust/proofs.py): with 3 to 10 forged records beside two honest
nodes, the barrier, "behind" and the state a joiner takes follow proven peers only."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from diloco_node.round import Outcome
from diloco_node.swarm import presence as presence_module
from diloco_node.swarm import records
from diloco_node.trust import proofs
from diloco_node.trust.proofs import PROOF_ROUNDS, Proofs, anchor_ids, counted
from diloco_node.trust.records import MAX_PROVEN, NodeRecord, reference_state
from diloco_node.trust.view import round_state
from tests.unit.test_records import presence_seeing

ROUND = 7
HONEST_SERVED = (ROUND, "honest")


def honest(peer: str, ready: bool = True, proven: tuple[str, ...] = ()) -> NodeRecord:
    return NodeRecord(peer, "fp", ROUND, ROUND if ready else ROUND - 1, "d", exchanged_round=ROUND - 1,
                      served_round=HONEST_SERVED[0], served_digest=HONEST_SERVED[1], proven=proven)


def forged(count: int) -> list[NodeRecord]:
    """Records anyone can publish: at our round but never ready, all past it already, announcing a
    state of their own, and proving each other."""
    ids = tuple(f"sybil{i}" for i in range(count))
    return [NodeRecord(peer, "fp", ROUND, ROUND - 1, "d", exchanged_round=10**6, served_round=ROUND,
                       served_digest="forged", proven=ids, vouched=ids[:8]) for peer in ids]


@pytest.mark.parametrize("sybils", [3, 10])
def test_forged_records_neither_make_us_behind_nor_hold_the_barrier(sybils: int) -> None:
    others = [honest("b"), *forged(sybils)]
    assert round_state(others, ROUND) == Outcome.BEHIND, "what records alone decided"
    assert round_state(others, ROUND, counted={"b"}) == Outcome.TOGETHER
    assert round_state([honest("b", ready=False), *forged(sybils)], ROUND, counted={"b"}) == Outcome.WAITING
    # most proven peers past the round: behind, whatever the forged records say
    past = dataclasses.replace(honest("b"), exchanged_round=ROUND)
    assert round_state([past, honest("c", ready=False), *forged(sybils)], ROUND, counted={"b", "c"}) == Outcome.WAITING
    assert round_state([past, dataclasses.replace(past, peer_id="c"), *forged(sybils)], ROUND,
                       counted={"b", "c"}) == Outcome.BEHIND
    # a newcomer (vouched for, unproven) is waited for; forged ones that are not newcomers are not
    assert round_state([honest("b"), honest("joiner", ready=False), *forged(sybils)], ROUND,
                       counted={"b"}, newcomers={"joiner"}) == Outcome.WAITING


@pytest.mark.parametrize("sybils", [3, 10])
def test_a_joiner_takes_the_state_its_anchor_and_the_peers_it_proved_serve(sybils: int) -> None:
    records = {r.peer_id: r for r in [honest("a", proven=("b",)), honest("b", proven=("a",)), *forged(sybils)]}
    assert reference_state(records.values())[1] == "forged", "what records alone decided"  # type: ignore[index]
    who = counted(set(), {"a"}, records)  # a joiner: no proof of its own, `--peers` named a
    assert who == {"a", "b"}
    assert reference_state(proofs.deciding(records.values(), who)) == HONEST_SERVED
    assert counted({"b"}, {"a"}, records) == {"b"}, "our own proofs, once we have any, decide"
    # an anchor that is no node of the run (a DHT-only bootstrap peer) leaves every record counting,
    # as does one that has proved nobody yet (a fresh run before its first exchange)
    assert counted(set(), {"bootstrap"}, records) is None
    assert counted(set(), {"a"}, {"a": honest("a"), "b": honest("b")}) is None
    assert anchor_ids(["/ip4/1.2.3.4/tcp/5/p2p/QmA", "/dns/x/tcp/1"]) == {"QmA"}


def test_proofs_last_a_few_rounds_are_bounded_and_never_name_us() -> None:
    memory = Proofs("us")
    assert memory.prove(3, ["us", "a", "b"]) and memory.proven() == {"a", "b"}
    assert not memory.prove(4, ["us", "a", "b"]), "the same peers: nothing new to publish"
    memory.prove(4 + PROOF_ROUNDS, ["us", "a"])
    assert memory.proven() == {"a"}, "b has not contributed for PROOF_ROUNDS rounds"
    memory.prove(20, [f"p{i}" for i in range(3 * MAX_PROVEN)])
    assert len(memory.proven()) == MAX_PROVEN


def test_a_newcomer_is_waited_for_in_one_round_only() -> None:
    memory = Proofs("us")
    assert memory.newcomers(["joiner"], 5) == {"joiner"}
    assert memory.newcomers(["joiner"], 5) == {"joiner"}, "every look at the records within the round"
    assert memory.newcomers(["joiner"], 6) == set(), "a vouched record that never became ready"
    for index in range(3 * proofs.MAX_NEWCOMERS):
        memory.newcomers([f"n{index}"], 7)
    assert len(memory._waited) <= proofs.MAX_NEWCOMERS


@pytest.mark.parametrize("sybils", [3, 10])
def test_the_barrier_returns_as_soon_as_the_proven_peer_is_ready(monkeypatch, sybils: int) -> None:  # type: ignore[no-untyped-def]
    presence = presence_seeing(monkeypatch, [honest("b"), *forged(sybils)])
    presence.prove(ROUND - 1, ["b"])
    never = threading.Event()
    assert presence.wait_for_round(ROUND, timeout=60, stop=never) == Outcome.TOGETHER
    assert not presence.ahead_of(ROUND) and not presence.all_past(ROUND)
    assert set(presence.deciding_peers()) == {"b"}
    assert presence._record.proven == ("b",), "our record tells joiners anchored on us whom we proved"


def test_the_barrier_waits_for_a_joiner_we_served_in_its_first_round_only(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    joiner = honest("joiner", ready=False)
    presence = presence_seeing(monkeypatch, [honest("b"), joiner, *forged(3)])
    presence.prove(ROUND - 1, ["b"])
    presence.vouch("joiner")
    never = threading.Event()
    assert presence.round_state(ROUND) == Outcome.WAITING, "the joiner we served is waited for"
    # the next round: the joiner, still not ready, is no newcomer any more and holds nobody up
    nxt = ROUND + 1
    monkeypatch.setattr(records, "fetch", lambda _dht, _run: ({r.peer_id: r for r in [
        dataclasses.replace(honest("b"), round=nxt, ready_round=nxt), dataclasses.replace(joiner, round=nxt),
        *forged(3)]}, {}))
    assert presence.wait_for_round(nxt, timeout=0, stop=never) == Outcome.TOGETHER


def test_a_newcomer_that_never_becomes_ready_holds_the_barrier_for_the_grace_only(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    presence = presence_seeing(monkeypatch, [honest("b"), honest("taker", ready=False)])
    presence.prove(ROUND - 1, ["b"])
    presence.vouch("taker")  # it downloaded our state under a fresh identity, and stays unready
    assert presence.wait_for_round(ROUND, timeout=1, stop=threading.Event()) == Outcome.TOGETHER


def test_trusted_partners_are_the_counted_peers_and_those_they_endorse() -> None:
    found = {r.peer_id: r for r in [honest("b", proven=("us", "c")), honest("c", proven=("b",)), *forged(3)]}
    assert proofs.trusted(set(), set(), found) is None, "before any proof every record counts"
    assert proofs.trusted({"b"}, set(), found) == {"b", "c", "us"}
    # forged records endorse each other, but none of them is counted: their endorsements count for nothing
    assert not proofs.trusted({"b"}, set(), found) & {"sybil0", "sybil1", "sybil2"}
    assert proofs.trusted(set(), {"b"}, found) == {"b", "c", "us"}, "a joiner's anchor endorses too"


@pytest.mark.parametrize("sybils", [3, 10])
def test_a_forged_record_drawn_with_us_costs_the_stranger_grace_and_no_matchmaking(monkeypatch, sybils: int) -> None:  # type: ignore[no-untyped-def]
    presence = presence_seeing(monkeypatch, [honest("b"), *forged(sybils)])
    presence.prove(ROUND - 1, ["b"])
    never = threading.Event()
    # drawn with a forged record only: it claims the run went on (exchanged 10^6) and never gets
    # ready; neither makes us behind nor holds us for the round timeout (here 60 s)
    assert presence.round_state(ROUND, among=["sybil0"]) == Outcome.WAITING, "waited for a moment"
    monkeypatch.setattr(presence_module, "STRANGER_GRACE", 0.2 / 60)
    assert presence.wait_for_round(ROUND, timeout=60, stop=never, among=["sybil0"]) == Outcome.TOGETHER, \
        "a timeout had we waited for it"
    assert presence.drawn_partners(ROUND, ["sybil0"]) == [], "not matchmade for"
    # drawn with the proven peer and a forged record: the proven one alone is kept
    assert presence.wait_for_round(ROUND, timeout=60, stop=never, among=["b", "sybil1"]) == Outcome.TOGETHER
    assert presence.drawn_partners(ROUND, ["b", "sybil1"]) == ["b"]


def test_a_partner_a_proven_peer_endorses_is_waited_for_until_the_timeout(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    presence = presence_seeing(monkeypatch, [honest("b", proven=("c",)), honest("c", ready=False),
                                             honest("d", ready=False), *forged(3)])
    presence.prove(ROUND - 1, ["b"])
    never = threading.Event()
    monkeypatch.setattr(presence_module, "STRANGER_GRACE", 0.0)
    assert presence.wait_for_round(ROUND, timeout=0.5, stop=never, among=["c"]) == Outcome.TIMEOUT
    assert presence.drawn_partners(ROUND, ["c"]) == ["c"], "still matchmade for"
    # d, an honest node nobody we proved has met, is a stranger: a late one misses the round with us
    assert presence.wait_for_round(ROUND, timeout=0.5, stop=never, among=["d"]) == Outcome.TOGETHER
    assert presence.drawn_partners(ROUND, ["d"]) == []


def test_before_any_proof_a_drawn_group_counts_whole(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    presence = presence_seeing(monkeypatch, [honest("b", ready=False), *forged(3)])
    assert presence.round_state(ROUND, among=["b"]) == Outcome.WAITING
    assert presence.round_state(ROUND, among=["sybil0"]) == Outcome.BEHIND, "what records alone decide (§9)"
    assert presence.drawn_partners(ROUND, ["b", "sybil0"]) == ["b", "sybil0"]


@pytest.mark.parametrize("sybils", [3, 10])
def test_min_peers_counts_proven_peers_once_any_exist(monkeypatch, sybils: int) -> None:  # type: ignore[no-untyped-def]
    presence = presence_seeing(monkeypatch, [honest("a", proven=("b",)), honest("b", proven=("a",)), *forged(sybils)])
    assert presence.present() == 3 + sybils, "before any proof every record counts (§9)"
    presence.anchors = frozenset({"a"})  # a joiner whose --peers names a node of the run
    assert presence.present() == 3
    assert not presence.wait_for_peers(4, stop=stopped())
    assert presence.wait_for_peers(3, stop=stopped())
    presence.anchors = frozenset()
    presence.prove(ROUND, ["b"])
    assert presence.present() == 2, "ourselves and b: a, endorsed by b, is no proof of ours"


def stopped() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def test_a_drawn_partner_already_training_a_later_round_is_not_matchmade_for(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ahead = dataclasses.replace(honest("b"), round=ROUND + 3, ready_round=ROUND + 2)
    presence = presence_seeing(monkeypatch, [ahead, honest("c")])
    presence.prove(ROUND - 1, ["b", "c"])
    presence.compatible_peers(refresh=True)  # as the barrier just did
    assert presence.drawn_partners(ROUND, ["b", "c"]) == ["c"], "b averaged this round without us"
    presence_before_proofs = presence_seeing(monkeypatch, [ahead])
    presence_before_proofs.compatible_peers(refresh=True)
    assert presence_before_proofs.drawn_partners(ROUND, ["b"]) == []


@pytest.mark.parametrize("sybils", [3, 10])
def test_in_a_fresh_run_a_joiner_takes_the_state_of_its_anchor_only(monkeypatch, sybils: int) -> None:  # type: ignore[no-untyped-def]
    # nobody proved anyone yet; k forged records announce one state of their own: two or more
    # agreeing announcers, which is what a fresh run's records alone accept
    records_ = {r.peer_id: r for r in [honest("a"), *forged(sybils)]}
    assert reference_state(records_.values())[1] == "forged", "what records alone decided"  # type: ignore[index]
    assert counted(set(), {"a"}, records_) is None, "the barrier and --min-peers still count every record"
    assert proofs.state_sources(set(), {"a"}, records_) == {"a"}
    assert reference_state(proofs.deciding(records_.values(), {"a"})) == HONEST_SERVED
    # an anchor that proved peers: it and those peers, as for every decision
    records_["a"] = honest("a", proven=("b",))
    assert proofs.state_sources(set(), {"a"}, records_) == {"a", "b"}
    # an anchor that is no node of the run (a DHT-only bootstrap peer), or a client that serves
    # nothing: every record, the known limit of §9
    assert proofs.state_sources(set(), {"bootstrap"}, records_) is None
    records_["a"] = dataclasses.replace(honest("a"), client=True)
    assert proofs.state_sources(set(), {"a"}, records_) is None
    presence = presence_seeing(monkeypatch, [honest("a"), *forged(sybils)])
    presence.anchors = frozenset({"a"})
    assert set(presence.state_peers()) == {"a"}


def test_a_step_that_found_no_group_is_no_group_that_failed() -> None:
    from hivemind.averaging.allreduce import AllreduceException

    from diloco_node.swarm.matchmaking import formed_then_failed

    # hivemind's words when matchmaking found nobody (averager.py): no leader counts us in
    assert not formed_then_failed(AllreduceException("Averaging step failed: could not find a group"))
    assert formed_then_failed(AllreduceException("peer X sent an invalid message"))
    assert not formed_then_failed(TimeoutError())


def test_after_a_failed_matchmaking_a_copied_record_does_not_hold_us(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from diloco_node.swarm.matchmaking import Matchmaker

    done = dataclasses.replace(honest("b"), exchanged_round=ROUND)
    copy = dataclasses.replace(honest("b"), peer_id="copy")  # b's record as it was: may still fetch
    presence = presence_seeing(monkeypatch, [done, copy])
    presence.compatible_peers(refresh=True)
    seam = SimpleNamespace(presence=presence, peer_id="us")
    assert Matchmaker._anyone_may_still_fetch(seam, ROUND), "before any proof every record counts"  # type: ignore[arg-type]
    presence.prove(ROUND - 1, ["b"])
    assert not Matchmaker._anyone_may_still_fetch(seam, ROUND), "b, the one that decides, is done"  # type: ignore[arg-type]


@pytest.mark.parametrize("sybils", [3, 10])
def test_nodes_forged_records_left_partnerless_matchmake_again_under_a_spare_key(monkeypatch, sybils: int) -> None:  # type: ignore[no-untyped-def]
    from diloco_node.swarm.groups import SPARE_KEY
    from diloco_node.swarm.matchmaking import round_bits

    presence = presence_seeing(monkeypatch, [honest("b"), honest("c", ready=False), *forged(sybils)])
    presence.prove(ROUND - 1, ["b"])
    presence.compatible_peers(refresh=True)
    # we and b were each drawn with a forged record only: b will drop its partner as we drop ours
    groups = [["us", "sybil0"], ["b", "sybil1"], *[[f"sybil{i}"] for i in range(2, sybils)]]
    assert presence.drawn_partners(ROUND, ["sybil0"]) == []
    assert presence.spare_partners(ROUND, groups) == ["b"]
    # b drawn with an honest partner it keeps (ready, or trusted by us): b averages there, no spare
    ready_stranger = [honest("b"), honest("d"), *forged(sybils)]
    presence = presence_seeing(monkeypatch, ready_stranger)
    presence.prove(ROUND - 1, ["b"])
    presence.compatible_peers(refresh=True)
    assert presence.spare_partners(ROUND, [["us", "sybil0"], ["b", "d"]]) == []
    assert presence.spare_partners(ROUND, [["us", "sybil0"], ["b", "sybil1"]]) == ["b"]
    # forged records are never spare partners, however they are drawn; before any proof, nobody is
    assert presence.spare_partners(ROUND, [["us", "sybil0"], ["sybil1", "sybil2"]]) == []
    unproven = presence_seeing(monkeypatch, [honest("b"), *forged(sybils)])
    unproven.compatible_peers(refresh=True)
    assert unproven.spare_partners(ROUND, groups) == []
    # the spare key is one the draw never hands a group; without a draw (DiLoCo) the round alone
    drawn = round_bits(ROUND, "us", groups)
    assert round_bits(ROUND, "us", groups, spare=True) == drawn[:-8] + SPARE_KEY != round_bits(ROUND, "b", groups)
    assert round_bits(ROUND, "us", None) == drawn[:-8]
    # a trusted peer drawn alone (the odd one out) looks for spare partners too, so it is one
    assert presence.spare_partners(ROUND, [["us", "sybil0"], ["b"], ["sybil1", "sybil2"]]) == ["b"]
    # and the odd one out, we: the trusted peer drawn with forged records only, once they had their grace
    stop = threading.Event()
    started = time.monotonic()
    assert presence.odd_spare_partners(ROUND, [["us"], ["b", "sybil0"], ["sybil1", "sybil2"]], 1.0, stop) == ["b"]
    assert time.monotonic() - started >= presence_module.STRANGER_GRACE * 1.0
    # nobody partnerless (b drawn with d, which we trust): alone at once, no wait
    started = time.monotonic()
    assert presence.odd_spare_partners(ROUND, [["us"], ["b", "d"]], 60.0, stop) == []
    assert time.monotonic() - started < 1.0


def test_newcomers_share_one_grace_while_a_late_one_is_unproven() -> None:
    memory = Proofs("us")
    assert memory.newcomers(["taker"], 5) == {"taker"}
    memory.late_newcomers(5, ["taker"])  # it took our state and never got ready
    # fresh identities taking our state after it buy no grace each (#28 (b)) ...
    assert memory.newcomers(["taker2"], 6) == set()
    assert memory.newcomers(["taker2"], 5 + PROOF_ROUNDS - 1) == set()
    # ... until PROOF_ROUNDS rounds have passed; a withheld one was never waited for, so it may be then
    assert memory.newcomers(["taker2"], 5 + PROOF_ROUNDS) == {"taker2"}
    memory.late_newcomers(20, ["taker3"])
    memory.prove(21, ["taker3"])  # a slow genuine joiner, proven since: the next one is waited for
    assert memory.newcomers(["joiner"], 22) == {"joiner"}
    assert memory.granted(22) == {"joiner"}


def test_matchmakings_with_only_unproven_peers_about_are_spaced_out_until_someone_shows_up() -> None:
    memory = Proofs("us")
    assert memory.may_matchmake_strangers(3)
    assert memory.strangers_missed(3) == proofs.STRANGER_SKIPS[0]
    assert [memory.may_matchmake_strangers(r) for r in range(4, 8)] == [False, False, False, True]
    assert memory.strangers_missed(7) == PROOF_ROUNDS - 1
    assert not memory.may_matchmake_strangers(14) and memory.may_matchmake_strangers(15)
    assert memory.strangers_missed(15) == PROOF_ROUNDS - 1, "at most one try in PROOF_ROUNDS rounds"
    memory.prove(16, ["joiner"])
    assert memory.may_matchmake_strangers(17)
    assert memory.strangers_missed(17) == proofs.STRANGER_SKIPS[0], "counted afresh"


def test_before_any_proof_only_anchors_and_newcomers_are_worth_a_matchmaking(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    copy = honest("copy")  # a record copying ours: ready whenever we are, never matchmaking
    presence = presence_seeing(monkeypatch, [copy])
    presence.compatible_peers(refresh=True)
    assert presence.strangers_only(ROUND), "the run's first node: nobody about is proven or new"
    anchored = presence_seeing(monkeypatch, [copy, honest("a")])
    anchored.anchors = frozenset({"a"})
    anchored.compatible_peers(refresh=True)
    assert not anchored.strangers_only(ROUND), "the node our --peers names"
    # a joiner that took our state is worth one in its first round (the barrier granted it)
    joining = presence_seeing(monkeypatch, [copy, honest("joiner", ready=False)])
    joining.vouch("joiner")
    assert joining.round_state(ROUND) == Outcome.WAITING, "every record is waited for before any proof"
    assert not joining.strangers_only(ROUND)
    assert joining.strangers_only(ROUND + 1), "once only"


def test_a_late_newcomer_leaves_the_next_ones_unwaited(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    presence = presence_seeing(monkeypatch, [honest("b"), honest("taker", ready=False), honest("taker2", ready=False)])
    presence.prove(ROUND - 1, ["b"])
    presence.vouch("taker")
    assert presence.wait_for_round(ROUND, timeout=1, stop=threading.Event()) == Outcome.TOGETHER
    presence.vouch("taker2")  # a fresh identity takes our state too: no grace of its own
    nxt = ROUND + 1
    monkeypatch.setattr(records, "fetch", lambda _dht, _run: ({r.peer_id: r for r in [
        dataclasses.replace(honest("b"), round=nxt, ready_round=nxt),
        *(dataclasses.replace(honest(p, ready=False), round=nxt, ready_round=ROUND) for p in ("taker", "taker2"))]},
        {}))
    assert presence.round_state(nxt) == Outcome.TOGETHER


def test_with_only_strangers_about_a_matchmaking_that_found_nobody_looks_for_no_group() -> None:
    from types import SimpleNamespace

    from diloco_node.swarm.matchmaking import MISSED_GROUP_GRACE, Matchmaker

    looked: list[float] = []
    seam = SimpleNamespace(peer_id="us", _form_group=lambda _round, _spare: (["us"], False),
                           _missed_group=lambda _round, grace: looked.append(grace) or ([], {}))
    assert Matchmaker._find_group(seam, ROUND, True, False, True) == ([], {})  # type: ignore[arg-type]
    assert looked == [], "a copy claiming it may still fetch holds us no grace"
    Matchmaker._find_group(seam, ROUND, True, False, False)  # type: ignore[arg-type]
    assert looked == [MISSED_GROUP_GRACE], "a counted peer or a newcomer about: it may have counted us in"


@pytest.mark.parametrize("sybils", [3, 10])
def test_a_joiner_with_no_anchor_refuses_a_state_the_records_dispute(monkeypatch, sybils: int) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from diloco_node.swarm import facade
    from diloco_node.swarm.facade import Swarm
    from diloco_node.swarm.statesync import DisputedState, await_one_state

    monkeypatch.setattr(facade, "AGREEMENT_WAIT_SECONDS", 0.0)
    monkeypatch.setattr(facade, "download_run_state", lambda *_args: "downloaded")
    never = threading.Event()
    # bootstrapped from a DHT-only peer: no anchor, no proof; the forged records announce their own state
    presence = presence_seeing(monkeypatch, [honest("a"), *forged(sybils)])
    seam = SimpleNamespace(_presence=presence, settings=SimpleNamespace(run_id="run", round_timeout=1.0), _state=None,
                           _streams=SimpleNamespace(run=None))
    assert presence.unanchored()
    with pytest.raises(DisputedState, match="name one of its nodes with --peers"):
        Swarm.download_state(seam, 1, never, check_digest=True, held=(0, "seed"))  # type: ignore[arg-type]
    assert Swarm.download_state(seam, 1, never, check_digest=True) is None, "a re-sync keeps its φ"
    assert Swarm.download_state(seam, 1, never, check_digest=False) == "downloaded", "NoLoCo: φ differs by design"
    # records that all name one state (a copy of an honest record) leave the digest check to decide
    copies = presence_seeing(monkeypatch, [honest("a"), dataclasses.replace(honest("a"), peer_id="copy")])
    seam._presence = copies
    assert Swarm.download_state(seam, 1, never, check_digest=True, held=(0, "seed")) == "downloaded"
    # a node of the run named with --peers: its state is the one taken (state_sources), no dispute
    presence.anchors = frozenset({"a"})
    seam._presence = presence
    assert not presence.unanchored()
    assert Swarm.download_state(seam, 1, never, check_digest=True, held=(0, "seed")) == "downloaded"
    # honest nodes a step apart agree again within the wait
    views = iter([[honest("a"), dataclasses.replace(honest("b"), served_round=ROUND + 1, served_digest="next")]])
    assert await_one_state(lambda: {r.peer_id: r for r in next(views, [honest("a"), honest("b")])}, 5, never) == 1


def test_a_resync_with_no_anchor_waits_up_to_a_round_for_the_records_to_agree(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A node that fell behind long enough to hold no proof re-syncs unanchored: one snapshot of honest
    nodes a step apart must not refuse it round after round, so it waits too (a round at most)."""
    from types import SimpleNamespace

    from diloco_node.swarm import facade
    from diloco_node.swarm.facade import Swarm

    waits: list[float] = []
    monkeypatch.setattr(facade, "await_one_state", lambda _others, wait, _stop: waits.append(wait) or 1)
    monkeypatch.setattr(facade, "download_run_state", lambda *_args: "downloaded")
    presence = presence_seeing(monkeypatch, [honest("a"), honest("b")])
    seam = SimpleNamespace(_presence=presence, settings=SimpleNamespace(run_id="run", round_timeout=7.0), _state=None,
                           _streams=SimpleNamespace(run=None))
    assert presence.unanchored()
    assert Swarm.download_state(seam, 1, threading.Event(), check_digest=True) == "downloaded"  # type: ignore[arg-type]
    assert Swarm.download_state(seam, 1, threading.Event(), check_digest=True, held=(0, "seed")) == "downloaded"  # type: ignore[arg-type]
    assert waits == [7.0, facade.AGREEMENT_WAIT_SECONDS]  # a re-sync: a round; a fresh joiner: the full wait


def test_a_joiner_we_served_fetches_our_payload_before_its_record_reaches_us(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A joiner completes the rounds its server had in flight (outer/overlapped.py, inherit). When
    our matchmaking failed, our group is unknown for a while and only verified nodes may fetch; a
    joiner's first record may not have reached us yet, and refusing it split φ between us for good
    (it lost a round we applied alone). Having served it our state vouches for it."""
    from types import SimpleNamespace

    from diloco_node.swarm.facade import Swarm

    presence = presence_seeing(monkeypatch, [honest("a")])
    seam = SimpleNamespace(_presence=presence, gate=SimpleNamespace(refusal=lambda _peer, _token: None))
    assert Swarm._may_fetch_payload(seam, "a", 3, "", None) is None  # type: ignore[arg-type]
    assert Swarm._may_fetch_payload(seam, "joiner", 3, "", None) == "not a verified node of this run"  # type: ignore[arg-type]
    presence.vouch("joiner")
    assert Swarm._may_fetch_payload(seam, "joiner", 3, "", None) is None  # type: ignore[arg-type]
    assert Swarm._may_fetch_payload(seam, "stranger", 3, "", None) == "not a verified node of this run"  # type: ignore[arg-type]


def test_who_may_fetch_a_rounds_payload_is_one_rule_asked_lazily() -> None:
    """trust/view.fetch_refusal: before the group is known any verified node, after it its members
    and joiners a member vouched for; each question (a DHT read) asked only when the answer needs it."""
    from diloco_node.trust.view import fetch_refusal

    asked: list[str] = []

    def answer(name: str, value: bool):  # type: ignore[no-untyped-def]
        return lambda: asked.append(name) or value

    assert fetch_refusal("a", None, answer("verified", True), answer("vouched", False)) is None
    assert fetch_refusal("x", None, answer("verified", False), answer("vouched", True)) == \
        "not a verified node of this run"
    assert asked == ["verified", "verified"]
    asked.clear()
    assert fetch_refusal("a", ("a", "b"), answer("verified", False), answer("vouched", False)) is None
    assert asked == []  # a member: nothing to read
    assert fetch_refusal("j", ("a", "b"), answer("verified", True), answer("vouched", True)) is None
    assert fetch_refusal("x", ("a", "b"), answer("verified", True), answer("vouched", False)) == \
        "not a member of the round's group"
    assert asked == ["vouched", "vouched"]


@pytest.mark.parametrize("alone", [False, True])
def test_the_barrier_waits_for_the_record_of_a_joiner_we_just_served(monkeypatch, alone: bool) -> None:  # type: ignore[no-untyped-def]
    """A joiner publishes its record only once our state is installed; a barrier that went on
    without it (a record copying ours is always ready) left both of a blocking pair averaging that
    round alone: φ split (seen in CI). The barrier waits for the record, the newcomer's grace at most.
    `alone`: no other record in sight, where the barrier said "alone" at once (tried as a user: a
    node alone for 11 rounds served a joiner 1.5 s before its inner phase ended, exchanged that round
    alone, and the joiner found it behind, re-synced and went alone again)."""
    others = [] if alone else [honest("copy")]
    seen = list(others)
    presence = presence_seeing(monkeypatch, [])
    monkeypatch.setattr(records, "fetch", lambda _dht, _run: ({r.peer_id: r for r in seen}, {}))
    presence.announce(ROUND, False, "d", HONEST_SERVED)
    presence.vouch("joiner", ROUND)
    threading.Timer(0.6, lambda: seen.append(honest("joiner"))).start()
    started = time.monotonic()
    assert presence.wait_for_round(ROUND, timeout=60, stop=threading.Event()) == Outcome.TOGETHER
    assert time.monotonic() - started >= 0.6
    assert not presence.strangers_only(ROUND), "the joiner is worth a matchmaking window"
    # one that never shows up costs the grace (half the timeout here), once
    presence.vouch("taker", ROUND + 1)
    presence.announce(ROUND + 1, False, "d", HONEST_SERVED)
    seen[:] = [dataclasses.replace(r, round=ROUND + 1, ready_round=ROUND + 1) for r in others]
    started = time.monotonic()
    assert presence.wait_for_round(ROUND + 1, timeout=2, stop=threading.Event()) == \
        (Outcome.ALONE if alone else Outcome.TOGETHER)
    assert 1.0 <= time.monotonic() - started < 3.0


@pytest.mark.parametrize("sybils", [3, 10])
def test_whom_a_round_matchmakes_with_is_one_typed_decision(sybils: int) -> None:
    """RunView.partners (trust/view.py): the gather acts on it. NoLoCo keeps the trusted drawn
    partners and the ready ones; with all dropped, a trusted peer left partnerless is met under
    the spare key; DiLoCo with strangers only matchmakes until such a matchmaking found nobody."""
    from diloco_node.trust.view import Partners, RunView

    records_ = {r.peer_id: r for r in [honest("us"), honest("b"), honest("c"), *forged(sybils)]}
    memory = Proofs("us")
    memory.prove(ROUND - 1, ["b", "c"])
    view = RunView("us", memory.proven(), frozenset(), records_)
    groups = [["us", "sybil0"], ["b", "sybil1"], ["c"]]
    asked: list[int] = []

    def drawn() -> list[list[str]]:
        asked.append(1)
        return groups

    kept = view.partners(ROUND, Outcome.TOGETHER, ["b", "sybil2"], False, drawn, memory)
    assert kept == Partners(Outcome.TOGETHER, ("b",)) and not asked, "no draw read when a partner is kept"
    spare = view.partners(ROUND, Outcome.TIMEOUT, ["sybil0"], False, drawn, memory)
    assert spare == Partners(Outcome.TIMEOUT, ("b", "c"), spare=True, respared=True)
    assert view.partners(ROUND, Outcome.BEHIND, ["sybil0"], False, drawn, memory).outcome == Outcome.BEHIND
    assert view.partners(ROUND, Outcome.TOGETHER, None, False, drawn, memory) == Partners(Outcome.TOGETHER, None)

    stranger = Proofs("us")  # proved nobody, no anchor: every record is a stranger
    alone = RunView("us", stranger.proven(), frozenset(), records_)
    assert alone.partners(ROUND, Outcome.TOGETHER, None, False, drawn, stranger) == \
        Partners(Outcome.TOGETHER, None, unproven=True, strangers=True)
    stranger.strangers_missed(ROUND)
    assert alone.partners(ROUND + 1, Outcome.TOGETHER, None, False, drawn, stranger) == \
        Partners(Outcome.ALONE, None, unproven=True, strangers=True, skipped=True)


def test_only_proven_peers_say_that_a_round_s_inner_phase_is_over(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under --round-seconds a node trains nothing in a round whose inner phase the run has ended
    (daemon/node.py): forged records claiming every round ready must not make it skip its work."""
    ahead = [dataclasses.replace(record, ready_round=10**6) for record in forged(10)]
    presence = presence_seeing(monkeypatch, [honest("b", ready=False), *ahead])
    presence.prove(ROUND - 1, ["b"])
    assert not presence.past_inner_phase(ROUND), "the proven peer is still in its inner phase"
    presence = presence_seeing(monkeypatch, [honest("b", ready=True), *ahead])
    presence.prove(ROUND - 1, ["b"])
    assert presence.past_inner_phase(ROUND) and not presence.past_inner_phase(ROUND + 1)



def test_the_server_of_a_joiner_says_it_is_ready_only_once_the_joiner_is_in_view(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The run's other nodes learn of a joiner from its record only, which comes after the state is
    installed; the server waits for that record, they did not, matchmade without it, and the joiner
    and a third node averaged while the server was left alone (seen in CI: a round of three split).
    Held back, the server's ready keeps their barrier (it is a counted peer) until the joiner is in
    view; its record says ready once the joiner's shows the round, or once the wait gives up."""
    seen = [honest("third")]
    stored: list[NodeRecord] = []
    presence = presence_seeing(monkeypatch, [])
    monkeypatch.setattr(records, "fetch", lambda _dht, _run: ({r.peer_id: r for r in seen}, {}))
    monkeypatch.setattr(records, "publish", lambda _dht, _run, record, _signer: stored.append(record))
    presence.compatible_peers(refresh=True)
    presence.vouch("joiner", ROUND)
    presence.announce(ROUND, True, "d", HONEST_SERVED)  # our inner phase is over, the joiner not in view
    assert stored[-1].ready_round < ROUND, "ready held back while the joiner has no record"
    joined = threading.Timer(0.6, lambda: seen.append(honest("joiner", ready=False)))
    joined.start()
    readied = threading.Timer(1.5, lambda: seen.__setitem__(-1, honest("joiner")))
    readied.start()
    ready_at: list[float] = []
    monkeypatch.setattr(records, "publish", lambda _dht, _run, record, _signer: (
        stored.append(record), ready_at.append(time.monotonic()) if record.ready_round == ROUND else None))
    started = time.monotonic()
    assert presence.wait_for_round(ROUND, timeout=60, stop=threading.Event()) == Outcome.TOGETHER
    ended = time.monotonic()
    assert stored[-1].ready_round == ROUND
    # ready as soon as the joiner's record showed the round, not only once it was ready too: the
    # joiner's own barrier waits for ours (we are its anchor)
    assert ready_at and 0.6 <= ready_at[0] - started < 1.5 <= ended - started, (ready_at, started, ended)
    # a barrier that ends any other way (a stop) leaves no held ready behind
    presence.vouch("another", ROUND + 1)
    seen[:] = [dataclasses.replace(honest("third"), round=ROUND + 1, ready_round=ROUND + 1)]
    presence.compatible_peers(refresh=True)
    presence.announce(ROUND + 1, True, "d", HONEST_SERVED)
    assert stored[-1].ready_round == ROUND
    stop = threading.Event()
    stop.set()
    assert presence.wait_for_round(ROUND + 1, timeout=60, stop=stop) == Outcome.STOPPED
    assert stored[-1].ready_round == ROUND + 1
    # a joiner that never shows up: ready again once the wait for its record gives up (half the timeout)
    presence.vouch("taker", ROUND + 2)
    seen[:] = [dataclasses.replace(honest("third"), round=ROUND + 2, ready_round=ROUND + 2)]
    presence.compatible_peers(refresh=True)
    presence.announce(ROUND + 2, True, "d", HONEST_SERVED)
    assert stored[-1].ready_round == ROUND + 1
    started = time.monotonic()
    assert presence.wait_for_round(ROUND + 2, timeout=2, stop=threading.Event()) == Outcome.TOGETHER
    assert stored[-1].ready_round == ROUND + 2 and 1.0 <= time.monotonic() - started < 3.0


def test_a_joiner_is_in_no_round_before_its_first(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A joiner's record enters at its first round r. It said it was ready for r − 1, which it never
    trains: its server counted it there, matchmade for it in vain (13 s + 5 s), spent its one newcomer
    grace in that round, and went on alone in r (the joiner behind, re-synced; seen under eager at
    0.5 s rounds). Its record now says the last inner phase it finished (none), and a record past a
    round that never trained it is not waited for in it."""
    entering = NodeRecord("joiner", "fp", ROUND + 1, -1, "d")
    assert round_state([entering], ROUND) == Outcome.ALONE  # not in it (before any proof too)
    assert round_state([entering, honest("a", ready=False)], ROUND) == Outcome.WAITING
    assert round_state([entering], ROUND + 1) == Outcome.WAITING  # its first round: waited for
    presence = presence_seeing(monkeypatch, [entering])
    presence.vouch("joiner", ROUND + 1)  # it took the state of our round ROUND + 1
    started = time.monotonic()
    assert presence.wait_for_round(ROUND, timeout=60, stop=threading.Event()) == Outcome.ALONE
    assert time.monotonic() - started < 1.0 and not presence.proofs.granted(ROUND)
    # its first round: waited for as a newcomer, and together once it is ready
    ready = dataclasses.replace(entering, ready_round=ROUND + 1)
    monkeypatch.setattr(records, "fetch", lambda _dht, _run: ({"joiner": ready}, {}))
    assert presence.wait_for_round(ROUND + 1, timeout=60, stop=threading.Event()) == Outcome.TOGETHER
    assert presence.proofs.granted(ROUND + 1) == {"joiner"}


def test_our_record_says_the_last_inner_phase_we_finished(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Entering at a round, or re-synced past rounds, a node says it was ready for none of them."""
    stored: list[NodeRecord] = []
    presence = presence_seeing(monkeypatch, [])
    monkeypatch.setattr(records, "publish", lambda _dht, _run, record, _signer: stored.append(record))
    presence.announce(ROUND, False, "d", HONEST_SERVED)  # as `enter` does, after the state download
    assert (stored[-1].round, stored[-1].ready_round) == (ROUND, -1)
    presence.announce(ROUND, True, "d", HONEST_SERVED)
    presence.announce(ROUND + 1, False, "d", HONEST_SERVED)
    assert (stored[-1].round, stored[-1].ready_round) == (ROUND + 1, ROUND)
    presence.announce(ROUND + 6, False, "d", HONEST_SERVED)  # a re-sync five rounds on
    assert (stored[-1].round, stored[-1].ready_round) == (ROUND + 6, ROUND)
