"""Presence records: parsing what peers wrote, and choosing the canonical φ when nodes disagree."""

from __future__ import annotations

from diloco_node.swarm.records import NodeRecord, canonical_digest, config_difference


def record(peer: str, round_: int, digest: str) -> NodeRecord:
    return NodeRecord(peer, "fp", {}, round_, round_ - 1, digest)


def test_round_trip_through_the_wire() -> None:
    original = NodeRecord("peer", "fp", {"model": "tiny"}, 3, 2, "abc")
    assert NodeRecord.from_wire("peer", original.to_wire()) == original


def test_malformed_or_left_records_are_ignored() -> None:
    good = NodeRecord("p", "fp", {}, 1, 0, "d").to_wire()
    assert NodeRecord.from_wire("p", "nonsense") is None
    assert NodeRecord.from_wire("p", {**good, "round": "1"}) is None
    assert NodeRecord.from_wire("p", {**good, "digest": None}) is None
    assert NodeRecord.from_wire("p", {k: v for k, v in good.items() if k != "config"}) is None
    assert NodeRecord.from_wire("p", {**good, "left": True}) is None


def test_majority_digest_is_canonical() -> None:
    nodes = [record("a", 5, "x"), record("b", 5, "y"), record("c", 5, "y")]
    assert canonical_digest(nodes, 5) == "y"


def test_tie_goes_to_the_smallest_peer_id_whatever_the_order() -> None:
    nodes = [record("b", 5, "x"), record("a", 5, "y")]
    assert canonical_digest(nodes, 5) == "y"
    assert canonical_digest(list(reversed(nodes)), 5) == "y"


def test_only_nodes_at_that_round_count() -> None:
    nodes = [record("a", 5, "x"), record("b", 6, "y"), record("c", 6, "y")]
    assert canonical_digest(nodes, 5) == "x"
    assert canonical_digest(nodes, 7) is None


def test_config_difference_names_the_keys() -> None:
    assert config_difference({"model": "tiny", "lr": 1}, {"model": "small", "lr": 1}) == "model=small (ours: tiny)"
