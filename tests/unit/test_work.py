"""Declared work (trust/work.py): a payload's declared tokens judged against what the claimant's
own records showed and against our own round, which no peer writes (docs/architecture.md §13,
"Declared tokens")."""

from __future__ import annotations

from diloco_node.trust.work import CLAIM_SLACK, PEER_SPEEDUP, DeclaredWork


def test_claims_are_judged_by_the_most_a_peers_records_showed_and_said_once() -> None:
    claims = DeclaredWork()
    # what each record says a round trains: rate × T under --round-seconds, its last round's tokens under H
    claims.saw({"woken": 6_000.0, "liar": 300.0, "odd": float("nan"), "none": None, "new": 0.0})
    claims.saw({"woken": 30.0, "liar": 300.0})  # a frozen round's record: the most seen stays
    declared = {"woken": 20_000.0, "liar": 20_000.0, "honest": 300.0, "odd": 1e9, "none": 1e9, "new": 1e9,
                "unknown": 1e9}
    # woken: 3.3× its most, an owner who stopped using the machine; liar: 67×; no record yet: not judged
    assert claims.doubted(declared) == {"liar": CLAIM_SLACK * 300}
    assert claims.doubted({"liar": CLAIM_SLACK * 300}) == {}  # at the bound is honest
    assert claims.first_doubt("liar") and not claims.first_doubt("liar")
    for n in range(DeclaredWork.MAX_PEERS + 5):  # bounded memory whatever the number of peer ids
        claims.saw({f"p{n}": 1.0, "liar": 300.0})  # the liar is seen in every group, as a member is
        claims.first_doubt(f"p{n}")
    assert len(claims.most) <= DeclaredWork.MAX_PEERS and len(claims.said) <= DeclaredWork.MAX_PEERS
    # a flood of fresh ids forgets the least recent, not everything (1,025 of them wiped the table)
    assert claims.doubted({"liar": 20_000.0}) == {"liar": CLAIM_SLACK * 300}


def test_a_claim_far_beyond_our_own_round_is_doubted_whatever_the_claimants_records_say() -> None:
    """A liar whose own records said 1e15 tokens a round was never doubted: our own round, which no
    peer writes, bounds every claim at PEER_SPEEDUP times it."""
    claims = DeclaredWork()
    claims.saw({"liar": 1e15, "fast": 40_000.0})
    own = 1_000.0
    declared = {"liar": 1e15, "fast": 40_000.0, "fresh": 1e9}
    assert claims.doubted(declared, own) == {"liar": PEER_SPEEDUP * own, "fresh": PEER_SPEEDUP * own}
    assert claims.doubted(declared) == {}  # without our round: the records alone, as before
    assert claims.doubted({"fast": 40_000.0}, own=0.0) == {}  # no round of ours to compare (no payload)


def test_the_credible_members_are_the_group_less_the_doubted_each_doubt_said_once() -> None:
    """Under a fixed H a record's last round's tokens bound the claim; under --round-seconds its
    rate times the round's budget; only the group's records are remembered; a round without
    declarations (alone, held, a butterfly member) proves its whole group."""
    stats = {"honest": {"last_round_tokens": 1_000.0, "last_round_tokens_per_second": 10.0},
             "liar": {"last_round_tokens": 1_000.0, "last_round_tokens_per_second": 10.0},
             "stranger": {"last_round_tokens": 5.0}}
    declared = {"honest": 3_000.0, "liar": 9_000.0}
    work = DeclaredWork()
    assert work.credible(("us", "honest", "liar"), declared, stats, None, 1_000.0) == \
        (["us", "honest"], {"liar": CLAIM_SLACK * 1_000.0})
    assert "stranger" not in work.most
    assert work.credible(("us", "honest", "liar"), declared, stats, None, 1_000.0) == (["us", "honest"], {})
    budgeted = DeclaredWork()  # --round-seconds 50: 10 tokens/s × 50 s
    assert budgeted.credible(("us", "liar"), {"liar": 3_000.0}, stats, 50.0, 1_000.0) == \
        (["us"], {"liar": CLAIM_SLACK * 500.0})
    assert DeclaredWork().credible(("us", "liar"), {}, stats, None, 0.0) == (["us", "liar"], {})
