"""How a node completes a round its state's server had in flight (Transfer.group_of): from the
payloads of the whole group the server names, ours included when we averaged in that round (an
eager re-sync while our own exchange runs), and never from fewer. The exchange is a stand-in for
its seam: the payloads each peer offers."""

from __future__ import annotations

from typing import Any

from diloco_node.round import Outcome
from diloco_node.swarm.dht import SwarmSettings
from diloco_node.swarm.exchange import Fetched
from diloco_node.swarm.transfer import Transfer

GROUP = ("a", "b", "me")


class Exchange:
    """Each peer's offer of round 7; `gone`: peers whose offer cannot be fetched."""

    def __init__(self, gone: tuple[str, ...] = (), forming: int = 0) -> None:
        """`forming`: how many asks find the group not formed yet."""
        self.gone, self.forming = gone, forming
        self.payloads_fetched: list[str] = []

    def offered(self, peer: str) -> Fetched:
        return Fetched(peer.encode(), 10.0, GROUP)

    def fetch_all(self, peers: list[str], round_: int, timeout: float,
                  group_only: bool = False) -> dict[str, Fetched | None]:
        if not group_only:
            self.payloads_fetched += peers
        fetched: dict[str, Fetched | None] = {}
        for peer in peers:
            offer = None if peer in self.gone else self.offered(peer)
            if offer is not None:
                offer = Fetched(b"" if group_only else offer.payload, offer.tokens,
                                None if self.forming else offer.group)
            fetched[peer] = offer
        self.forming = max(self.forming - 1, 0)
        return fetched

    def own(self, round_: int) -> Fetched | None:
        return None if "me" in self.gone else self.offered("me")


class Presence:
    """The run's records as we read them: every peer is a node of the run but `strangers`;
    `appearing`: peers whose record a fresh read finds (Presence.strangers_in reads once when one
    is missing)."""

    def __init__(self, strangers: tuple[str, ...] = (), appearing: tuple[str, ...] = ()) -> None:
        self.strangers, self.appearing, self.reads = set(strangers) | set(appearing), set(appearing), 0

    def strangers_in(self, group: tuple[str, ...]) -> list[str]:
        if any(peer in self.strangers for peer in group if peer != "me"):
            self.reads += 1
            self.strangers -= self.appearing
        return [peer for peer in group if peer != "me" and peer in self.strangers]


def transfer(exchange: Exchange, presence: Presence | None = None) -> Transfer:
    settings = SwarmSettings("run", "fp", {}, [], [], [], 1.0, 1.0, 1 << 20)
    return Transfer(settings, "me", False, 4, presence or Presence(), None, exchange, None)  # type: ignore[arg-type]


def payloads(gathered: Any) -> dict[str, bytes]:
    return {peer: payload for peer, (payload, _) in gathered.payloads.items()}


def test_a_round_we_averaged_in_is_completed_with_our_own_payload() -> None:
    gathered = transfer(Exchange()).group_of(7, "a")
    assert gathered.outcome == Outcome.TOGETHER
    assert payloads(gathered) == {"a": b"a", "b": b"b", "me": b"me"}


def test_a_group_missing_a_payload_is_not_completed_with_fewer() -> None:
    for gone in (("b",), ("me",)):  # another member's offer is gone, or ours (a restarted process)
        gathered = transfer(Exchange(gone)).group_of(7, "a")
        assert gathered.outcome == Outcome.ALONE and not gathered.payloads


def test_polling_for_a_group_being_formed_moves_no_payload(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each poll for the server's group used to fetch its whole payload (53 MB of a 1.6 MB payload
    through one 20-s matchmaking); now the polls ask for the group only, and each member's payload
    is fetched once, when the group is known."""
    from diloco_node.swarm import transfer as transfer_module

    monkeypatch.setattr(transfer_module, "GROUP_POLL_SECONDS", 0.0)
    exchange = Exchange(forming=5)
    gathered = transfer(exchange).group_of(7, "a")
    assert payloads(gathered) == {"a": b"a", "b": b"b", "me": b"me"}
    assert sorted(exchange.payloads_fetched) == ["a", "b"]


class HugeGroup(Exchange):
    """A server naming a group of `size` ids (MAX_GROUP, 256, is what a message may carry)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.group = ("a", *(f"fake-{i:03d}" for i in range(size - 1)))

    def offered(self, peer: str) -> Fetched:
        return Fetched(peer.encode(), 10.0, self.group)


def test_a_catch_up_group_larger_than_the_runs_is_refused_before_any_payload_is_fetched() -> None:
    """A server's in-flight group may name 256 ids, each fetched and decoded at once: the group is
    refused when it names more than the run's bound (NoLoCo: --group-size; DiLoCo: MAX_RUN_GROUP)."""
    from diloco_node.swarm.messages import MAX_GROUP
    from diloco_node.swarm.transfer import MAX_RUN_GROUP

    huge = HugeGroup(MAX_GROUP)
    gathered = transfer(huge).group_of(7, "a")
    assert gathered.outcome == Outcome.ALONE and huge.payloads_fetched == []
    at_bound = HugeGroup(MAX_RUN_GROUP)
    assert transfer(at_bound).group_of(7, "a").outcome == Outcome.TOGETHER  # an honest group at the bound
    assert len(at_bound.payloads_fetched) == MAX_RUN_GROUP
    noloco = Transfer(SwarmSettings("run", "fp", {}, [], [], [], 1.0, 1.0, 1 << 20, group_size=4), "me", False, 4,
                      Presence(), None, HugeGroup(5), None)  # type: ignore[arg-type]
    assert noloco.group_bound() == 4 and noloco.group_of(7, "a").outcome == Outcome.ALONE


def test_a_catch_up_group_naming_peers_we_do_not_know_is_refused_before_any_payload_is_fetched() -> None:
    """Within the bound, a server could still name 63 ids of its own making, each then fetched: every
    member must be a node of the run whose record we hold (read once more before refusing: one that
    joined since our last read is found)."""
    exchange, presence = HugeGroup(8), Presence(strangers=("fake-003",))
    assert transfer(exchange, presence).group_of(7, "a").outcome == Outcome.ALONE
    assert exchange.payloads_fetched == [] and presence.reads == 1  # one read, whatever the group names
    joined = Presence(appearing=("fake-003",))
    assert transfer(HugeGroup(8), joined).group_of(7, "a").outcome == Outcome.TOGETHER
    assert joined.reads == 1
    everyone = Presence()
    assert transfer(HugeGroup(8), everyone).group_of(7, "a").outcome == Outcome.TOGETHER
    assert everyone.reads == 0  # records we hold cost no read


def test_a_butterfly_round_is_completed_from_its_server_alone_though_a_member_left() -> None:
    """A butterfly round's averaged parts come from the server alone: a member that left since
    (its record expired while a slow state download ran) costs the joiner nothing, and the group
    is not read against our records (a refusal there refused the whole state downloaded)."""
    import asyncio
    from types import SimpleNamespace

    async def fetch_parts(peer: str, round_: int, timeout: float, max_group: int) -> Any:
        return GROUP, {0: (b"part", None)}

    presence = Presence(strangers=("b",))
    settings = SwarmSettings("run", "fp", {}, [], [], [], 1.0, 1.0, 1 << 20, butterfly_from=2)
    streams = SimpleNamespace(run=lambda coroutine, timeout: asyncio.run(coroutine))
    butterfly = Transfer(settings, "me", False, 4, presence, streams, Exchange(),  # type: ignore[arg-type]
                         SimpleNamespace(fetch_parts=fetch_parts))  # type: ignore[arg-type]
    gathered = butterfly.group_of(7, "a")
    assert gathered.outcome == Outcome.TOGETHER and presence.reads == 0


def test_the_members_of_a_named_group_cost_one_record_read_however_many() -> None:
    """Presence.strangers_in (matchmaking's groups, a catch-up group): a group naming 255 ids we do
    not know reads the run's records once, not once per id (each read parses up to 1,024 records
    under the DHT lock, on the round's thread)."""
    from types import SimpleNamespace

    from diloco_node.swarm.presence import Presence as RealPresence

    reads: list[int] = []
    records = {"a": object()}
    presence = SimpleNamespace(peer_id="me", known=records.get, _fetch=lambda: reads.append(1))
    group = ["me", "a", *(f"fake-{i:03d}" for i in range(254))]
    assert len(RealPresence.strangers_in(presence, group)) == 254  # type: ignore[arg-type]
    assert reads == [1]
    assert RealPresence.strangers_in(presence, ["me", "a"]) == [] and reads == [1]  # type: ignore[arg-type]
