"""PayloadExchange between two real hivemind DHT peers in this process, and the missed-group recovery on top of it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from hivemind import DHT

from diloco_node.swarm import exchange as exchange_module
from diloco_node.swarm.exchange import AWAITED_KEPT_ROUNDS, KEPT_ROUNDS, Fetched, PayloadExchange, _parse_meta
from diloco_node.swarm.matchmaking import MISSED_ALLREDUCE_GRACE, MISSED_GROUP_GRACE, Matchmaker
from diloco_node.swarm.streams import Streams

pytestmark = pytest.mark.integration


@pytest.fixture
def pair() -> Iterator[tuple[PayloadExchange, PayloadExchange, str, str]]:
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    anyone = lambda *_: None  # noqa: E731  (the fetch policy: the swarm facade's)
    offering = PayloadExchange(Streams(first), "xtest", 1 << 20, anyone)
    fetching = PayloadExchange(Streams(second), "xtest", 1 << 20, anyone)
    offering.attach()
    fetching.attach()
    yield offering, fetching, str(first.peer_id), str(second.peer_id)
    for exchange in (offering, fetching):
        exchange.detach()
        exchange.streams.close()
    second.shutdown()
    first.shutdown()


def test_drain_waits_until_the_group_has_fetched(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    offering, fetching, offering_id, fetching_id = pair
    offering.offer(1, b"payload", 320.0)
    offering.expect(1, [offering_id, fetching_id], offering_id)
    assert not offering.drain(0.5, may_still_fetch=lambda _peer, _round: True), "nobody fetched yet"

    drained: list[bool] = []
    waiter = threading.Thread(
        target=lambda: drained.append(offering.drain(30, may_still_fetch=lambda _peer, _round: True)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive(), "drain returned before the group member fetched"
    fetched = fetching.fetch_all([offering_id], 1, timeout=10)[offering_id]
    assert fetched == Fetched(b"payload", 320.0, tuple(sorted([offering_id, fetching_id])))
    waiter.join(timeout=10)
    assert drained == [True]
    # each side counted the stream's bytes for the other's peer id, both ways (request and answer):
    # the live per-peer rates (swarm/peer_traffic.py)
    served = {row["peer_id"]: row for row in offering.streams.traffic.rates()["peer_streams"]}
    taken = {row["peer_id"]: row for row in fetching.streams.traffic.rates()["peer_streams"]}
    assert set(served) == {fetching_id} and set(taken) == {offering_id}, (served, taken)
    assert served[fetching_id]["stream_egress_bytes_per_second"] > len(b"payload") / 5
    assert served[fetching_id]["stream_ingress_bytes_per_second"] > 0  # its request
    assert taken[offering_id]["stream_ingress_bytes_per_second"] > len(b"payload") / 5
    assert taken[offering_id]["stream_egress_bytes_per_second"] > 0


def test_drain_does_not_wait_for_peers_that_left(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    offering, _, offering_id, fetching_id = pair
    offering.offer(1, b"payload", 320.0)
    offering.expect(1, [offering_id, fetching_id], offering_id)
    started = time.monotonic()
    assert offering.drain(30, may_still_fetch=lambda _peer, _round: False)
    assert time.monotonic() - started < 5


def test_a_fetch_before_we_knew_the_group_counts(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    # a fast group member can fetch before our own matchmaking returns and we call expect()
    offering, fetching, offering_id, fetching_id = pair
    offering.offer(1, b"payload", 320.0)
    assert offering.served(1, timeout=0.2) == set()
    # before our matchmaking returned, the group is not known yet
    assert fetching.fetch_all([offering_id], 1, timeout=10) == {offering_id: Fetched(b"payload", 320.0, None)}
    assert offering.served(1, timeout=5) == {fetching_id}
    offering.expect(1, [offering_id, fetching_id], offering_id)
    assert offering.drain(0.5, may_still_fetch=lambda _peer, _round: True)


def test_a_recent_offer_outlives_the_usual_rounds_for_a_joiner_catching_up(
        pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    # Rounds shorter than a state download: the joiner fetches the rounds since its state (§14).
    offering, fetching, offering_id, _ = pair
    last = 1 + exchange_module.CATCH_UP_ROUNDS + KEPT_ROUNDS
    for round_ in range(1, last + 1):
        offering.offer(round_, f"round {round_}".encode(), 320.0)
    assert fetching.fetch_all([offering_id], 1, timeout=10)[offering_id] is None, "never beyond the rounds caught up"
    assert fetching.fetch_all([offering_id], 2, timeout=10)[offering_id] == Fetched(b"round 2", 320.0, None)


def test_an_offer_a_member_still_awaits_outlives_the_usual_rounds(
        pair: tuple[PayloadExchange, PayloadExchange, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The member may be recovering a one-sided matchmaking while we have moved rounds on.
    assert KEPT_ROUNDS == 3 and AWAITED_KEPT_ROUNDS == 5
    monkeypatch.setattr(exchange_module, "CATCH_UP_KEPT_SECONDS", 0.0)  # rounds older than any joiner's state
    offering, fetching, offering_id, fetching_id = pair
    offering.offer(1, b"awaited", 320.0)
    offering.expect(1, [offering_id, fetching_id], offering_id)
    offering.offer(2, b"fetched by nobody, awaited by nobody", 320.0)
    offering.offer(3, b"three", 320.0)
    offering.offer(4, b"four", 320.0)
    offering.offer(5, b"five", 320.0)
    assert fetching.fetch_all([offering_id], 2, timeout=10)[offering_id] is None, "dropped after three rounds"
    assert fetching.fetch_all([offering_id], 1, timeout=10)[offering_id] == Fetched(
        b"awaited", 320.0, tuple(sorted([offering_id, fetching_id])))
    offering.offer(6, b"six", 320.0)
    offering.offer(7, b"seven", 320.0)  # fetched now, so only the usual three rounds are kept
    assert fetching.fetch_all([offering_id], 4, timeout=10)[offering_id] is None
    assert fetching.fetch_all([offering_id], 5, timeout=10)[offering_id] is not None


def test_an_awaited_offer_is_dropped_in_the_end(pair: tuple[PayloadExchange, PayloadExchange, str, str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exchange_module, "CATCH_UP_KEPT_SECONDS", 0.0)
    offering, fetching, offering_id, fetching_id = pair
    offering.offer(1, b"awaited by a peer that never comes", 320.0)
    offering.expect(1, [offering_id, fetching_id], offering_id)
    for round_ in range(2, 2 + AWAITED_KEPT_ROUNDS):
        offering.offer(round_, b"later", 320.0)
    assert fetching.fetch_all([offering_id], 1, timeout=10)[offering_id] is None


def test_nothing_offered_fetches_as_none(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    _, fetching, offering_id, _ = pair
    assert fetching.fetch_all([offering_id], 7, timeout=10) == {offering_id: None}
    assert fetching.fetch_all([offering_id], 7, timeout=10, group_only=True) == {offering_id: None}


def test_a_poll_for_the_group_moves_no_payload(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    """A joiner completing its server's round polls for the server's group while its matchmaking
    runs (transfer.group_of): each poll used to fetch the whole payload (53 MB of a 1.6 MB payload
    through one 20-s matchmaking), and counted as a fetch of it."""
    offering, fetching, offering_id, fetching_id = pair
    payload = b"x" * 100_000
    offering.offer(1, payload, 320.0)
    for _ in range(3):
        assert fetching.fetch_all([offering_id], 1, timeout=10, group_only=True) == \
            {offering_id: Fetched(b"", 320.0, None)}
    assert offering.streams.bytes_sent < len(payload), "no poll carried the payload"
    assert offering.served(1, timeout=0.2) == set(), "a poll is no fetch of the payload"
    offering.expect(1, [offering_id, fetching_id], offering_id)
    group = tuple(sorted([offering_id, fetching_id]))
    polled = fetching.fetch_all([offering_id], 1, timeout=10, group_only=True)
    assert polled == {offering_id: Fetched(b"", 320.0, group)}
    assert fetching.fetch_all([offering_id], 1, timeout=10) == {offering_id: Fetched(payload, 320.0, group)}


def test_one_peer_gets_a_rounds_payload_a_bounded_number_of_times(
        pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    """Before the group is known any record holder may fetch, and one re-fetching as often as the
    rate limit allowed pulled 128 MiB with 32 requests of 640 B: a fetch and its retries are served,
    then nothing more of that round; the next round's payload is served again."""
    offering, fetching, offering_id, _ = pair
    payload = b"x" * 100_000
    offering.offer(1, payload, 320.0)
    times = exchange_module.MAX_SENDS_PER_PEER + 3
    fetched = [fetching.fetch_all([offering_id], 1, timeout=10)[offering_id] for _ in range(times)]
    assert [f.payload == payload if f else None for f in fetched] == \
        [True] * exchange_module.MAX_SENDS_PER_PEER + [None] * 3
    assert offering.streams.bytes_sent < (exchange_module.MAX_SENDS_PER_PEER + 1) * len(payload)
    offering.offer(2, payload, 320.0)
    assert fetching.fetch_all([offering_id], 2, timeout=10)[offering_id] is not None


@pytest.mark.parametrize("meta", [[], {}, {"tokens": 0}, {"tokens": -3.0}, {"tokens": float("nan")},
                                  {"tokens": True}, {"tokens": "12"}, {"tokens": 5, "group": "abc"},
                                  {"tokens": 5, "group": [1, 2]}])
def test_a_peer_that_sends_nonsense_metadata_is_refused(meta: object) -> None:
    with pytest.raises(ValueError):
        _parse_meta(meta)


async def no_butterfly_group(*_: object) -> None:
    return None


def member_seam(exchange: PayloadExchange, peer_id: str, verified: Callable[[str], bool] = lambda _: True,
                others_may_fetch: bool = False) -> SimpleNamespace:
    """What Matchmaker._missed_group uses of its matchmaker: its exchange, peer id, round timeout,
    which peers have verified records of the run, whether any may still fetch the round, and no
    butterfly group pushing to it (tests/system/test_scale.py runs those)."""
    return SimpleNamespace(_exchange=exchange, _streams=exchange.streams, peer_id=peer_id,
                           settings=SimpleNamespace(round_timeout=10.0),
                           presence=SimpleNamespace(known=lambda peer, refresh=False: verified(peer),
                                                    strangers_in=lambda group: [p for p in group if not verified(p)]),
                           _butterfly=SimpleNamespace(claimed_group=no_butterfly_group),
                           _anyone_may_still_fetch=lambda round_: others_may_fetch)


def test_a_node_whose_matchmaking_failed_joins_the_group_that_counted_it_in(
        pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    missed, member, missed_id, member_id = pair
    missed.offer(1, b"ours", 100.0)
    member.offer(1, b"theirs", 300.0)
    member.expect(1, [member_id, missed_id], member_id)  # its matchmaking counted us in
    assert member.fetch_all([missed_id], 1, timeout=10)[missed_id] is not None
    others, fetched = Matchmaker._missed_group(member_seam(missed, missed_id), 1, MISSED_GROUP_GRACE)  # type: ignore[arg-type]
    assert others == [member_id]
    assert fetched == {member_id: Fetched(b"theirs", 300.0, tuple(sorted([member_id, missed_id])))}


def test_after_a_failed_all_reduce_the_node_waits_for_its_slow_leader(
        pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    # the leader completes the all-reduce without our part only after its sender timeout, then fetches
    missed, member, missed_id, member_id = pair
    missed.offer(1, b"ours", 100.0)
    member.offer(1, b"theirs", 300.0)
    member.expect(1, [member_id, missed_id], member_id)
    late = threading.Timer(MISSED_GROUP_GRACE + 2, lambda: member.fetch_all([missed_id], 1, timeout=10))
    late.start()
    try:
        others, _ = Matchmaker._missed_group(member_seam(missed, missed_id, others_may_fetch=True), 1,
                                              MISSED_ALLREDUCE_GRACE)
    finally:
        late.join()
    assert others == [member_id]


def test_the_long_wait_ends_once_nobody_may_still_fetch(
        pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    missed, _, missed_id, _ = pair
    missed.offer(1, b"ours", 100.0)
    started = time.monotonic()
    assert Matchmaker._missed_group(member_seam(missed, missed_id), 1, MISSED_ALLREDUCE_GRACE) == ([], {})
    assert time.monotonic() - started < MISSED_GROUP_GRACE + 3


def test_a_node_nobody_counted_in_averages_alone(pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    missed, member, missed_id, member_id = pair
    missed.offer(1, b"ours", 100.0)
    member.offer(1, b"theirs", 300.0)
    member.expect(1, [member_id], member_id)
    assert Matchmaker._missed_group(member_seam(missed, missed_id), 1, MISSED_GROUP_GRACE) == ([], {})  # type: ignore[arg-type]


def test_the_recovery_takes_no_group_of_unverified_or_disagreeing_members(
        pair: tuple[PayloadExchange, PayloadExchange, str, str]) -> None:
    missed, member, missed_id, member_id = pair
    missed.offer(1, b"ours", 100.0)
    member.offer(1, b"theirs", 300.0)
    member.expect(1, [member_id, missed_id, "QmSybil"], member_id)  # names a member with no record
    assert member.fetch_all([missed_id], 1, timeout=10)[missed_id] is not None
    seam = member_seam(missed, missed_id, verified=lambda peer: peer != "QmSybil")
    assert Matchmaker._missed_group(seam, 1, MISSED_GROUP_GRACE) == ([], {})  # type: ignore[arg-type]
    # a fetcher without a verified record is not asked at all
    assert Matchmaker._missed_group(member_seam(missed, missed_id, verified=lambda _: False), 1,
                                    MISSED_GROUP_GRACE) == ([], {})  # type: ignore[arg-type]


def test_a_fetch_the_policy_refuses_gets_nothing() -> None:
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    asked: list[tuple[str, int, str, object]] = []

    def members_only(peer: str, round_: int, token: str, group: object) -> str | None:
        asked.append((peer, round_, token, group))
        return None if group and peer in group else "not a member of the round's group"

    offering = PayloadExchange(Streams(first), "xtest", 1 << 20, members_only)
    fetching = PayloadExchange(Streams(second), "xtest", 1 << 20, lambda *_: None, token="our-admission")
    offering.attach()
    fetching.attach()
    try:
        offering.offer(1, b"payload", 10.0)
        offering.expect(1, [str(first.peer_id), "QmSomeoneElse"], str(first.peer_id))
        assert fetching.fetch_all([str(first.peer_id)], 1, timeout=10) == {str(first.peer_id): None}
        group = tuple(sorted([str(first.peer_id), "QmSomeoneElse"]))
        assert asked == [(str(second.peer_id), 1, "our-admission", group)]
        assert offering.served(1, timeout=0.2) == set()
    finally:
        for exchange in (offering, fetching):
            exchange.detach()
            exchange.streams.close()
        second.shutdown()
        first.shutdown()


def test_state_downloads_are_served_bounded_and_refused() -> None:
    import torch

    from diloco_node.swarm.statesync import StateRefused, StateService

    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    hosts = [Streams(dht) for dht in (first, second)]
    phi, momentum = torch.arange(10, dtype=torch.float32), torch.ones(10)
    sharing = [True]
    server = StateService(hosts[0], "xtest", 10, 4,
                          lambda peer: ({"round": 3}, [phi, momentum]) if sharing[0] else None,
                          lambda peer, token: None if token == "admitted" else "not admitted")
    server.attach()

    def download(numel: int, token: str) -> tuple[dict, list[torch.Tensor]]:
        client = StateService(hosts[1], "xtest", numel, 4, lambda peer: None,
                              lambda peer, token: None, token=token)
        return hosts[1].run(client.download(str(first.peer_id), 10), 20)

    try:
        metadata, vectors = download(10, "admitted")
        assert metadata == {"round": 3} and torch.equal(vectors[0], phi) and torch.equal(vectors[1], momentum)
        with pytest.raises(StateRefused, match="not sharing"):
            download(10, "someone else's")
        with pytest.raises(StateRefused, match="vectors of the model's size"):  # a server of another model size
            download(5, "admitted")
        sharing[0] = False
        with pytest.raises(StateRefused, match="not sharing"):
            download(10, "admitted")
    finally:
        for host in hosts:
            host.close()
        second.shutdown()
        first.shutdown()


def test_a_state_download_says_how_far_it_has_got(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A joiner's download of φ and the momentum logs its progress (telemetry/progress.py): every
    read here, the interval made 0 (by default a line every 5 s of a download that long)."""
    import functools
    import logging

    import torch

    from diloco_node.swarm import statesync
    from diloco_node.telemetry.progress import Progress

    monkeypatch.setattr(statesync, "Progress", functools.partial(Progress, interval=0.0))
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    hosts = [Streams(dht) for dht in (first, second)]
    numel = 1 << 20  # 8 MB of φ and momentum
    server = statesync.StateService(hosts[0], "xprogress", numel, 4,
                                    lambda peer: ({"round": 3}, [torch.ones(numel), torch.zeros(numel)]),
                                    lambda peer, token: None)
    server.attach()
    client = statesync.StateService(hosts[1], "xprogress", numel, 4, lambda peer: None, lambda peer, token: None)
    seen: list[dict | None] = []  # what the status server shows (daemon/compose.py: state_download)
    client.watch(seen.append)
    try:
        with caplog.at_level(logging.INFO, logger="diloco_node.swarm.statesync"):
            hosts[1].run(client.download(str(first.peer_id), 30), 40)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("state download: ")]
        assert lines and lines[-1].startswith("state download: 8.4/8.4 MB at "), lines
        assert f"(peer={first.peer_id})" in lines[-1]
        # the status: growing bytes of the whole, a rate, the time left, and nothing once it ended
        assert seen[-1] is None and len(seen) > 2
        running = [s for s in seen if s is not None]
        assert [s["bytes"] for s in running] == sorted(s["bytes"] for s in running)
        assert running[-1]["bytes"] == running[-1]["total_bytes"] == 8 * numel
        assert all(s["peer"] == str(first.peer_id) and s["bytes_per_second"] > 0 for s in running)
        assert running[0]["seconds_left"] > 0 and running[-1]["seconds_left"] == 0
    finally:
        for host in hosts:
            host.close()
        second.shutdown()
        first.shutdown()


def test_a_state_download_begun_in_time_may_outlast_the_timeout_at_the_least_rate() -> None:
    """A joiner at a 4 Mbit/s download cap takes 4 MB in ~8 s, past a 3 s timeout: it arrives (the
    whole transfer once had to end within the timeout, so a 20M model's state at 4 Mbit/s, 5
    minutes, never did and the joiner started from its own φ)."""
    import torch

    from diloco_node.swarm.statesync import StateService
    from diloco_node.swarm.throttle import Throttle

    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    hosts = [Streams(first), Streams(second, Throttle(download=500_000))]
    numel = 1 << 19  # 4 MB of φ and momentum
    server = StateService(hosts[0], "xlong", numel, 4, lambda peer: ({"round": 3}, [torch.ones(numel)] * 2),
                          lambda peer, token: None)
    server.attach()
    client = StateService(hosts[1], "xlong", numel, 4, lambda peer: None, lambda peer, token: None)
    try:
        started = time.monotonic()
        metadata, vectors = hosts[1].run(client.download(str(first.peer_id), 3), 3 + client.longest_transfer())
        assert time.monotonic() - started > 3.5 and metadata["round"] == 3 and len(vectors) == 2
        assert all(bool((vector == 1).all()) for vector in vectors)
    finally:
        for host in hosts:
            host.close()
        second.shutdown()
        first.shutdown()


def test_a_fetch_is_retried_until_the_peer_can_be_reached() -> None:
    # a peer whose link just came back (or whose handler is not up yet) fails to open a stream for a
    # moment: dropping its payload at once would split φ from the members that did get it
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    fetching = PayloadExchange(Streams(second), "xtest", 1 << 20, lambda *_: None)
    fetching.attach()
    offering: list[PayloadExchange] = []

    def come_up() -> None:
        offering.append(PayloadExchange(Streams(first), "xtest", 1 << 20, lambda *_: None))
        offering[0].attach()
        offering[0].offer(1, b"late", 50.0)

    later = threading.Timer(2.0, come_up)
    later.start()
    try:
        fetched = fetching.fetch_all([str(first.peer_id)], 1, timeout=15)[str(first.peer_id)]
        assert fetched is not None and fetched.payload == b"late"
    finally:
        later.join()
        for exchange in [fetching, *offering]:
            exchange.detach()
            exchange.streams.close()
        second.shutdown()
        first.shutdown()


def test_a_second_state_request_from_one_peer_is_refused_while_its_first_is_served(caplog) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    import torch

    from diloco_node.swarm.statesync import StateRefused, StateService

    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    hosts = [Streams(dht) for dht in (first, second)]
    release = threading.Event()

    def slow_provider(peer: str) -> tuple[dict, list[torch.Tensor]]:
        release.wait(5)  # the first request holds its stream while we snapshot
        return {"round": 1}, [torch.zeros(10), torch.ones(10)]

    server = StateService(hosts[0], "xlimit", 10, 4, slow_provider, lambda peer, token: None)
    server.attach()
    client = StateService(hosts[1], "xlimit", 10, 4, lambda peer: None, lambda peer, token: None)

    async def both() -> list[object]:
        held = asyncio.ensure_future(client.download(str(first.peer_id), 20))
        await asyncio.sleep(1.0)
        second_try = await asyncio.gather(client.download(str(first.peer_id), 20), return_exceptions=True)
        release.set()
        return [await held, *second_try]

    try:
        with caplog.at_level("INFO", logger="diloco_node.swarm.statesync"):
            served, refused = hosts[1].run(both(), 40)
        assert isinstance(served, tuple) and torch.equal(served[1][1], torch.ones(10))
        assert isinstance(refused, StateRefused), refused
        assert f"refused a stream from peer={second.peer_id}: 1 of its streams open already" in caplog.text
    finally:
        for host in hosts:
            host.close()
        second.shutdown()
        first.shutdown()


def test_a_reader_slower_than_the_least_rate_is_cut_and_frees_its_serve_slot(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two readers at 0.1 MB/s held both serve slots for hours: a serve ends within SETUP_SECONDS +
    the state's bytes at STATE_LEAST_RATE (made small here), whatever the reader does."""
    import asyncio
    import json

    import torch

    from diloco_node.swarm import statesync
    from diloco_node.swarm.statesync import StateService
    from diloco_node.swarm.streams import receive, send

    monkeypatch.setattr(statesync, "SETUP_SECONDS", 1.0)
    monkeypatch.setattr(statesync, "STATE_LEAST_RATE", 2 * 1024 * 1024)  # 8 MB in 1 + 4 s at most
    first = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    hosts = [Streams(dht) for dht in (first, second)]
    numel = 1 << 20
    server = StateService(hosts[0], "xslow", numel, 4, lambda peer: ({"round": 1}, [torch.zeros(numel)] * 2),
                          lambda peer, token: None)
    server.attach()
    client = StateService(hosts[1], "xslow", numel, 4, lambda peer: None, lambda peer, token: None)

    async def slow_reader() -> tuple[int, float]:
        reader, writer = await client._open(str(first.peer_id), server.name, 10)
        await send(writer, json.dumps({"admission": ""}).encode())
        await receive(reader, 1 << 16, 10)
        started, got = asyncio.get_running_loop().time(), 0
        while chunk := await reader.read(16 * 1024):  # 0.16 MB/s: a drip
            got += len(chunk)
            await asyncio.sleep(0.1)
        return got, asyncio.get_running_loop().time() - started

    try:
        got, seconds = hosts[1].run(slow_reader(), 60)
        assert got < 8 * numel and seconds < 15, (got, seconds)
        assert server._serving == 0
    finally:
        for host in hosts:
            host.close()
        second.shutdown()
        first.shutdown()
