"""Property-based fuzzing of every stream handler's parsing and validation (docs/architecture.md §9):
each pure function a handler runs on what a peer sent is driven with 10^4 adversarial inputs, and
nothing but its documented refusal may come out (a refusal value, or the one exception type its
caller turns into one log line). The network round-trips around these functions are covered by
tests/hostile/test_state_servers.py and tests/integration; here only the parsing, so 10^4 cases
each stay within seconds."""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_node.codec import CodecConfig, CodecError, make_codec, wire
from diloco_node.config import NodeConfig
from diloco_node.outer import verify
from diloco_node.swarm import manifests as manifest_wire
from diloco_node.swarm import messages, records
from diloco_node.swarm.exchange import _parse_meta
from diloco_node.swarm.records import RunValidator
from diloco_node.swarm.statesync import (
    Admission,
    StateRefused,
    parse_header,
    parse_request,
)
from diloco_node.swarm.streams import parse_json
from diloco_node.train import manifest
from diloco_node.trust import records as trust_records
from diloco_node.trust.admission import MAX_SIGNATURE_CHARS, Claims, Gate, sign
from diloco_node.trust.peer_ids import peer_id_of_public_key
from diloco_node.trust.records import NodeRecord
from diloco_node.trust.seals import Sealer, sealed_by
from diloco_node.trust.state import metadata_refusal, servers_in_order

CASES_PER_HANDLER = int(os.environ.get("FUZZ_CASES", "10000"))
BATCH = 10  # cases per Hypothesis example: its own overhead per example is larger than a parse
CASES = settings(max_examples=max(CASES_PER_HANDLER // BATCH, 1), deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
OTHER = "QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"

# Each case is built from a seed Hypothesis draws (cheap enough for 10^4 cases per handler on a
# loaded CI core) by `adversarial`: numbers at and beyond every bound a check has (huge, negative,
# non-finite, bool: an int in Python), strings of every length, nested lists and objects; a message
# is the handler's own valid example with some of its keys replaced, dropped or added, so that
# the checks deep in a parser are reached too; its bytes are that JSON (NaN and ±Infinity as a
# peer may send them), or raw bytes, a deep nest, a truncation.
EDGE_NUMBERS = [0, -1, 1, 2, 2**31, 2**40, 2**40 + 1, 2**63, 2**64, 10**30, -(10**30), 1e308, -1e-308, 0.5,
                float("nan"), float("inf"), float("-inf"), True, False]
EDGE_TEXT = [PEER, OTHER, "", "x" * 2000, "[" * 100, "\u0000", "Infinity", "1e999"]


def adversarial(rng: random.Random, keys: tuple[str, ...] = (), depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice(EDGE_NUMBERS)
    if kind == 2:
        return rng.choice([rng.randint(-(2**70), 2**70), rng.uniform(-1e12, 1e12), rng.randint(-3, 300)])
    if kind == 3:
        return rng.choice(EDGE_TEXT)
    if kind == 4:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 5:
        return [adversarial(rng, keys, depth + 1) for _ in range(rng.randrange(6))]
    if kind == 6:
        return [rng.choice([PEER, OTHER, "c", ""]) for _ in range(rng.randrange(5))]
    return {rng.choice([*keys, "x", ""]) if keys else "x": adversarial(rng, keys, depth + 1)
            for _ in range(rng.randrange(5))}


def message(rng: random.Random, valid: dict[str, Any]) -> Any:
    """`valid` with some keys replaced, dropped or added; now and then any value at all."""
    if rng.random() < 0.1:
        return adversarial(rng, tuple(valid))
    fields = dict(valid)
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice([*valid, "stray"])
        if rng.random() < 0.2:
            fields.pop(key, None)
        else:
            fields[key] = adversarial(rng, tuple(valid))
    return fields


# Every text encoding json.loads accepts from bytes (it detects UTF-16 and UTF-32 itself)
JSON_ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]


def encoded(rng: random.Random, value: Any) -> bytes:
    kind = rng.randrange(10)
    encoding = "utf-8" if rng.random() < 0.7 else rng.choice(JSON_ENCODINGS)
    if kind == 0:
        return rng.randbytes(rng.randrange(300))
    if kind == 1:
        depth = rng.randrange(1, 20000)
        deep = "[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
        if rng.random() < 0.5:  # between strings whose characters hold quote bytes in UTF-16/32
            quote = rng.choice(["\u2200", "\u5c22", "\u225c", "\u0022", "\u2222"])
            deep = f'["{quote}", {deep}, "{quote}"]'
        return deep.encode(encoding)
    text = json.dumps(value, allow_nan=True).encode(encoding)
    return text[:rng.randrange(len(text) + 1)] if kind == 2 else text


SEEDS = st.integers(0, 2**64 - 1)


def fuzzed(check: Callable[[random.Random], None]) -> Callable[[int], None]:
    """A test running `check` on BATCH cases from each seed Hypothesis draws."""
    @CASES
    @given(SEEDS)
    def test(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(BATCH):
            check(rng)
    test.__name__ = test.__qualname__ = check.__name__
    return test


@fuzzed
def test_parse_json_refuses_with_value_error_only(rng: random.Random) -> None:
    data = encoded(rng, adversarial(rng))
    try:
        parse_json(data)
    except ValueError:
        pass


@fuzzed
def test_payload_requests(rng: random.Random) -> None:
    sent = messages.PayloadRequest(3, "", group_only=rng.random() < 0.5).encode()  # as exchange.py sends it
    data = encoded(rng, message(rng, json.loads(sent)))
    asked = messages.parse_payload_request(data)
    assert isinstance(asked, str) or (0 <= asked.round <= messages.MAX_ROUND and isinstance(asked.token, str))


@fuzzed
def test_butterfly_pushes(rng: random.Random) -> None:
    sent = messages.Push(3, 1, (PEER, OTHER), 10.0, 1.5, "").encode()  # as butterfly.py pushes a part
    data = encoded(rng, message(rng, json.loads(sent)))
    push = messages.parse_push(data)
    if not isinstance(push, str):
        assert math.isfinite(push.tokens) and math.isfinite(push.norm) and 0 <= push.part < len(push.group)
        assert 0 <= push.tokens <= messages.MAX_DECLARED and 0 <= push.norm <= messages.MAX_DECLARED


@fuzzed
def test_part_requests(rng: random.Random) -> None:
    sent = messages.PartRequest(3, 1, "").encode()  # as butterfly.py asks for a part
    data = encoded(rng, message(rng, json.loads(sent)))
    assert isinstance(messages.parse_part_request(data), (str, messages.PartRequest))


@fuzzed
def test_owner_reports(rng: random.Random) -> None:
    data = encoded(rng, message(rng, {"used": [PEER, OTHER], "tokens": [1.0, 2.0], "clipped": [], "rejected": ["c"],
                                      "group": [PEER, OTHER, "c"], "parts": 2}))
    try:
        report = messages.parse_report(data)
    except ValueError:
        return
    # what outer/averaging.py does with a report must now hold without a TypeError
    used, tokens = report.get("used", []), report.get("tokens", [])
    counted = dict(zip(used, (float(t) for t in tokens), strict=True))
    assert all(math.isfinite(t) for t in counted.values())
    assert all(isinstance(p, str) for key in ("used", "clipped", "rejected") for p in report.get(key, ()))


@fuzzed
def test_butterfly_pushes_with_part_norms(rng: random.Random) -> None:
    sent = messages.Push(3, 0, (PEER, OTHER), 10.0, 1.5, "", (0.9, 1.2)).encode()
    data = encoded(rng, message(rng, json.loads(sent)))
    push = messages.parse_push(data)
    if not isinstance(push, str):
        assert all(math.isfinite(n) and 0 <= n <= messages.MAX_DECLARED for n in push.norms)


HASH = "ab" * 32


OWNER_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
OWNER = peer_id_of_public_key(OWNER_KEY.public_key())
SEALED = Sealer(OWNER_KEY).seal(b"signed")
SEAL = SEALED.to_wire()


@fuzzed
def test_butterfly_hash_requests(rng: random.Random) -> None:
    """Each told hash that parses goes on to the seal check, which must answer, not raise."""
    sent = json.loads(messages.DigestsRequest(3, "", (messages.Told(HASH, SEALED), None)).encode())  # butterfly.py's
    if rng.random() < 0.5:
        sent["digests"][0]["seal"] = message(rng, sent["digests"][0]["seal"])
    sent["digests"][0] = message(rng, sent["digests"][0])
    data = encoded(rng, message(rng, sent))
    asked = messages.parse_digests_request(data)
    if not isinstance(asked, str):
        for told in asked.digests:
            assert told is None or len(told.hash) == 64 and sealed_by(OWNER, b"signed", told.seal) in (True, False)


PARTS = 2
BOUNDS = [(0, 8), (8, 16)]
GOOD_REPORT = {"used": sorted([PEER, OTHER]), "tokens": [10.0, 10.0], "clipped": [], "rejected": [],
               "declared": {OTHER: [1.0, 10.0, [0.6, 0.8]], PEER: [1.0, 10.0, [0.8, 0.6]]}}


def _decode(data: bytes, numel: int) -> torch.Tensor:
    if len(data) != 4 * numel:
        raise CodecError("not a part")
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


@fuzzed
def test_owner_reports_as_members_check_them(rng: random.Random) -> None:
    """outer/verify.py on whatever an owner's report holds, after the boundary parse let it through."""
    parts = {}
    for index in range(PARTS):
        report = message(rng, GOOD_REPORT) if rng.random() < 0.7 else dict(GOOD_REPORT)
        if isinstance(report, dict) and rng.random() < 0.5:
            report["declared"] = message(rng, GOOD_REPORT["declared"])
        try:
            checked = messages.parse_report(json.dumps(report, allow_nan=True).encode())
        except ValueError:
            continue
        extreme = rng.random() < 0.3  # else a part the declarations allow (norm ≈ 0.28)
        values = torch.tensor([rng.choice([1e16, float("nan"), 0.1] if extreme else [0.1, -0.1]) for _ in range(8)],
                              dtype=torch.float32)
        parts[rng.choice([index, index, -1, 7])] = (values.numpy().tobytes(), checked)
    kept = verify.verified_parts(parts, [OTHER, PEER, "c"], PARTS, _decode, BOUNDS, "clip", None, 3)
    # a kept part is finite and within what the declarations allow (pair: the shorter whole norm, 1)
    assert all(torch.isfinite(values).all() and float(values.norm()) <= 1.0 * (1 + verify.SLACK) + 1e-6
               for values, _ in kept.values())


@fuzzed
def test_dial_back_requests(rng: random.Random) -> None:
    data = encoded(rng, message(rng, {"addresses": ["/ip4/127.0.0.1/tcp/1"]}))
    addresses = messages.parse_dial_back(data, 8)
    assert isinstance(addresses, str) or (len(addresses) <= 8 and all(isinstance(a, str) for a in addresses))


@fuzzed
def test_payload_answers_metadata(rng: random.Random) -> None:
    data = encoded(rng, message(rng, {"tokens": 4096.0, "group": [PEER, OTHER]}))
    try:
        tokens, group = _parse_meta(parse_json(data))
    except ValueError:
        return
    assert math.isfinite(tokens) and tokens > 0 and (group is None or all(isinstance(p, str) for p in group))


@fuzzed
def test_state_requests(rng: random.Random) -> None:
    data = encoded(rng, message(rng, {"admission": ""}))
    assert isinstance(parse_request(data), (str, Admission))


@fuzzed
def test_state_answer_headers(rng: random.Random) -> None:
    data = encoded(rng, message(rng, {"sharing": True, "vectors": 2, "metadata": {"round": 3, "server": PEER}}))
    try:
        metadata, count = parse_header(data, max_vectors=4)
    except StateRefused as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(metadata, dict) and 2 <= count <= 4


@fuzzed
def test_state_metadata(rng: random.Random) -> None:
    metadata = message(rng, {"round": 7, "server": PEER, "in_flight": [6], "has_momentum": True, "fingerprint": "fp"})
    others = {peer: NodeRecord(peer, "fp", rng.choice([0, 7, 8, 2**40, rng.randrange(100)]), 0, "d")
              for peer in rng.sample([PEER, OTHER, "c"], rng.randrange(4))}
    server = rng.choice([PEER, OTHER])
    why = metadata_refusal(metadata, server, others)
    if why is None:  # taken: the round is one our own records can publish
        assert isinstance(metadata["round"], int) and 0 <= metadata["round"] <= trust_records.MAX_ROUND
        assert metadata["server"] == server
    assert sorted(servers_in_order(others, None)) == sorted(others)


GOOD_RECORD = NodeRecord(PEER, "0123456789abcdef", 3, 2, "0123456789abcdef").to_wire()


@fuzzed
def test_node_records(rng: random.Random) -> None:
    value = message(rng, GOOD_RECORD)
    if rng.random() < 0.3 and isinstance(value, dict):
        value["stats"] = message(rng, GOOD_RECORD["stats"])
    record = NodeRecord.from_wire(value, left=rng.random() < 0.1)
    if record is not None:
        assert -1 <= record.round <= trust_records.MAX_ROUND and len(record.digest) <= 64


OWNER = Ed25519PrivateKey.generate()
VALIDATOR = RunValidator("run", OWNER.public_key())
RUN_KEYS = [DHTID.generate(source=key).to_bytes()
            for key in (records.records_key("run"), records.configs_key("run"), records.revocations_key("run"))]
REVOCATION = sign(OWNER, Claims("revoke", "run", PEER))


def serialized(rng: random.Random, value: Any) -> bytes:
    """What a peer may put in a DHT record's subkey or value: msgpack of anything, or raw bytes."""
    if rng.random() < 0.2:
        return rng.randbytes(rng.randrange(200))
    try:
        return DHTProtocol.serializer.dumps(value)
    except (OverflowError, TypeError, ValueError):  # msgpack has no such number: raw bytes then
        return rng.randbytes(8)


@fuzzed
def test_dht_records_of_the_run(rng: random.Random) -> None:
    subkey = rng.choice([REVOCATION, REVOCATION[:-3] + "AAA", sign(OWNER, Claims("admit", "run", PEER)),
                         adversarial(rng)])
    value = message(rng, GOOD_RECORD) if rng.random() < 0.5 else adversarial(rng)
    record = DHTRecord(rng.choice(RUN_KEYS), serialized(rng, subkey), serialized(rng, value), 0.0)
    assert isinstance(VALIDATOR.validate(record), bool)


GATE = Gate("run", OWNER.public_key())
ADMISSION = sign(OWNER, Claims("admit", "run", PEER))


@fuzzed
def test_admission_tokens(rng: random.Random) -> None:
    token = rng.choice([ADMISSION, REVOCATION])
    at = rng.randrange(len(token))
    token = rng.choice([token[:at] + chr(rng.randrange(32, 0x2FFF)) + token[at + 1:], token[:at], str(adversarial(rng)),
                        "dn1." + token[at:]])
    why = GATE.refusal(PEER, token)
    assert why is None or isinstance(why, str)
    assert GATE.add_revocations([token]) <= {PEER}


NUMEL = 1000
CODEC = CodecConfig(name="int8", block_size=64)
VALID = make_codec(CODEC).encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)))
FIELDS = wire.HEADER.unpack_from(VALID)[:-1]


@fuzzed
def test_codec_header_parameters(rng: random.Random) -> None:
    """The header's numbers, the codec parameters first, anywhere in their range (a valid checksum)."""
    magic, version, codec, dtype, flags, *numbers = FIELDS
    for index in rng.sample(range(len(numbers)), rng.randrange(1, 4)):
        bits = 32 if index in (1, 2) else 64
        numbers[index] = rng.choice([0, 1, 64, 2**24, 2**bits - 1, rng.randrange(2**bits), numbers[index] + 1])
    body = VALID[wire.HEADER.size:] if rng.random() < 0.7 else rng.randbytes(rng.randrange(1100))
    payload = wire.seal((magic, version, codec, dtype, flags, *numbers), body)
    try:
        decoded = make_codec(CODEC).decode(payload, NUMEL)
    except CodecError:
        return
    assert (numbers[1], numbers[2]) == (64, 0) and decoded.shape == (NUMEL,)


# The run manifest a joiner fetches from its --peer (diloco_node/manifest.py, swarm/manifests.py): the
# server's header, then the manifest itself, seeded from a real one (a Llama config and a tokenizer)
# with keys replaced at the top and inside its sections; what `parse` accepts goes on to `take`.
MANIFEST = manifest.build(NodeConfig(run_id="fuzz", model="llama-2m", sync="blocking", compression="int8"), 1_705_600)
MANIFEST_JSON = json.loads(MANIFEST.encode())


@fuzzed
def test_manifest_headers(rng: random.Random) -> None:
    data = encoded(rng, message(rng, {"run_id": "fuzz", "size": 1000, "signature": "A" * 86}))
    try:
        header = manifest_wire.parse_header(data, rng.choice([None, "fuzz"]))
    except manifest.ManifestError:
        return
    assert isinstance(header.run_id, str) and 0 < header.size <= manifest.MAX_MANIFEST_BYTES
    assert header.signature is None or (isinstance(header.signature, str)
                                        and len(header.signature) <= MAX_SIGNATURE_CHARS)


@fuzzed
def test_manifests(rng: random.Random) -> None:
    fields = message(rng, MANIFEST_JSON)
    if isinstance(fields, dict) and rng.random() < 0.5:
        section = rng.choice([key for key, value in MANIFEST_JSON.items() if isinstance(value, dict)])
        fields[section] = message(rng, MANIFEST_JSON[section])
    try:
        taken = manifest.parse(encoded(rng, fields))
    except manifest.ManifestError:
        return
    with tempfile.TemporaryDirectory() as directory:
        try:
            manifest.take(taken, {}, Path(directory))
        except (manifest.ManifestError, manifest.ManifestConflict):
            pass
