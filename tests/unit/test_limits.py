"""Limits on what a peer can make a node do: bounded JSON, per-peer stream limits, bounded tables,
record and revocation validators, state metadata checked against the serving peer and the records,
and handler messages refused at the boundary (docs/architecture.md §9)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_node.swarm import messages, records
from diloco_node.swarm.hosts import UNKNOWN_HOST, host_group, host_of
from diloco_node.swarm.reachability import DialBack
from diloco_node.swarm.records import RunValidator
from diloco_node.swarm.statesync import (
    Admission,
    StateRefused,
    parse_header,
    parse_request,
)
from diloco_node.swarm.streams import Limits, LRUSet, StreamLimits, parse_json
from diloco_node.trust import records as trust_records
from diloco_node.trust.admission import Claims, sign
from diloco_node.trust.records import NodeRecord
from diloco_node.trust.state import metadata_refusal, servers_in_order

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
OTHER = "QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"


# --- bounded JSON ---------------------------------------------------------------------------------

def test_nested_json_within_any_size_limit_is_refused_before_parsing() -> None:
    for deep in (b"[" * 60000 + b"]" * 60000, b'{"a":' * 20000 + b"1" + b"}" * 20000, b"[" * 9):
        with pytest.raises(ValueError, match="nested deeper"):
            parse_json(deep)
    assert parse_json(b'{"a": [[1, {"b": "[[[[[[[[[[[["}]]}') == {"a": [[1, {"b": "[[[[[[[[[[[["}]]}
    assert parse_json(b"[" * 8 + b"]" * 8) == [[[[[[[[]]]]]]]]


@pytest.mark.parametrize("text", [b'{"tokens": Infinity}', b"NaN", b"[-Infinity]", b"1" * 5000, b"\xff\xfe",
                                  b"", b"{", b'{"a": 1}}'])
def test_json_a_node_never_sends_is_refused_as_value_error(text: bytes) -> None:
    with pytest.raises(ValueError):
        parse_json(text)


JSON_ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]


NESTS = ["[" * 10000 + "]" * 10000, '{"a":' * 5000 + "1" + "}" * 5000]
# A nest between strings whose characters hold a quote byte (U+2200 is 22 00 in UTF-16-BE): a scan of
# the raw bytes saw a string around the nest where json.loads, decoding UTF-16 itself, sees none
DISGUISED = ['["\u2200", {nest}, "\u2200"]', '{{"\u5c22": {nest}, "x": "\u2200"}}']


@pytest.mark.parametrize("encoding", JSON_ENCODINGS)
@pytest.mark.parametrize("deep", NESTS + [wrap.format(nest=nest) for wrap in DISGUISED for nest in NESTS])
def test_a_deep_nest_in_any_encoding_json_accepts_is_refused_as_value_error(encoding: str, deep: str) -> None:
    """docs/architecture.md §9: json.loads decodes UTF-16 and UTF-32 bytes itself, which a depth
    check on the raw bytes missed (a 20 KB body raised RecursionError): ValueError, never that."""
    with pytest.raises(ValueError):
        parse_json(deep.encode(encoding))


@pytest.mark.parametrize("encoding", JSON_ENCODINGS[1:])
def test_json_in_any_encoding_but_utf8_is_refused(encoding: str) -> None:
    """Our messages are UTF-8 without a BOM: anything else is no message of ours."""
    assert parse_json(b'{"round": 3}') == {"round": 3}
    with pytest.raises(ValueError):
        parse_json('{"round": 3}'.encode(encoding))


def test_the_depth_scan_is_linear_in_the_message() -> None:
    """Unterminated strings (`"\\"\\"…`) once made the scan quadratic: seconds of CPU per 20 KB."""
    for body in (b'"' + b'\\"' * 131072, b'["' + b'\\"' * 131072 + b'[' * 50):
        started = time.process_time()
        with pytest.raises(ValueError):
            parse_json(body)
        assert time.process_time() - started < 1.0


# --- stream limits ----------------------------------------------------------------------------

def test_one_peer_holds_at_most_its_share_of_streams_and_requests() -> None:
    limits = StreamLimits(Limits(per_peer=2, total=3, rate=1.0, burst=3.0, reserved=0, per_host=3))
    assert limits.admit(PEER, now=0.0) is None and limits.admit(PEER, now=0.0) is None
    assert "2 of its streams open" in str(limits.admit(PEER, now=0.0))
    limits.release(PEER)
    assert limits.admit(PEER, now=0.0) is None  # the third of its burst
    limits.release(PEER)
    assert "requests/s" in str(limits.admit(PEER, now=0.1))  # burst spent, not refilled yet
    assert limits.admit(PEER, now=1.2) is None  # a second later: one more
    assert limits.admit(OTHER, now=1.2) is None
    assert "3 streams open" in str(limits.admit("QmFresh", now=1.2))  # fresh ids share the total
    for peer in (PEER, PEER, OTHER):
        limits.release(peer)
    assert limits.open_streams() == 0


def test_the_table_of_peers_forgets_the_oldest_beyond_its_capacity() -> None:
    limits = StreamLimits(Limits(rate=0.0, burst=1.0), capacity=10)
    for index in range(100):
        assert limits.admit(f"peer{index}", now=0.0) is None
        limits.release(f"peer{index}")
    assert len(limits._buckets) == 10 and limits.open_streams() == 0
    assert limits.admit("peer99", now=0.0) is not None  # the recent ones are remembered
    seen = LRUSet(capacity=5)
    for index in range(50):
        seen.add(("peer", str(index)))
    assert len(seen) == 5 and ("peer", "49") in seen and ("peer", "0") not in seen


# --- records and revocations in the DHT ---------------------------------------------------------

def _record(key: str, subkey: object, value: object) -> DHTRecord:
    serialize = DHTProtocol.serializer.dumps
    return DHTRecord(DHTID.generate(source=key).to_bytes(), serialize(subkey), serialize(value), get_dht_time() + 60)


def test_only_the_run_owners_revocations_are_stored() -> None:
    owner, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    validator = RunValidator("run", owner.public_key())
    key = records.revocations_key("run")
    assert validator.validate(_record(key, sign(owner, Claims("revoke", "run", PEER)), True))
    for junk in (sign(stranger, Claims("revoke", "run", PEER)), sign(owner, Claims("admit", "run", PEER)),
                 sign(owner, Claims("revoke", "other", PEER)), "junk", 12345, "x" * 5000):
        assert not validator.validate(_record(key, junk, True))
    assert not RunValidator("run", None).validate(_record(key, sign(owner, Claims("revoke", "run", PEER)), True))
    assert validator.validate(_record("someone_elses_key", "junk", "anything"))  # not the run's keys


def test_a_record_of_the_run_is_bounded_field_by_field_and_in_bytes() -> None:
    good = NodeRecord(PEER, "0123456789abcdef", 3, 2, "0123456789abcdef").to_wire()
    assert NodeRecord.from_wire(good) is not None
    for field, value in (("digest", "d" * 3_000_000), ("fingerprint", "f" * 65), ("peer_id", "p" * 65),
                         ("round", 10**30), ("served_round", -2), ("vouched", ["v" * 100])):
        assert NodeRecord.from_wire({**good, field: value}) is None, field
    assert NodeRecord.from_wire({**good, "stats": {**good["stats"], "bytes_sent": 2**70}}) is None
    validator = RunValidator("run", None)
    key = records.records_key("run")
    assert validator.validate(_record(key, "subkey", good))
    assert not validator.validate(_record(key, "subkey", {**good, "digest": "d" * 3_000_000}))
    assert not validator.validate(_record(records.configs_key("run"), "fp", {"x": "y" * 40000}))


# --- state downloads ---------------------------------------------------------------------------

def _serving(peer: str, round_: int) -> NodeRecord:
    return NodeRecord(peer, "fp", round_, round_ - 1, "d", served_round=round_, served_digest="s")


def test_state_metadata_must_name_the_peer_that_served_it_and_a_round_the_records_show() -> None:
    others = {PEER: _serving(PEER, 7), OTHER: _serving(OTHER, 7)}
    good = {"round": 7, "server": PEER, "fingerprint": "fp", "has_momentum": True, "in_flight": [6]}
    assert metadata_refusal(good, PEER, others) is None
    assert "names another server" in str(metadata_refusal({**good, "server": OTHER}, PEER, others))
    assert metadata_refusal({**good, "round": 7 + 16}, PEER, others) is None  # records lag a fast node
    assert "far ahead" in str(metadata_refusal({**good, "round": 7 + 17}, PEER, others))
    assert "far ahead" in str(metadata_refusal({**good, "round": 30}, PEER, {PEER: _serving(PEER, 7)}))
    assert "malformed round" in str(metadata_refusal({**good, "round": 10**30}, PEER, others))
    assert "malformed round" in str(metadata_refusal({**good, "round": True}, PEER, others))
    assert "in flight" in str(metadata_refusal({**good, "in_flight": [7]}, PEER, others))
    assert "in flight" in str(metadata_refusal({**good, "in_flight": list(range(7)) * 2}, PEER, others))
    assert "momentum" in str(metadata_refusal({**good, "has_momentum": "yes"}, PEER, others))
    assert "no record" in str(metadata_refusal(good, PEER, {OTHER: _serving(OTHER, 7)}))
    # a server whose own record claims a huge round gets no further than the other nodes' records
    liar = {**others, PEER: _serving(PEER, 10**6), "third": _serving("third", 7)}
    assert "far ahead" in str(metadata_refusal({**good, "round": 10**6}, PEER, liar))
    assert servers_in_order(liar, None)[-1] == PEER


def test_a_state_answer_that_nests_or_lies_is_refused_in_one_line() -> None:
    nested = json.dumps({"sharing": True, "vectors": 2, "metadata": {"x": 1}}).encode()[:-1] + b"," + \
        b'"deep": ' + b"[" * 30000 + b"]" * 30000 + b"}"
    for answer, why in ((nested, "nested deeper"), (b'{"sharing": true, "vectors": true, "metadata": {}}', "vectors"),
                        (b'{"sharing": true, "vectors": 2}', "no metadata"), (b"[1]", "not sharing"),
                        (b'{"sharing": true, "vectors": 99, "metadata": {}}', "vectors")):
        with pytest.raises(StateRefused, match=why) as refused:
            parse_header(answer, max_vectors=4)
        assert "\n" not in str(refused.value) and len(str(refused.value)) < 200
    assert parse_header(b'{"sharing": true, "vectors": 2, "metadata": {"round": 1}}', 4) == ({"round": 1}, 2)
    assert parse_request(b'{"admission": "t"}') == Admission("t")
    assert parse_request(b"[" * 5000) == "malformed request"
    assert parse_request(b'{"admission": 5}') == "malformed request"


# --- handler messages ----------------------------------------------------------------------------

def test_a_push_declaring_infinite_or_negative_tokens_is_refused() -> None:
    push = {"round": 3, "part": 1, "group": [PEER, OTHER], "tokens": 10.0, "norm": 1.5, "admission": ""}
    assert isinstance(messages.parse_push(json.dumps(push).encode()), messages.Push)
    for bad in ({"tokens": 1e308 * 10}, {"tokens": -1}, {"norm": float("nan")}, {"part": 2}, {"part": True},
                {"group": [PEER, PEER]}, {"round": -1}, {"round": 2**41}, {"admission": 7}):
        text = json.dumps({**push, **bad}).encode()
        assert isinstance(messages.parse_push(text), str), bad


def test_an_owner_report_of_the_wrong_shape_is_refused() -> None:
    assert messages.parse_report(b'{"used": ["a", "b"], "tokens": [1.0, 2], "clipped": [], "rejected": ["c"]}')
    for bad in (b'{"used": 5}', b'{"used": ["a"], "tokens": []}', b'{"used": ["a"], "tokens": [Infinity]}',
                b'{"clipped": [1]}', b'{"parts": 0}', b'{"group": "ab"}', b"[]", b'{"used": ["a"], "tokens": ["1"]}'):
        with pytest.raises(ValueError):
            messages.parse_report(bad)


def test_dial_back_goes_only_to_the_askers_own_host() -> None:
    assert host_of("/ip4/203.0.113.7/tcp/31337") == "203.0.113.7"
    assert host_of("/ip4/203.0.113.7/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N/p2p-circuit") is None
    assert host_of("/dns4/example.org/tcp/1") is None and host_of("nonsense") is None and host_of(None) is None
    assert messages.parse_dial_back(json.dumps({"addresses": ["a"] * 20}).encode(), 8) == ["a"] * 8
    assert isinstance(messages.parse_dial_back(b'{"addresses": [1]}', 8), str)


def test_dial_back_answers_an_asker_behind_a_nat_without_dialling_other_hosts() -> None:
    """Its addresses are on a LAN, its connection comes from the router's public address: unreachable,
    and nothing on the LAN (another host, from where we stand) is dialled."""
    lan = ["/ip4/10.1.2.3/tcp/4000", "/ip6/fd00::3/tcp/4000"]
    assert asyncio.run(DialBack._dial_own("203.0.113.7", lan)) == [False]
    assert asyncio.run(DialBack._dial_own("2001:db8::7", lan[:1])) == []  # only another family: cannot tell
    assert asyncio.run(DialBack._dial_own(None, lan)) == []  # relayed: cannot tell


def test_record_round_and_message_round_bounds_agree() -> None:
    # one bound for a round everywhere: records and state metadata (trust/state.py reads the records'), handler messages
    assert trust_records.MAX_ROUND == messages.MAX_ROUND


def test_a_capped_transfer_lowers_the_least_rate_a_download_keeps_but_not_without_bound():
    from diloco_node.swarm.statesync import LEAST_RATE, STATE_LEAST_RATE, announced_rate, least_rate

    assert least_rate(None, 0) == LEAST_RATE  # nobody capped
    assert least_rate(375_000.0, 0) == 187_500  # a server at 6 Mbit/s shared by two joiners
    assert least_rate(None, 300_000) == 150_000  # our own download cap
    assert least_rate(10.0, 0) == STATE_LEAST_RATE  # a server's word cannot make a drip acceptable
    assert least_rate(125_000.0, 0) == STATE_LEAST_RATE  # 1 Mbit/s: the floor of our choosing, whoever says
    assert least_rate(10 ** 9, 10 ** 9) == LEAST_RATE
    assert announced_rate(b'{"sharing": true, "rate": 125000}') == 125_000
    for header in (b'{"rate": -1}', b'{"rate": true}', b'{"rate": "1"}', b'[1]', b'not json', b'{}'):
        assert announced_rate(header) is None


def test_a_handler_cancelled_by_a_stop_ends_quietly_and_frees_its_slot() -> None:
    """A stop cancels the handlers that run: the wrapper ends the stream and returns, since a cancelled
    handler task makes asyncio log a traceback from hivemind's stream callback."""
    from diloco_node.swarm.streams import StreamService

    closed: list[bool] = []

    class Serving(StreamService):
        async def _serve(self, info, reader, writer) -> None:  # type: ignore[no-untyped-def]
            raise asyncio.CancelledError

    unpaced = SimpleNamespace(reader=lambda r: r, writer=lambda w: w)
    uncounted = SimpleNamespace(count=lambda *_, **__: None)
    streams = SimpleNamespace(p2p=None, loop=None, throttle=unpaced, traffic=uncounted, trusted=lambda peer: False)
    service = Serving(streams, "test")  # type: ignore[arg-type]
    writer = SimpleNamespace(close=lambda: closed.append(True))
    assert asyncio.run(service._limited(service._serve)(SimpleNamespace(peer_id="p"), None, writer)) is None
    assert closed == [True] and service._limits.open_streams() == 0


_HOSTS: dict[str, int] = {}


def _stream_info(peer: str, host: str | None = None):  # type: ignore[no-untyped-def]
    """A handler's view of a stream from `peer`, whose connection comes from `host` (by default a
    host of its own: one per peer name)."""

    if host is None:
        n = _HOSTS.setdefault(peer, len(_HOSTS))
        host = f"10.{n // 250}.{n % 250}.1"
    return SimpleNamespace(peer_id=peer, addr=f"/ip4/{host}/tcp/4001")


async def _settle() -> None:
    """Every task that can go on goes as far as it can."""
    for _ in range(20):
        await asyncio.sleep(0)


def _framed(n: int) -> bytes:
    """One message of a stream: {"n": n}, length-prefixed."""
    body = json.dumps({"n": n}).encode()
    return len(body).to_bytes(8, "big") + body


def _open(service, info, data: bytes = b"") -> asyncio.Task[None]:  # type: ignore[no-untyped-def]
    """A stream of `info` (_stream_info) to `service`'s limited handler, `data` already in it."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    return asyncio.ensure_future(service._limited(service._serve)(info, reader, SimpleNamespace(close=lambda: None)))


def _silent_service(total: int, reserved: int = 0, trusted=lambda peer: False,  # type: ignore[no-untyped-def]
                    per_host: int | None = None):
    """A service whose handler reads one message and then holds the stream until `release` is set,
    over fake unpaced streams; `reserved` of its streams for peers `trusted` says yes to."""
    from diloco_node.swarm.streams import StreamService, receive

    answered: list[bytes] = []
    release = asyncio.Event()

    class Echo(StreamService):
        async def _serve(self, info, reader, writer) -> None:  # type: ignore[no-untyped-def]
            answered.append(await receive(reader, 1024, timeout=30))
            await release.wait()

    unpaced = SimpleNamespace(reader=lambda r: r, writer=lambda w: w)
    uncounted = SimpleNamespace(count=lambda *_, **__: None)
    streams = SimpleNamespace(p2p=None, loop=None, throttle=unpaced, traffic=uncounted, trusted=trusted)
    service = Echo(streams, "echo", Limits(per_peer=4, total=total, rate=100.0, burst=100.0,  # type: ignore[arg-type]
                                           reserved=reserved, per_host=per_host))
    return service, answered, release


def test_silent_streams_cannot_hold_every_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 fresh ids x 4 streams that never send a byte took all 64 slots (each held 10 s + 10 s), and
    honest fetches closed with 0 bytes: once every slot is taken, the stream silent longest is closed
    for a new one; a stream whose first message is in, or silent for less than the grace, never is."""
    from diloco_node.swarm import streams as streams_module

    async def scenario() -> None:
        service, answered, release = _silent_service(total=64)
        closed: list[str] = []

        def opened(peer: str, data: bytes = b"") -> tuple[asyncio.Task[None], asyncio.StreamReader]:
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            writer = SimpleNamespace(close=lambda: closed.append(peer))
            handler = service._limited(service._serve)
            return asyncio.ensure_future(handler(_stream_info(peer), reader, writer)), reader

        def message(n: int) -> bytes:
            body = json.dumps({"n": n}).encode()
            return len(body).to_bytes(8, "big") + body

        clock = [1000.0]
        monkeypatch.setattr(streams_module.time, "monotonic", lambda: clock[0])
        async def settle() -> None:  # every task that can go on goes as far as it can
            for _ in range(20):
                await asyncio.sleep(0)

        silent = [opened(f"sybil{i // 4}") for i in range(64)]
        await settle()
        assert service._limits.full()
        clock[0] += 0.5  # within the grace: a full service refuses
        early, _ = opened("early", message(-1))
        await settle()
        assert early.done() and "early" in closed and answered == []
        clock[0] += streams_module.SILENT_GRACE_SECONDS
        honest = [opened(f"honest{n}", message(n)) for n in range(3)]  # each takes a silent stream's slot
        await settle()
        assert sorted(json.loads(m)["n"] for m in answered) == [0, 1, 2]
        assert [index for index, (task, _) in enumerate(silent) if task.done()] == [0, 1, 2]  # the oldest
        assert service._limits.open_streams() == 64
        # a header without its body is still silent; a whole first message is not
        for _, reader in silent[3:]:
            reader.feed_data((4).to_bytes(8, "big"))
        for _, reader in silent[3:33]:
            reader.feed_data(b"1234")
        await settle()
        clock[0] += streams_module.SILENT_GRACE_SECONDS
        late = [opened(f"late{n}", message(10 + n)) for n in range(40)]
        await settle()
        assert sum(task.done() for task, _ in silent[3:33]) == 0  # spoken: kept
        assert all(task.done() for task, _ in silent[33:])  # half-spoken: closed for late ones
        assert sum(not task.done() for task, _ in late) == 31 and service._limits.open_streams() == 64
        release.set()
        await asyncio.gather(*(task for task, _ in [*honest, *silent, *late]))
        assert service._limits.open_streams() == 0 and service._streams_served == []
        assert len(answered) == 3 + 30 + 31

    asyncio.run(scenario())


@pytest.mark.parametrize("chunks", [[b"\x00" * 8 + b"abc"], [b"\x00" * 3, b"\x00" * 4, b"\x03ab", b"c"],
                                    [b"\x00" * 7, b"\x03", b"ab", b"c, then more"]])
def test_a_stream_stops_being_silent_once_its_first_message_is_in(chunks: list[bytes]) -> None:
    from diloco_node.swarm.streams import SilenceWatch

    async def scenario() -> bool:
        raw = asyncio.StreamReader()
        watch = SilenceWatch(raw)
        for chunk in chunks[:-1]:
            raw.feed_data(chunk)
            await watch.readexactly(len(chunk))
            assert watch.silent
        raw.feed_data(chunks[-1])
        await watch.read(len(chunks[-1]))
        return watch.silent

    assert asyncio.run(scenario()) is False


def test_strangers_rotating_fresh_ids_never_take_the_slots_of_peers_we_trust(monkeypatch: pytest.MonkeyPatch) -> None:
    """100 fresh ids open 64 silent streams every second, each one just past the grace when the next
    wave comes: every slot a stranger may take is always young or taken, and 0 of 10 honest fetches
    were served. The slots `reserved` are for peers we trust (proven, anchors, joiners we served,
    our groups' members: facade._trusted), and strangers' waves never reach them."""
    from diloco_node.swarm import streams as streams_module

    async def scenario() -> None:
        service, answered, release = _silent_service(total=64, reserved=16,
                                                      trusted=lambda peer: peer.startswith("member"))
        clock = [1000.0]
        monkeypatch.setattr(streams_module.time, "monotonic", lambda: clock[0])
        tasks = []

        wave = 0
        for second in range(10):
            clock[0] += streams_module.SILENT_GRACE_SECONDS
            for _ in range(64):
                tasks.append(_open(service, _stream_info(f"sybil{wave % 100}")))
                wave += 1
            await _settle()
            assert service._limits._strangers <= 64 - 16
            clock[0] += 0.01
            tasks.append(_open(service, _stream_info(f"member{second}"), _framed(second)))
            await _settle()
        assert sorted(json.loads(m)["n"] for m in answered) == list(range(10))
        release.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_the_strangers_of_one_host_hold_at_most_their_share() -> None:
    limits = StreamLimits(Limits(per_peer=4, total=16, rate=100.0, burst=100.0, reserved=4))
    assert limits.limits.per_host == 2  # a sixth of the strangers' 12
    for n in range(2):
        assert limits.admit(f"fresh{n}", now=0.0, host="203.0.113.9") is None
    assert "from its host" in str(limits.admit("fresh3", now=0.0, host="203.0.113.9"))
    assert limits.admit("local", now=0.0, host=None) is None  # our own machine: in no group
    assert limits.admit("other", now=0.0, host="198.51.100.20") is None  # another host's stranger
    assert limits.admit("member", now=0.0, trusted=True, host="203.0.113.9") is None  # trust is not by host
    limits.release("fresh0", host="203.0.113.9")
    assert limits.admit("fresh4", now=0.0, host="203.0.113.9") is None
    with pytest.raises(ValueError):
        Limits(total=16, reserved=4, per_host=13)


@pytest.mark.parametrize(("address", "group"), [
    ("/ip4/203.0.113.7/tcp/31337", "203.0.113.7"),
    ("/ip6/2001:db8:1:2:3:4:5:6/tcp/1", "2001:db8:1::/48"),
    ("/ip6/2001:db8:1:ff:ffff::1/tcp/1", "2001:db8:1::/48"),  # a fresh /64 per id within a site's /48 buys nothing
    ("/ip6/::ffff:203.0.113.7/tcp/1", "203.0.113.7"),  # IPv4 on a dual-stack socket: not one group for all
    ("/ip4/203.0.113.7/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N/p2p-circuit", "relay 203.0.113.7"),
    ("/ip4/127.0.0.1/tcp/1", None), ("/ip6/::1/tcp/1", None),  # our own machine: in no group
    ("/ip4/127.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N/p2p-circuit", "relay 127.0.0.1"),
    ("/dns4/example.org/tcp/1", UNKNOWN_HOST), ("nonsense", UNKNOWN_HOST), (None, UNKNOWN_HOST), (7, UNKNOWN_HOST),
])
def test_a_connection_counts_against_its_address_its_ipv6_48_or_its_relay(address: object, group: str | None) -> None:
    assert host_group(address) == group


@settings(max_examples=2000, deadline=None)
@given(address=st.one_of(st.text(max_size=120), st.binary(max_size=120),
                         st.builds(lambda ip, tail: f"/ip4/{ip}{tail}", st.text(max_size=20), st.text(max_size=60)),
                         st.builds(lambda ip, tail: f"/ip6/{ip}{tail}", st.text(max_size=40), st.text(max_size=60))))
def test_any_address_text_has_one_host_group(address: object) -> None:
    """The address comes from the p2p daemon, yet a relay or a daemon of another version may hand us
    anything: every text names a group (or our own machine) and nothing raises."""
    assert host_group(address) is None or isinstance(host_group(address), str)


def test_a_host_at_its_share_closes_only_its_own_silent_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger whose host holds its share takes the place of that host's stream silent longest,
    once past the grace; another host's silent stream, older still, is never touched for it."""
    from diloco_node.swarm import streams as streams_module

    async def scenario() -> None:
        service, answered, release = _silent_service(total=16, reserved=4)  # per_host 2
        clock = [1000.0]
        monkeypatch.setattr(streams_module.time, "monotonic", lambda: clock[0])
        tasks: dict[str, asyncio.Task[None]] = {}

        def opened(peer: str, host: str, data: bytes = b"") -> None:
            tasks[peer] = _open(service, _stream_info(peer, host), data)

        opened("other", "198.51.100.1")  # silent, and the oldest of all
        clock[0] += 0.1
        opened("sybil0", "203.0.113.9")
        clock[0] += 0.1
        opened("sybil1", "203.0.113.9")
        await _settle()
        opened("early", "203.0.113.9", _framed(1))  # within the grace: refused
        await _settle()
        assert tasks["early"].done() and answered == []
        clock[0] += streams_module.SILENT_GRACE_SECONDS
        opened("late", "203.0.113.9", _framed(1))
        await _settle()
        assert [json.loads(m)["n"] for m in answered] == [1]
        assert tasks["sybil0"].done() and not tasks["sybil1"].done() and not tasks["other"].done()
        assert service._limits._hosts == {"203.0.113.9": 2, "198.51.100.1": 1}
        release.set()
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert service._limits._hosts == {} and service._limits.open_streams() == 0

    asyncio.run(scenario())


def test_fresh_ids_of_one_host_never_keep_a_stranger_of_another_from_our_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state service's limits (statesync.STATE_LIMITS): 100 fresh ids from one host open 16
    silent streams every second, each just past the grace when the next wave comes. Before, they
    kept every one of the 12 slots strangers share young, and an open run's joiner (a stranger: its
    record is free) was refused every time. Its host's share is a sixth of those slots."""
    from diloco_node.swarm import streams as streams_module
    from diloco_node.swarm.statesync import STATE_LIMITS

    async def scenario() -> None:
        service, answered, release = _silent_service(total=STATE_LIMITS.total, reserved=STATE_LIMITS.reserved)
        clock = [1000.0]
        monkeypatch.setattr(streams_module.time, "monotonic", lambda: clock[0])
        tasks = []
        wave = 0
        for second in range(8):  # 8 joiners held open beside the sybils' 2: within the 12
            clock[0] += streams_module.SILENT_GRACE_SECONDS
            for _ in range(STATE_LIMITS.total):
                tasks.append(_open(service, _stream_info(f"sybil{wave % 100}", host="203.0.113.9")))
                wave += 1
            await _settle()
            assert service._limits._hosts["203.0.113.9"] <= STATE_LIMITS.per_host
            clock[0] += 0.01
            tasks.append(_open(service, _stream_info(f"joiner{second}", host=f"198.51.100.{20 + second}"),
                               _framed(second)))
            await _settle()
        assert sorted(json.loads(m)["n"] for m in answered) == list(range(8))
        release.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


@pytest.mark.parametrize("permissioned", [False, True])
def test_a_node_with_a_record_takes_the_reserved_slots_only_in_a_permissioned_run(permissioned: bool) -> None:
    """A joiner is proven to nobody yet: in an open run its record is free and it stays a stranger;
    in a permissioned run its record carries the owner's admission, so strangers rotating fresh ids
    cannot keep it from our state (facade._trusted)."""
    from diloco_node.swarm.facade import Swarm

    records = {"joiner": object()}
    facade = SimpleNamespace(
        gate=SimpleNamespace(permissioned=permissioned),
        _exchange=SimpleNamespace(in_group=lambda peer: False),
        _presence=SimpleNamespace(proofs=SimpleNamespace(proven=lambda: set()), anchors=set(),
                                  vouched=lambda peer: False, known=records.get))
    assert Swarm._trusted(facade, "joiner") is permissioned  # type: ignore[arg-type]
    assert Swarm._trusted(facade, "sybil") is False  # type: ignore[arg-type]
