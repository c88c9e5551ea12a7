"""Presence records: parsing what peers wrote, choosing the canonical φ when nodes disagree, and
where the peers we average with stand on a round."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hivemind.utils import ValueWithExpiration, get_dht_time

from diloco_node.round import Outcome
from diloco_node.swarm import identity, records, statesync
from diloco_node.swarm.groups import random_groups
from diloco_node.swarm.matchmaking import Matchmaker
from diloco_node.swarm.presence import Presence
from diloco_node.swarm.records import config_difference
from diloco_node.swarm.statesync import agreement
from diloco_node.trust import state as trust_state
from diloco_node.trust.admission import Claims, Gate, sign
from diloco_node.trust.records import NodeRecord, canonical_digest, reference_state, tie_order
from diloco_node.trust.state import servers_in_order
from diloco_node.trust.view import round_state


def record(peer: str, round_: int, digest: str) -> NodeRecord:
    return NodeRecord(peer, "fp", round_, round_ - 1, digest)


def test_round_trip_through_the_wire() -> None:
    original = NodeRecord("peer", "fp", 3, 2, "abc", {"label": "eu", "rounds": 3})
    parsed = NodeRecord.from_wire(original.to_wire())
    assert parsed is not None
    assert (parsed.peer_id, parsed.round, parsed.digest) == ("peer", 3, "abc")
    assert parsed.stats["label"] == "eu" and parsed.stats["rounds"] == 3 and parsed.stats["bytes_sent"] == 0


def test_malformed_or_left_records_are_ignored() -> None:
    good = NodeRecord("p", "fp", 1, 0, "d").to_wire()
    assert NodeRecord.from_wire(good) is not None
    assert NodeRecord.from_wire("nonsense") is None
    assert NodeRecord.from_wire({**good, "round": "1"}) is None
    assert NodeRecord.from_wire({**good, "digest": None}) is None
    assert NodeRecord.from_wire({k: v for k, v in good.items() if k != "digest"}) is None
    assert NodeRecord.from_wire({**good, "left": True}) is None
    # a departed node's record is read only when asked for, and a live one is not mistaken for it
    assert NodeRecord.from_wire({**good, "left": True}, left=True) is not None
    assert NodeRecord.from_wire(good, left=True) is None
    assert NodeRecord.from_wire({**good, "stats": {"rounds": -1}}) is None
    assert NodeRecord.from_wire({**good, "stats": {"label": "x" * 65}}) is None
    assert NodeRecord.from_wire({**good, "stats": {"bytes_sent": 1.5}}) is None
    assert NodeRecord.from_wire({**good, "stats": {"secret": "x"}}) is None
    # a peer's caps and link rates (the swarm table's egress / cap): non-negative bytes/s, or unmeasured
    linked = {"upload_limit_bytes_per_second": 250_000.0, "egress_bytes_per_second": None}
    assert NodeRecord.from_wire({**good, "stats": linked}) is not None
    assert NodeRecord.from_wire({**good, "stats": {"egress_bytes_per_second": -1.0}}) is None
    assert NodeRecord.from_wire({**good, "stats": {"upload_limit_bytes_per_second": 1e300}}) is None


def test_majority_digest_is_canonical() -> None:
    nodes = [record("a", 5, "x"), record("b", 5, "y"), record("c", 5, "y")]
    assert canonical_digest(nodes, 5) == "y"


def test_a_tie_goes_to_one_side_by_the_rounds_draw_which_no_key_wins_every_time() -> None:
    """docs/architecture.md §9: the smaller peer id won a tie, and an attacker picks its id by
    generating keys (a digest, by grinding its φ). Left to nobody, a pair that split stayed split
    for good (and joiners found no state two servers agree on): a tie goes to the holder first in
    the round's draw, which every node draws alike and in which each key comes first about half
    the time, whatever key or digest it chose."""
    honest = "QmHonest"
    for attacker in ("0" * 46, "z" * 46, "QmAttacker"):
        for fake in ("0" * 64, "f" * 64):
            won = 0
            for round_ in range(200):
                nodes = [record(honest, round_, "ab" * 32), record(attacker, round_, fake)]
                verdict = canonical_digest(nodes, round_)
                assert verdict == canonical_digest(list(reversed(nodes)), round_)  # every node alike
                won += verdict == fake
                # a majority still decides, whichever ids hold it
                assert canonical_digest([*nodes, record("QmOther", round_, "ab" * 32)], round_) == "ab" * 32
                assert canonical_digest([*nodes, record("QmOther", round_, fake)], round_) == fake
            assert 60 <= won <= 140, (attacker, won)
    # the best of a thousand generated keys still comes first in about half of the rounds
    best = max(sum(tie_order(r, f"key{k}") < tie_order(r, honest) for r in range(100)) for k in range(1000))
    assert best < 75


def test_exactly_one_member_of_a_split_pair_re_syncs_from_the_other(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for round_ in range(5, 25):
        verdicts = []
        for us, them in (("a", "b"), ("b", "a")):
            presence = Presence(SimpleNamespace(), us, "run", "fp", {}, SimpleNamespace(), None, Gate("run"))  # type: ignore[arg-type]
            theirs = dataclasses.replace(record(them, round_, f"{them}'s"), served_round=round_,
                                         served_digest=f"{them}'s")
            offline(monkeypatch, [theirs])
            presence.announce(round_, False, f"{us}'s", (round_, f"{us}'s"))
            presence.compatible_peers(refresh=True)
            diverged = presence.diverged(round_, f"{us}'s", among=[us, them])
            assert presence.served_diverged([us, them]) == diverged
            verdicts.append(diverged)
        assert sorted(verdicts) == [False, True], round_


def test_only_nodes_at_that_round_count() -> None:
    nodes = [record("a", 5, "x"), record("b", 6, "y"), record("c", 6, "y")]
    assert canonical_digest(nodes, 5) == "x"
    assert canonical_digest(nodes, 7) is None


def test_config_difference_names_the_keys() -> None:
    assert config_difference({"model": "tiny", "lr": 1}, {"model": "small", "lr": 1}) == "--model small (ours: tiny)"


def test_a_refusal_for_many_keys_is_one_short_line_of_the_options_a_user_types() -> None:
    """The issue's joiner: a default node against a Llama run with a tokenizer, data and another codec,
    25 keys apart: one short line, --model once, the run's value then ours, no long hashes."""
    import re

    ours = {"protocol": 5, "model": "tiny", "n_layer": 2, "d_model": 128, "n_head": 4, "vocab_size": 256,
            "max_seq_len": 256, "algorithm": "diloco", "sync": "blocking", "outer_lr": 0.7, "outer_momentum": 0.9,
            "compression": "none", "aggregator": "mean", "max_tokens_per_round": None}
    entries = {f"model.entry_{i}": i for i in range(16)}
    theirs = {"protocol": 5, "model": "hf:llama", "model.hidden_size": 128, **entries,
              "tokenizer": "026b" + "e" * 60, "eval_data": "9f3c" * 4, "algorithm": "diloco", "sync": "eager",
              "outer_lr": 0.5, "outer_momentum": 0.9, "eager_proxy": "delta", "compression": "int8",
              "quant_block": 64, "aggregator": "centered-clip", "max_tokens_per_round": None,
              "run_owner": "ssh-rsa " + "A" * 300}
    line = config_difference(ours, theirs)
    assert len(line) < 300, line
    assert line.count("--model") == 1 and "--model hf:llama (ours: tiny)" in line
    assert line == "--model hf:llama (ours: tiny); --tokenizer 026beeeeeeee… (ours: default); " \
                   "--data 9f3c9f3c9f3c… (ours: default) and 7 more options", line
    assert not re.search(r"[0-9a-f]{13}", line) and "model." not in line and "None" not in line
    # the same model on both sides: the entries that differ, under --model
    assert config_difference({"model": "hf:llama", "model.hidden_size": 32}, {"model": "hf:llama",
                             "model.hidden_size": 64}) == "--model hf:llama: hidden_size=64 (ours: 32)"
    wider = {"model": "hf:llama", **{f"model.entry_{i}": i + 1 for i in range(5)}}
    assert config_difference({"model": "hf:llama", **{f"model.entry_{i}": i for i in range(5)}}, wider) == \
        "--model hf:llama: entry_0=1 (ours: 0), entry_1=2 (ours: 1) and 3 more entries"
    assert config_difference({"protocol": 4}, {"protocol": 5}) == "protocol version 5 (ours: 4)"
    assert config_difference({"min_group_size": 3}, {}) == "--min-group-size default (ours: 3)"
    assert config_difference({"model": "tiny"}, {"model": "tiny"}) == "unknown difference"
    assert records.shown_value("ssh-rsa " + "A" * 300) == "ssh-rsa " + "A" * 13 + "..."
    assert records.shown_value("\x1b[2Jpwned") == "\\x1b[2Jpwned"  # a peer's text reaches a terminal escaped


def peer_at(peer: str, ready_round: int, exchanged_round: int = -1) -> NodeRecord:
    return NodeRecord(peer, "fp", ready_round + 1, ready_round, "d", exchanged_round=exchanged_round)


def test_round_state_of_the_peers_we_average_with() -> None:
    assert round_state([], 4) == "alone"
    assert round_state([peer_at("a", 4), peer_at("b", 5)], 4) == "together"
    assert round_state([peer_at("a", 4), peer_at("b", 3)], 4) == "waiting"
    # most of them already exchanged round 4 without us: however the rest stand, we are behind
    assert round_state([peer_at("a", 3), peer_at("b", 4, 4), peer_at("c", 4, 4)], 4) == "behind"
    assert round_state([peer_at("b", 4, exchanged_round=4)], 4) == "behind"
    # one record claiming a far-ahead round (anyone can publish one) is not most of them
    assert round_state([peer_at("a", 4), peer_at("forged", 10**6, 10**6)], 4) == "together"
    assert round_state([peer_at("a", 3), peer_at("forged", 10**6, 10**6)], 4) == "waiting"


def test_a_drawn_group_retries_matchmaking_only_while_every_partner_is_still_at_the_round() -> None:
    def member(group_size: int, state: str) -> SimpleNamespace:
        return SimpleNamespace(settings=SimpleNamespace(group_size=group_size), peer_id="us",
                               drawn_group=lambda round_: ["partner", "us"],
                               presence=SimpleNamespace(round_state=lambda round_, among: state
                                                        if among == ["partner"] else "wrong call"))

    retry = Matchmaker._drawn_group_failed_too
    assert retry(member(2, "together"), 4)  # type: ignore[arg-type]
    assert not retry(member(2, "behind"), 4)  # type: ignore[arg-type]  # it averaged without us
    assert not retry(member(2, "waiting"), 4)  # type: ignore[arg-type]
    assert not retry(member(2, "alone"), 4)  # type: ignore[arg-type]  # it left
    assert not retry(member(0, "together"), 4)  # type: ignore[arg-type]  # DiLoCo: not a drawn group


def test_nodes_that_left_after_exchanging_the_round_still_count_in_its_draw() -> None:
    presence = SimpleNamespace(
        _live={"us": peer_at("us", 5), "c": peer_at("c", 4), "d": peer_at("d", 5)},
        _departed={"a": peer_at("a", 5, exchanged_round=5), "b": peer_at("b", 4, exchanged_round=4)})
    assert Presence.departed_after(presence, 5) == ["a"]  # type: ignore[arg-type]  # b left before round 5
    settings = SimpleNamespace(group_size=2, run_id="run", min_group_size=2)
    member = SimpleNamespace(settings=settings, presence=SimpleNamespace(
        compatible_peers=lambda: presence._live, departed_after=lambda round_: Presence.departed_after(
            presence, round_)), _draw=None)
    before_a_left = random_groups(["a", "c", "d", "us"], "run", 5, 2)
    assert Matchmaker.drawn_groups(member, 5) == before_a_left  # type: ignore[arg-type]


def test_a_member_that_finished_a_round_will_not_fetch_its_payloads_any_more() -> None:
    # what a leaving node's drain waits for: blocking members mark the round exchanged, overlapped
    # ones fetch round r during round r + 1 and are done once they train round r + 2
    in_round = dataclasses.replace(record("p", 1, "d"), exchanged_round=0)
    assert in_round.may_still_fetch(1)
    assert dataclasses.replace(in_round, exchanged_round=1, round=2).may_still_fetch(1) is False
    assert dataclasses.replace(in_round, round=2).may_still_fetch(1), "an overlapped exchange of round 1"
    assert dataclasses.replace(in_round, round=3).may_still_fetch(1) is False


def test_our_record_keeps_both_threads_fields_and_exchanged_round_never_goes_back(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    from diloco_node.swarm import records

    published: list[NodeRecord] = []
    monkeypatch.setattr(records, "publish", lambda _dht, _run, record, _signer: published.append(record))
    monkeypatch.setattr(records, "publish_config", lambda _dht, _run, _config: None)
    presence = Presence(SimpleNamespace(), "us", "run", "fp", {}, SimpleNamespace(), None, Gate("run"))  # type: ignore[arg-type]
    presence.mark_exchanged(5)
    presence.mark_exchanged(3)  # an overlapped exchange's late report of an older round
    assert not published, "the exchanged round goes out with the next store, not one of its own"
    presence.announce(5, True, "d", (5, "s"))
    assert published[-1].exchanged_round == 5

    def announcing() -> None:
        for round_ in range(6, 400):
            presence.announce(round_, False, "d", (round_, "s"))

    def marking() -> None:
        for round_ in range(6, 400):
            presence.mark_exchanged(round_)

    threads = [threading.Thread(target=announcing), threading.Thread(target=marking)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    presence.announce(400, False, "d", (400, "s"))
    exchanged = [r.exchanged_round for r in published]
    assert exchanged == sorted(exchanged), "exchanged_round went backwards"
    assert published[-1].exchanged_round == 399 and presence._record.round == 400


def offline(monkeypatch, found: list[NodeRecord]) -> None:  # type: ignore[no-untyped-def]
    """The DHT as records.py sees it: `found` are the run's records, stores go nowhere, no config is published."""
    monkeypatch.setattr(records, "fetch", lambda _dht, _run: ({r.peer_id: r for r in found}, {}))
    monkeypatch.setattr(records, "publish", lambda _dht, _run, _record, _signer: None)
    monkeypatch.setattr(records, "publish_config", lambda _dht, _run, _config: None)
    monkeypatch.setattr(records, "fetch_configs", lambda _dht, _run, fingerprints: dict.fromkeys(fingerprints))


def answered(value: object) -> Future[object]:
    """What hivemind's DHT returns with `return_future=True`, already answered."""
    future: Future[object] = Future()
    future.set_result(value)
    return future


def presence_seeing(monkeypatch, found: list[NodeRecord]) -> Presence:  # type: ignore[no-untyped-def]
    offline(monkeypatch, found)
    return Presence(SimpleNamespace(), "us", "run", "fp", {}, SimpleNamespace(), None, Gate("run"))  # type: ignore[arg-type]


def test_only_the_groups_records_decide_that_our_phi_diverged(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # three Sybil records announce a fake digest; the two nodes we averaged with hold ours
    found = [record("a", 5, "ours"), record("b", 5, "ours"), *(record(f"sybil{i}", 5, "fake") for i in range(3))]
    presence = presence_seeing(monkeypatch, found)
    presence.compatible_peers(refresh=True)
    assert not presence.diverged(5, "ours", among=["a", "b", "us"])
    assert presence.diverged(5, "ours", among=["a", "b", "us", "sybil0", "sybil1", "sybil2"])  # had they averaged


def test_the_state_we_announced_serving_is_compared_with_our_groups(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def serving(peer: str, served: str) -> NodeRecord:
        return dataclasses.replace(record(peer, 9, "d"), served_round=7, served_digest=served)

    presence = presence_seeing(monkeypatch, [serving("a", "theirs"), serving("b", "theirs")])
    presence.announce(9, True, "d", (7, "ours"))  # a round we averaged alone on our side only
    presence.compatible_peers(refresh=True)
    assert presence.served_diverged(["a", "b", "us"])
    assert not presence.served_diverged(["us"])
    presence.announce(9, True, "d", (7, "theirs"))
    assert not presence.served_diverged(["a", "b", "us"])


def test_one_record_with_another_config_does_not_keep_us_out(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from diloco_node.swarm.presence import IncompatibleRun

    other = dataclasses.replace(record("intruder", 5, "d"), fingerprint="other")
    presence_seeing(monkeypatch, [record("a", 5, "d"), other]).check_compatible()  # the run shares ours
    with pytest.raises(IncompatibleRun, match="incompatible config"):
        presence_seeing(monkeypatch, [other]).check_compatible()  # the run is another config's


def test_a_record_counts_only_under_the_key_of_the_peer_it_claims_to_be(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ours = identity.create(tmp_path / "a.key")
    theirs = identity.create(tmp_path / "b.key")
    signed_by = records.signer(identity.load(tmp_path / "a.key"))
    assert records.bound_peer_id(records.owned_subkey(ours, signed_by)) == ours
    assert records.bound_peer_id(b"no key here") is None
    # a key text of a type cryptography does not know, or of another algorithm: no peer, not a crash
    for text in (b"ssh-foo AAAAB3NzaC1yc2E=", b"ecdsa-sha2-nistp999 AAAA", b"ssh-dss AAAAB3NzaC1kc3M="):
        assert records.bound_peer_id(b"[owner:" + text + b"]") is None

    class FakeDHT:  # what hivemind's get returns once the DHT has checked the signatures
        def get(self, key, latest, return_future):  # type: ignore[no-untyped-def]
            assert return_future  # every call of ours waits a bounded time (swarm/bounded.py)
            expires = get_dht_time() + 10
            honest = ValueWithExpiration(record(ours, 3, "d").to_wire(), expires)
            value = {records.owned_subkey(ours, signed_by): honest,
                     # a record under our key that claims to be another peer: an impersonation
                     ours.encode()[:4] + signed_by.local_public_key:
                         ValueWithExpiration(record(theirs, 3, "d").to_wire(), expires)}
            return answered(ValueWithExpiration(value, expires))

    live, _ = records.fetch(FakeDHT(), "run")  # type: ignore[arg-type]
    assert list(live) == [ours]


def test_a_permissioned_presence_ignores_records_without_a_valid_admission(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    owner, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    admitted = dataclasses.replace(record("a", 5, "d"), admission=sign(owner, Claims("admit", "run", "a")))
    wrong_peer = dataclasses.replace(record("b", 5, "d"), admission=sign(owner, Claims("admit", "run", "a")))
    self_made = dataclasses.replace(record("c", 5, "d"), admission=sign(stranger, Claims("admit", "run", "c")))
    none = record("e", 5, "d")
    offline(monkeypatch, [admitted, wrong_peer, self_made, none])
    presence = Presence(SimpleNamespace(), "us", "run", "fp", {}, SimpleNamespace(), None,  # type: ignore[arg-type]
                        Gate("run", owner.public_key(), sign(owner, Claims("admit", "run", "us"))))
    assert sorted(presence.compatible_peers(refresh=True)) == ["a", "us"]
    assert presence.known("a") and not presence.known("b", refresh=True)


def test_a_joiner_takes_the_state_most_records_announce(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading
    import time

    import torch

    from diloco_node.replica.layout import digest

    phi, momentum = torch.arange(4, dtype=torch.float32), torch.ones(4)
    honest = digest([phi, momentum])

    def serving(peer: str, round_: int, served: str) -> NodeRecord:
        return dataclasses.replace(record(peer, round_, "d"), served_round=round_, served_digest=served)

    others = {"a": serving("a", 7, honest), "b": serving("b", 7, honest), "liar": serving("liar", 10**6, "fake")}
    reference = reference_state(others.values())
    assert reference == (7, honest)
    assert servers_in_order(others, reference) == ["a", "b", "liar"]  # the liar's far-ahead claim comes last
    never = threading.Event()
    now = time.monotonic()

    def agrees(shared: tuple, peers: dict[str, NodeRecord] = others) -> str | None:
        return agreement(shared, lambda: peers, now, never)

    assert agrees(({"round": 7}, [phi, momentum])) is None
    # a node two rounds on serves the same state while those rounds' means are in flight
    assert agrees(({"round": 9, "in_flight": [7, 8]}, [phi, momentum])) is None
    assert agrees(({"round": 9, "in_flight": "78"}, [phi, momentum])) == "malformed rounds"
    monkeypatch.setattr(statesync, "AGREEMENT_POLLS", 1)  # a refusal looks at the records once here
    assert "not the run's" in str(agrees(({"round": 7}, [phi + 1, momentum])))
    assert "not the run's" in str(agrees(({"round": 7}, [phi, momentum * 1e6])))
    # no two servers alike: nothing tells the honest one from a liar, until the wait is over
    split = {"a": others["a"], "liar": serving("liar", 10**6, "fake")}
    assert "no state two nodes agree on" in str(agrees(({"round": 7}, [phi, momentum]), split))
    assert agreement(({"round": 7}, [phi, momentum]), lambda: split,
                     now - trust_state.AGREEMENT_WAIT_SECONDS - 1, never) is None
    assert reference_state(split.values()) is None
    # but never one every server has moved past: a state that arrived late is caught up on, or refused
    assert "no state two nodes agree on" in str(agreement(({"round": 5}, [phi, momentum]), lambda: split,
                                                          now - trust_state.AGREEMENT_WAIT_SECONDS - 1, never))
    assert reference_state([others["a"]]) == (7, honest)  # one node alone serves the run's state
    two_liars = [*others.values(), serving("liar2", 10**6, "fake")]
    assert reference_state(two_liars) is None  # a tie never goes to the later round
    # the state a group serves, settled up to a round: the majority's, a tie to the round's draw
    group = [others["a"], others["b"], serving("c", 7, "split")]
    assert canonical_digest(group, 7, served=True) == honest
    first = min(("b", "c"), key=lambda peer: tie_order(7, peer))
    assert canonical_digest([others["b"], serving("c", 7, "split")], 7, served=True) == \
        (honest if first == "b" else "split")
    assert canonical_digest(group, 8, served=True) is None


def test_a_state_the_run_moved_past_while_it_downloaded_is_caught_up_to_the_runs() -> None:
    """Rounds shorter than the download (docs/architecture.md §14): a state 1 … CATCH_UP_ROUNDS
    rounds old is caught up on the means since and taken only if it then is the run's, bit for bit."""
    import threading

    import torch

    from diloco_node.replica.layout import digest
    from diloco_node.swarm.statesync import caught_up
    from diloco_node.trust.state import CATCH_UP_ROUNDS, catch_up_target

    def mean(r: int) -> torch.Tensor:
        return torch.full((4,), float(r))

    def stepped(phi: torch.Tensor, rounds: range) -> torch.Tensor:  # the run's outer step, here φ − mean
        for r in rounds:
            phi = phi - mean(r)
        return phi

    phi0, momentum = torch.arange(4, dtype=torch.float32), torch.ones(4)
    # served at round 8 with round 7 in flight: settled round 7
    old = ({"round": 8, "in_flight": [7], "server": "a"}, [phi0, momentum])

    def run_at(settled: int, round_: int) -> dict[str, NodeRecord]:
        served = digest([stepped(phi0, range(7, settled)), momentum])
        return {p: dataclasses.replace(record(p, round_, "d"), served_round=settled, served_digest=served)
                for p in ("a", "b")}

    # the rule: the run's settled round, when the state is 1 … CATCH_UP_ROUNDS behind and its server serves it
    run = run_at(12, 13)
    reference = reference_state(run.values())
    assert reference is not None and catch_up_target((7, "x"), reference, run["a"]) == 12
    assert catch_up_target((12, "x"), reference, run["a"]) is None  # current: agreement takes it
    assert catch_up_target((13, "x"), reference, run["a"]) is None  # ahead of the run
    assert catch_up_target((12 - CATCH_UP_ROUNDS - 1, "x"), reference, run["a"]) is None  # too far behind
    assert catch_up_target((12 - CATCH_UP_ROUNDS, "x"), reference, run["a"]) == 12
    assert catch_up_target((7, "x"), None, run["a"]) is None  # the run agrees on no state
    assert catch_up_target((7, "x"), reference, None) is None  # a server without a record
    assert catch_up_target((7, "x"), reference, dataclasses.replace(run["a"], served_round=11)) is None

    fetched: list[int] = []
    never = threading.Event()

    def catch_up(server: str, shared: tuple, settled: int, round_: int) -> tuple | None:
        metadata, (phi, mom) = shared
        rounds = range(min([metadata["round"], *metadata["in_flight"]]), settled)
        fetched.extend(rounds)
        return {**metadata, "round": round_, "in_flight": list(range(settled, round_))}, [stepped(phi, rounds), mom]

    taken = caught_up("a", old, lambda: run, catch_up, "superseded", never)
    assert not isinstance(taken, str), taken
    assert taken[0]["round"] == 13 and taken[0]["in_flight"] == [12]  # the rest in flight, inherited as always
    assert torch.equal(taken[1][0], stepped(phi0, range(7, 12))) and fetched == [7, 8, 9, 10, 11]
    # the run moves on while the means are fetched: another pass fetches the rounds since
    moving = iter([run_at(10, 11), run_at(12, 13), run_at(12, 13)])
    fetched.clear()
    taken = caught_up("a", old, lambda: next(moving), catch_up, "superseded", never)
    assert not isinstance(taken, str) and fetched == [7, 8, 9, 10, 11], taken
    # a round whose mean cannot be had, a wrong mean, a state too old: refused, with the reason
    assert "cannot be had" in str(caught_up("a", old, lambda: run, lambda *_: None, "superseded", never))

    def wrong(server: str, shared: tuple, settled: int, round_: int) -> tuple | None:
        caught = catch_up(server, shared, settled, round_)
        return None if caught is None else (caught[0], [caught[1][0] + 1, caught[1][1]])

    assert "is not the run's" in str(caught_up("a", old, lambda: run, wrong, "superseded", never))
    far = run_at(8 + CATCH_UP_ROUNDS, 9 + CATCH_UP_ROUNDS)
    assert caught_up("a", old, lambda: far, catch_up, "superseded", never) == "superseded"
    # a run that moves on as fast as we catch up (a round's payloads slower than a round): refused at once
    endless = iter([run_at(8 + 2 * i, 9 + 2 * i) for i in range(10)])
    assert "slower than the run" in str(caught_up("a", old, lambda: next(endless), catch_up, "superseded", never))
    # one that moves on a round each pass, or that we gain on but never reach: bounded passes
    steady = iter([run_at(8 + i, 9 + i) for i in range(10)])
    assert "passes" in str(caught_up("a", old, lambda: next(steady), catch_up, "superseded", never))
    gaining = iter([run_at(12, 13), run_at(16, 17), run_at(19, 20), run_at(21, 22), run_at(22, 23)])
    assert "passes" in str(caught_up("a", old, lambda: next(gaining), catch_up, "superseded", never))


def test_a_fresh_node_skips_downloading_the_state_it_built_itself() -> None:
    from diloco_node.swarm.statesync import holds_run_state

    def serving(peer: str, round_: int, settled: int, served: str) -> NodeRecord:
        return dataclasses.replace(record(peer, round_, "d"), served_round=settled, served_digest=served)

    phi0 = (0, "phi0")
    assert holds_run_state({"a": serving("a", 0, 0, "phi0")}, phi0)  # the first node, waiting at round 0
    assert holds_run_state({"a": serving("a", 0, 0, "phi0"), "b": serving("b", 0, 0, "phi0")}, phi0)
    # round 0's mean in flight (eager, round 1 training): the run's state is more than φ0
    assert not holds_run_state({"a": serving("a", 1, 0, "phi0")}, phi0)
    assert not holds_run_state({"a": serving("a", 3, 3, "phi3")}, phi0)  # the run moved on
    # done with round 0's inner phase: its record may lag a node that already trained on
    trained = dataclasses.replace(serving("a", 0, 0, "phi0"), ready_round=0)
    assert not holds_run_state({"a": trained}, phi0)
    assert not holds_run_state({"a": serving("a", 0, 0, "other seed")}, phi0)
    # no state two servers agree on: the usual checked download decides
    assert not holds_run_state({"a": serving("a", 0, 0, "phi0"), "b": serving("b", 0, 0, "x")}, phi0)


def test_a_published_config_counts_only_under_its_own_fingerprint() -> None:
    from diloco_node.config import NodeConfig

    config = NodeConfig().fingerprint_fields()
    ours = NodeConfig().fingerprint()
    forged = {**config, "model": "small"}
    stored = {ours: ValueWithExpiration(config, 1e12), "f" * 16: ValueWithExpiration(forged, 1e12)}
    dht = SimpleNamespace(get=lambda key, latest, return_future: answered(ValueWithExpiration(stored, 1e12)))
    assert records.fetch_configs(dht, "run", [ours]) == {ours: config}  # type: ignore[arg-type]
    stored[ours] = ValueWithExpiration(forged, 1e12)  # someone stored another config under our fingerprint
    assert records.fetch_configs(dht, "run", [ours, "f" * 16]) == {ours: None, "f" * 16: None}  # type: ignore[arg-type]


@pytest.mark.parametrize("published", [{1: "a", "b": 2}, {"model": b"bytes"}, {"model": float("nan")},
                                       {(1, 2): 3}, {"a": {"b": object()}}])
def test_a_published_config_that_cannot_be_hashed_is_none_not_an_error(published: dict) -> None:  # type: ignore[type-arg]
    """A peer may store anything under any fingerprint: canonical JSON refuses mixed key types,
    bytes, NaN; none of it may raise out of a read of the configs."""
    stored = {"f" * 16: ValueWithExpiration(published, 1e12), 7: ValueWithExpiration({}, 1e12)}
    dht = SimpleNamespace(get=lambda key, latest, return_future: answered(ValueWithExpiration(stored, 1e12)))
    assert records.fetch_configs(dht, "run", ["f" * 16, 7]) == {"f" * 16: None, 7: None}  # type: ignore[arg-type, list-item]


def test_fresh_refused_ids_cost_one_config_read_a_look_and_bounded_memory(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """Records are free: 10,000 fresh ids with 10,000 configs, read at once, cost one read of the
    configs and REFUSALS_SHOWN + 1 log lines; what is remembered of them stays bounded."""
    import logging

    from diloco_node.swarm import presence as presence_module

    reads: list[int] = []
    forged = [dataclasses.replace(record(f"id{i}", 5, "d"), fingerprint=f"{i:016x}") for i in range(10_000)]
    presence = presence_seeing(monkeypatch, [record("a", 5, "d"), *forged])
    monkeypatch.setattr(records, "fetch_configs",
                        lambda _dht, _run, fingerprints: reads.append(len(fingerprints)) or dict.fromkeys(fingerprints))
    presence._refused = presence_module.LRUSet(100)  # MAX_TRACKED_PEERS, made small
    with caplog.at_level(logging.WARNING, logger="diloco_node.swarm.presence"):
        presence.compatible_peers(refresh=True)
    assert reads == [presence_module.REFUSALS_SHOWN]
    assert len(caplog.records) == presence_module.REFUSALS_SHOWN + 1
    assert "refused 9996 more peers" in caplog.records[-1].getMessage()
    assert len(presence._refused) == 100
    # fresh ids again at the next look, and the one after: no more reads within CONFIG_READ_SECONDS
    for wave in range(2):
        fresh = [dataclasses.replace(record(f"new{wave}-{i}", 5, "d"), fingerprint=f"{wave}{i:015x}")
                 for i in range(10)]
        offline(monkeypatch, [record("a", 5, "d"), *fresh])
        with caplog.at_level(logging.WARNING, logger="diloco_node.swarm.presence"):
            presence.compatible_peers(refresh=True)
    assert reads == [presence_module.REFUSALS_SHOWN]
    assert "refused peer new1-0: incompatible config (fingerprint=" in caplog.text


def test_a_refusal_names_what_differs_or_that_the_config_is_unknown(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from diloco_node.swarm.presence import IncompatibleRun

    other = dataclasses.replace(record("them", 5, "d"), fingerprint="other")
    presence = presence_seeing(monkeypatch, [other])
    presence.config = {"model": "tiny"}
    with pytest.raises(IncompatibleRun, match=r"fingerprint=other \(ours: fp\); its config is not published"):
        presence.check_compatible()
    monkeypatch.setattr(records, "fetch_configs",
                        lambda _dht, _run, fingerprints: dict.fromkeys(fingerprints, {"model": "small"}))
    with pytest.raises(IncompatibleRun, match=r"incompatible config: --model small \(ours: tiny\) \(peer …them\)$"):
        presence.check_compatible()


def test_a_flood_of_records_costs_a_bounded_read_and_the_runs_nodes_are_still_read(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Records are free and each costs CPU to check (4,000 took 1.6 s a read): a read checks at most
    MAX_RECORDS_READ, those under keys read before first, so the run's nodes outlast a flood."""
    monkeypatch.setattr(records, "bound_peer_id", lambda subkey: subkey.decode().removeprefix("key:"))
    monkeypatch.setattr(records, "_SIGNERS", records.OrderedDict())
    parsed: list[object] = []
    real_parse = records.parse_record
    monkeypatch.setattr(records, "parse_record", lambda value: parsed.append(value) or real_parse(value))
    stored: dict[object, object] = {}

    def wire(peer: str, expiration: float, left: bool = False) -> ValueWithExpiration:
        value = {**record(peer, 5, "d").to_wire(), **({"left": True} if left else {})}
        return ValueWithExpiration(value, expiration)

    now = get_dht_time()
    stored[b"key:honest"] = wire("honest", now + 20)
    stored[b"key:gone"] = wire("gone", now + 20, left=True)
    dht = SimpleNamespace(get=lambda key, latest, return_future: answered(ValueWithExpiration(stored, now + 60)))
    live, departed = records.fetch(dht, "run")  # type: ignore[arg-type]
    assert set(live) == {"honest"} and set(departed) == {"gone"} and len(parsed) == 2
    for index in range(4000):  # a flood of fresh ids, each record expiring later than ours
        stored[f"key:sybil{index}".encode()] = wire(f"sybil{index}", now + 25)
    stored[7] = wire("odd key", now + 25)  # a subkey of another type is passed over
    parsed.clear()
    live, departed = records.fetch(dht, "run")  # type: ignore[arg-type]
    assert len(parsed) == records.MAX_RECORDS_READ
    assert "honest" in live and "gone" in departed and len(live) == records.MAX_RECORDS_READ - 1


def test_records_stored_to_outlive_any_node_s_are_passed_over(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A reader that has read no key before (a joiner) keeps the latest to expire of a flood: records
    stored to expire far in the future would hide the run's records from it for good, for one store."""
    monkeypatch.setattr(records, "bound_peer_id", lambda subkey: subkey.decode().removeprefix("key:"))
    monkeypatch.setattr(records, "_SIGNERS", records.OrderedDict())
    now = get_dht_time()
    stored: dict[object, object] = {b"key:honest": ValueWithExpiration(record("honest", 5, "d").to_wire(), now + 20)}
    for index in range(records.MAX_RECORDS_READ + 1):
        stored[f"key:sybil{index}".encode()] = ValueWithExpiration(record(f"sybil{index}", 5, "d").to_wire(),
                                                                   now + 10**6)
    stored[b"key:skewed"] = ValueWithExpiration(record("skewed", 5, "d").to_wire(),
                                                now + records.RECORD_TTL + records.MAX_CLOCK_SKEW)
    dht = SimpleNamespace(get=lambda key, latest, return_future: answered(ValueWithExpiration(stored, now + 60)))
    live, _ = records.fetch(dht, "run")  # type: ignore[arg-type]
    assert set(live) == {"honest", "skewed"}  # a node whose clock runs ahead within the skew still counts


def publishing_presence(monkeypatch, found: list[NodeRecord]) -> tuple[Presence, list[NodeRecord]]:  # type: ignore[no-untyped-def]
    """A Presence that sees `found` and keeps every record it publishes."""
    published: list[NodeRecord] = []
    offline(monkeypatch, found)
    monkeypatch.setattr(records, "publish", lambda _dht, _run, rec, _signer: published.append(rec))
    presence = Presence(SimpleNamespace(), "us", "run", "fp", {}, SimpleNamespace(), None, Gate("run"))  # type: ignore[arg-type]
    presence.compatible_peers(refresh=True)
    return presence, published


def test_a_server_training_on_while_its_ready_is_held_for_a_joiner_is_not_read_as_skipping_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Eager: the node that served a joiner holds its ready for round 4 until the joiner's record shows
    (the barrier's _release_ready) while its main thread already trains round 5. Its record once read
    round=5 ready_round=3, which its partner took for a node that skipped round 4: the partner went on
    alone, and the two matchmade different rounds from then on (seen in CI: test_exactly_once)."""
    presence, published = publishing_presence(monkeypatch, [record("partner", 4, "d")])
    presence.announce(3, True, "d3", (3, "s3"))
    presence.announce(4, False, "d4", (4, "s4"))
    presence.vouch("joiner")  # served at round 4; its record does not show yet
    presence.announce(4, True, "d4", (4, "s4"))
    assert presence._holding == 4 and published[-1].ready_round == 3
    presence.announce(5, False, "d5", (5, "s5"))  # the main thread trains on
    seen = published[-1]
    assert round_state([seen], 4) == Outcome.WAITING, f"round {seen.round} ready {seen.ready_round} reads as a skip"
    presence._release_ready(4)  # the joiner shows, or its grace ends
    assert (published[-1].round, published[-1].ready_round, published[-1].digest) == (5, 4, "d5")
    assert round_state([published[-1]], 4) == Outcome.TOGETHER
    presence.announce(5, True, "d5", (5, "s5"))  # nothing held any more: as before
    assert (published[-1].round, published[-1].ready_round) == (5, 5)


def test_a_later_ready_supersedes_a_hold_and_no_hold_outlives_its_bound(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Review findings on the fix above: a ready for round 6 that holds again (a second joiner)
    while round 5's barrier never released must not say round 5 unfinished; and a hold whose barrier
    never runs (a re-sync, NoLoCo's held rounds) ends after JOINER_RECORD_SECONDS, by the heartbeat."""
    from diloco_node.swarm import presence as presence_module

    presence, published = publishing_presence(monkeypatch, [record("partner", 5, "d")])
    presence.announce(4, True, "d4", (4, "s4"))
    presence.announce(5, False, "d5", (5, "s5"))
    presence.vouch("first", 5)
    presence.announce(5, True, "d5", (5, "s5"))
    assert presence._holding == 5 and published[-1].ready_round == 4
    presence.announce(6, False, "d6", (6, "s6"))  # deferred: round 5's barrier has not released
    presence.vouch("second", 6)
    presence.announce(6, True, "d6", (6, "s6"))  # held again, for the second joiner
    assert presence._holding == 6 and (published[-1].round, published[-1].ready_round) == (6, 5)
    assert round_state([published[-1]], 5) == Outcome.TOGETHER
    presence.announce(7, False, "d7", (7, "s7"))  # deferred, and round 6's barrier never runs
    assert published[-1].round == 6
    presence._release_stale_hold()
    assert published[-1].round == 6, "within its bound the hold stands"
    later = presence._held_at + presence_module.JOINER_RECORD_SECONDS
    monkeypatch.setattr(presence_module.time, "monotonic", lambda: later)
    presence._release_stale_hold()
    assert (published[-1].round, published[-1].ready_round, published[-1].digest) == (7, 6, "d7")
