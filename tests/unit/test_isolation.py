"""Isolation: when a node counts itself cut off, that it says so once, and how it dials its contacts.

Contacts is replaced by a recorder here (the seam); real peers are cut off and healed in
tests/network/test_partition.py."""

from __future__ import annotations

import logging

import pytest

from diloco_node.swarm import isolation as isolation_module
from diloco_node.swarm.contacts import parse_peer_addresses
from diloco_node.swarm.isolation import Isolation


class Recorder:
    def __init__(self) -> None:
        self.dials = 0
        self.remembered = 0

    def remember_connected(self) -> None:
        self.remembered += 1

    def dial(self) -> list[str]:
        self.dials += 1
        return []


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(isolation_module.time, "monotonic", lambda: now[0])
    return now


def test_a_node_whose_peers_vanished_is_isolated_until_one_is_back(clock: list[float], caplog) -> None:  # type: ignore[no-untyped-def]
    contacts = Recorder()
    changes: list[float | None] = []
    isolation = Isolation(contacts, "run")  # type: ignore[arg-type]
    isolation.on_change = changes.append
    isolation.observe([], [])
    assert isolation.since is None, "a node that never had peers (the run's first) is not isolated"
    isolation.observe(["b", "c"], [])
    assert contacts.remembered == 1
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            isolation.observe([], [])
            clock[0] += 3.0
        assert isolation.since is not None and changes == [isolation.since]
        assert caplog.text.count("isolated: no peer of run run") == 1, "said once, not every heartbeat"
        assert 2 <= contacts.dials <= 5
        clock[0] += isolation_module.REMIND_SECONDS
        isolation.observe([], [])
        isolation.observe([], [])
        assert caplog.text.count("still isolated: no peer of run run") == 1, "reminded once a period"
        isolation.observe(["c"], [])
    assert isolation.since is None and changes[-1] is None
    assert "back in the swarm" in caplog.text


def test_dialing_backs_off_to_its_cap(clock: list[float]) -> None:
    contacts = Recorder()
    isolation = Isolation(contacts, "run")  # type: ignore[arg-type]
    isolation.observe(["b"], [])
    dial_times = []
    for _ in range(200):  # 20 s of 0.1 s heartbeats
        before = contacts.dials
        isolation.observe([], [])
        if contacts.dials > before:
            dial_times.append(clock[0])
        clock[0] += 0.1
    gaps = [round(b - a, 1) for a, b in zip(dial_times, dial_times[1:], strict=False)]
    cap = isolation_module.MAX_DIAL_DELAY
    assert gaps[0] == 1.0 and gaps[1] == min(2.0, cap) and set(gaps[2:]) == {min(4.0, cap)} == {cap}


def test_peers_that_left_on_purpose_leave_the_node_to_go_on_alone(clock: list[float]) -> None:
    isolation = Isolation(Recorder(), "run")  # type: ignore[arg-type]
    isolation.observe(["b"], [])
    isolation.observe([], ["b"])
    assert isolation.since is None
    isolation.observe(["b", "c"], [])  # b came back and c joined; then c vanished without leaving
    isolation.observe([], ["b"])
    assert isolation.since is not None


def test_peer_addresses_are_split_into_id_and_transport() -> None:
    peer = "12D3KooWRkvQ9cYd3RbxBAv4HxCQtqoBJu3hrtVaBDNmQTCLwzTB"
    book = parse_peer_addresses([f"/ip4/10.0.0.1/tcp/5/p2p/{peer}", f"/ip6/::1/tcp/6/p2p/{peer}"])
    assert book == {peer: ["/ip4/10.0.0.1/tcp/5", "/ip6/::1/tcp/6"]}


def test_fresh_peer_ids_cannot_grow_the_view_without_bound(clock: list[float]) -> None:
    """Records are free: 20,000 fresh ids seen live and then gone leave at most MAX_TRACKED_PEERS
    remembered, and the peers of the last heartbeats still decide whether we are cut off."""
    isolation = Isolation(Recorder(), "run")  # type: ignore[arg-type]
    capacity = isolation_module.MAX_TRACKED_PEERS
    for start in range(0, 20_000, 500):
        batch = [f"fake-{i}" for i in range(start, start + 500)]
        isolation.observe(batch, departed=batch[:250])
        assert len(isolation._known) <= capacity
    assert isolation.tracked() == capacity
    isolation.observe(["honest"], departed=[])
    isolation.observe([], departed=[f"fake-{i}" for i in range(20_000)])
    assert isolation.cut_off([])  # "honest" vanished without leaving: cut off, as before
    isolation.observe([], departed=["honest"])
    assert not isolation.cut_off([])  # every peer remembered left on purpose
