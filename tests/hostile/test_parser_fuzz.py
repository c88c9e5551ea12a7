"""Property-based fuzzing of the parsers a peer reaches that test_handler_fuzz.py does not drive: the
DHT's records and published configs as a reader gets them (subkeys and values of any type a peer can
store), the key text a record's subkey carries, the answers to our own requests (dial-back, a state
server's rate, a butterfly part), and a run manifest with its request. The same mechanism as there
(FUZZ_CASES, 10^4 cases per parser in BATCHes of a Hypothesis seed), the same seeds: each message is
built by the code its sender runs, then keys are dropped, replaced or given keys of other types, its
values any type (numbers beyond a float's range, non-finite, lone surrogates, deep nests), and its bytes
every JSON text encoding, truncated or framed wrong. Nothing but each parser's documented refusal may
come out. Each crash it found is kept as a minimal example below its fuzz test, now refused as intended
(integers beyond a float's range, a model config.json that is no JSON object or that transformers
cannot read, a compressed EC point, config keys that are no text, tuples nested deep in msgpack)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import logging
import math
import re
import struct
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import msgpack
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed25519, rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import ValueWithExpiration, get_dht_time

from diloco_node.config import NodeConfig
from diloco_node.fingerprint import PROTOCOL, fingerprint_of
from diloco_node.swarm import bounded, reachability, records, statesync
from diloco_node.swarm import manifests as manifest_wire
from diloco_node.swarm.butterfly import MAX_REPORT_BYTES, RECEIVED, Butterfly, digest
from diloco_node.swarm.messages import MAX_GROUP
from diloco_node.swarm.streams import HEADER_LEN, parse_json
from diloco_node.train import manifest
from diloco_node.trust.peer_ids import peer_id_of_public_key, peer_id_of_ssh_key
from diloco_node.trust.records import NodeRecord
from diloco_node.trust.seals import Sealer
from tests.hostile.test_handler_fuzz import (
    EDGE_NUMBERS,
    EDGE_TEXT,
    MANIFEST,
    MANIFEST_JSON,
    OTHER,
    PEER,
    adversarial,
    encoded,
    fuzzed,
    message,
)

# --- what a peer may put in any message, beyond test_handler_fuzz's `adversarial` ------------------

# integers no float holds (float() raises OverflowError on them; json.loads reads them up to 4300 digits)
HUGE = [2**1024, 10**309, -(10**309), 10**4000]
SURROGATES = ["\ud800", "a\udfffb", "\ud83d"]  # what JSON's \ud800 escapes load as: no UTF-8 encodes them
MSGPACK_EDGES = [2**64 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64]  # the last two msgpack cannot carry


def oddities(rng: Any, value: Any) -> Any:
    """`value` with some numbers beyond a float's range and some texts lone surrogates."""
    if isinstance(value, dict):
        return {key: oddities(rng, item) for key, item in value.items()}
    if isinstance(value, list):
        return [oddities(rng, item) for item in value]
    if isinstance(value, int | float) and not isinstance(value, bool) and rng.random() < 0.3:
        return rng.choice(HUGE)
    if isinstance(value, str) and rng.random() < 0.1:
        return rng.choice(SURROGATES)
    return value


def peer_json(rng: Any, valid: dict[str, Any]) -> Any:
    """test_handler_fuzz's `message` of `valid`, now and then with oddities."""
    value = message(rng, valid)
    return oddities(rng, value) if rng.random() < 0.25 else value


def any_key(rng: Any, keys: tuple[Any, ...] = ()) -> Any:
    """A dict key as a peer's msgpack (or a careless caller) may hold it: text most often, else any type."""
    key = rng.choice([*keys, "x", ""])
    text = key if isinstance(key, str) else "x"
    return rng.choice([key, key, key, text.encode(), len(text), len(text) + 0.5, None, True, (text,),
                       (text, (1, None)), float("nan"), 2**64 - 1, b"\xff\xfe"])


def nest(rng: Any, keys: tuple[Any, ...]) -> Any:
    """A nest around msgpack's (1023) and Python's (1000) recursion limits; tuples (msgpack ext
    types) only 100 deep: hivemind's msgpack crashes the process on a few hundred
    (test_hivemind_msgpack_on_extension_types_nested_deep)."""
    value: Any = rng.choice(keys) if keys else 1
    shape = rng.randrange(3)
    for _ in range(rng.choice([50, 100]) if shape == 1 else rng.choice([50, 500, 990, 1000, 1023, 1500])):
        value = [value] if shape == 0 else (value,) if shape == 1 else {rng.choice(keys) if keys else "a": value}
    return value


def wild(rng: Any, keys: tuple[Any, ...] = (), depth: int = 0) -> Any:
    """Any value msgpack hands a DHT reader (DictionaryDHTValue and tuples are its ext types), and
    some it cannot (keys of any type, integers beyond 64 bits)."""
    kind = rng.randrange(13 if depth < 4 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice(EDGE_NUMBERS + MSGPACK_EDGES + HUGE)
    if kind == 2:
        return rng.choice([rng.randint(-(2**70), 2**70), rng.uniform(-1e12, 1e12), rng.randint(-3, 300)])
    if kind == 3:
        return rng.choice(EDGE_TEXT)
    if kind == 4:
        return rng.randbytes(rng.randrange(40))  # as often as not not UTF-8
    if kind == 5:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 6:
        return nest(rng, keys) if rng.random() < 0.3 else rng.choice(keys) if keys else "x"
    if kind == 7:
        return [wild(rng, keys, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 8:
        return tuple(wild(rng, keys, depth + 1) for _ in range(rng.randrange(5)))
    if kind in (9, 10):
        return {any_key(rng, keys): wild(rng, keys, depth + 1) for _ in range(rng.randrange(5))}
    if kind == 11:
        return {rng.choice([*keys, "x"]) if keys else "x": wild(rng, keys, depth + 1) for _ in range(rng.randrange(5))}
    stored = DictionaryDHTValue()
    for _ in range(rng.randrange(3)):
        stored.store(any_key(rng, keys), wild(rng, keys, depth + 1), get_dht_time() + rng.uniform(-10, 100))
    return stored if rng.random() < 0.5 else ValueWithExpiration(wild(rng, keys, depth + 1), get_dht_time())


def mutated(rng: Any, valid: dict[Any, Any]) -> Any:
    """`valid` with keys dropped, replaced, nested sections mutated in turn, or moved under a key of
    another type (the same value under b"round", 5, None...); now and then any value at all."""
    if rng.random() < 0.1:
        return wild(rng, tuple(valid))
    fields = dict(valid)
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice([*valid, "stray"])
        choice = rng.random()
        if choice < 0.2:
            fields.pop(key, None)
        elif choice < 0.4 and key in fields:
            fields[any_key(rng, (key,))] = fields.pop(key)
        elif choice < 0.5 and isinstance(fields.get(key), dict):
            fields[key] = mutated(rng, fields[key])
        else:
            fields[key] = wild(rng, tuple(valid))
    return fields


SERIALIZER = DHTProtocol.serializer
DROPPED = object()  # a value hivemind's msgpack refuses to carry or to decode: no reader ever gets it
# what msgpack (and hivemind's ext hooks) raise on a value it cannot pack or bytes it cannot read
MSGPACK_REFUSALS = (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException)


def as_read(value: Any) -> Any:
    """`value` as a reader's DHT hands it over once a peer stored it: msgpack-packed by the peer and
    decoded by us (only str and bytes keys: strict_map_key), or DROPPED."""
    try:
        return SERIALIZER.loads(SERIALIZER.dumps(value))
    except MSGPACK_REFUSALS:
        return DROPPED


def read_bytes(rng: Any) -> Any:
    """What a reader's msgpack makes of bytes a peer stored as they are."""
    try:
        return SERIALIZER.loads(rng.randbytes(rng.randrange(1, 40)))
    except MSGPACK_REFUSALS:
        return DROPPED


# --- the key a record's subkey carries (swarm/records.py bound_peer_id, trust/peer_ids.py) -------

PEER_ID = re.compile(r"Qm[1-9A-HJ-NP-Za-km-z]{44}")  # base58 of a SHA-256 multihash
IDENTITY = rsa.generate_private_key(public_exponent=65537, key_size=2048)  # a node's libp2p identity
IDENTITY_PEER = peer_id_of_public_key(IDENTITY.public_key())
SIGNER = records.signer(IDENTITY)
OWNED = records.owned_subkey(IDENTITY_PEER, SIGNER)  # the subkey `publish` stores our record under
(OWN_KEY_TEXT,) = RSASignatureValidator._PUBLIC_KEY_RE.findall(OWNED)


def _openssh(key: Any) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


with warnings.catch_warnings():  # DSA: deprecated in cryptography, and still a key type a peer can write
    warnings.simplefilter("ignore")
    NOT_RSA = [_openssh(key) for key in (ed25519.Ed25519PrivateKey.generate(), ec.generate_private_key(ec.SECP256R1()),
                                         ec.generate_private_key(ec.SECP384R1()),
                                         ec.generate_private_key(ec.SECP521R1()), dsa.generate_private_key(1024))]
OTHER_RSA = _openssh(rsa.generate_private_key(public_exponent=65537, key_size=1024))
KEY_TYPES = [b"ssh-rsa", b"ssh-dss", b"ssh-ed25519", b"ecdsa-sha2-nistp256", b"ecdsa-sha2-nistp521", b"ssh-foo", b"",
             b"ssh-rsa-cert-v01@openssh.com", b"sk-ssh-ed25519@openssh.com", b"sk-ecdsa-sha2-nistp256@openssh.com",
             b"rsa-sha2-256", "ssh-é".encode()]


def _ssh_string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _mpint(number: int) -> bytes:
    return _ssh_string(b"" if number == 0 else number.to_bytes((number.bit_length() + 8) // 8, "big", signed=True))


def crafted_key(rng: Any) -> bytes:
    """OpenSSH text whose blob a peer wrote by hand: any type (outside and inside), any numbers."""
    outer = rng.choice(KEY_TYPES)
    inner = outer if rng.random() < 0.7 else rng.choice(KEY_TYPES)
    numbers = [rng.choice([0, 1, 2, 3, 65537, -1, -65537, 2**2047 + 1, 2 ** rng.randrange(1, 20000) + 1,
                           rng.getrandbits(rng.randrange(1, 4096)), (1 << 4096) - 1]) for _ in range(rng.randrange(4))]
    blob = _ssh_string(inner) + b"".join(_mpint(n) for n in numbers)
    if rng.random() < 0.2:  # an EC point of any bytes
        blob = _ssh_string(inner) + _ssh_string(rng.choice([b"nistp256", b"nistp999"])) + _ssh_string(rng.randbytes(65))
    if rng.random() < 0.2:
        blob += rng.randbytes(rng.randrange(20))
    if rng.random() < 0.1:
        blob = blob[:rng.randrange(len(blob))]
    text = outer + b" " + base64.b64encode(blob)
    return text + b" " + rng.choice([b"user@host", "é".encode(), b"\xff"]) if rng.random() < 0.3 else text


def damaged(rng: Any, data: bytes) -> bytes:
    at = rng.randrange(len(data) + 1)
    return rng.choice([data[:at], data[:at] + bytes([rng.randrange(256)]) + data[at + 1:],
                       data[:at] + b"\xff\xfe" + data[at:], data + b"\n" + data, b" " + data + b" \n",
                       data.replace(b" ", b"\t", 1), data[:at] + b"=" + data[at:]])


def key_text(rng: Any) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        text = OWN_KEY_TEXT
    elif kind == 1:
        text = rng.choice([*NOT_RSA, OTHER_RSA])
    elif kind == 2:
        text = crafted_key(rng)
    elif kind == 3:
        text = rng.choice(KEY_TYPES) + b" " + base64.b64encode(rng.randbytes(rng.randrange(300)))
    elif kind == 4:
        text = rng.randbytes(rng.randrange(100))
    else:
        text = rng.choice([b"", b"ssh-rsa", b"ssh-rsa ", b"ssh-rsa AAAA", b"ssh-rsa ====", "ssh-rsa é".encode(), b"\0"])
    return damaged(rng, text) if rng.random() < 0.3 else text


def _peer_id_or_none(found: Any) -> bool:
    return found is None or (isinstance(found, str) and PEER_ID.fullmatch(found) is not None)


@pytest.mark.filterwarnings("ignore::cryptography.utils.CryptographyDeprecationWarning")
@fuzzed
def test_ssh_key_texts(rng: Any) -> None:
    """trust/peer_ids.py peer_id_of_ssh_key: a peer id, or None for anything but an RSA key."""
    text = key_text(rng)
    found = peer_id_of_ssh_key(text)
    assert _peer_id_or_none(found)
    if text == OWN_KEY_TEXT:
        assert found == IDENTITY_PEER
    if text in NOT_RSA:
        assert found is None


@pytest.mark.filterwarnings("ignore::cryptography.utils.CryptographyDeprecationWarning")
@fuzzed
def test_record_subkeys(rng: Any) -> None:
    """swarm/records.py bound_peer_id: the peer id of the one RSA key a subkey holds, else None."""
    prefix = rng.choice([IDENTITY_PEER.encode(), PEER.encode(), b"", rng.randbytes(8)])
    keys = [key_text(rng) for _ in range(rng.choice([1, 1, 1, 0, 2]))]
    subkey = prefix + b"".join(b"[owner:" + text + b"]" for text in keys) + rng.choice([b"", b"]", b"[owner:", b"\xff"])
    found = records.bound_peer_id(subkey)
    assert _peer_id_or_none(found)
    if subkey in (OWNED, prefix + b"[owner:" + OWN_KEY_TEXT + b"]"):
        assert found == IDENTITY_PEER


def bound(subkey: bytes) -> str | None:
    return records.bound_peer_id(subkey)


# A compressed point (0x02, 0x03 first) or any other first byte than 0x04
COMPRESSED_POINT = b"ecdsa-sha2-nistp256 " + base64.b64encode(
    _ssh_string(b"ecdsa-sha2-nistp256") + _ssh_string(b"nistp256") + _ssh_string(b"\x02" + b"\x01" * 32))


def test_an_ecdsa_key_with_a_compressed_point() -> None:
    assert peer_id_of_ssh_key(COMPRESSED_POINT) is None


NESTED = """
import sys
import msgpack
from hivemind.dht.protocol import DHTProtocol
from diloco_node.swarm import serializer
serializer.bound()  # what swarm/dht.py does before the DHT starts
data = msgpack.packb([1, 0.0, []])
for _ in range(400):  # a tuple (ext 0x40) or a dictionary value (ext 0x50, decoded by loads again) in each
    if sys.argv[1] == "tuple":
        data = msgpack.packb(msgpack.ExtType(0x40, b"\\x91" + data))
    else:
        data = msgpack.packb([msgpack.ExtType(0x50, data), 0.0, []], use_bin_type=True)
try:
    DHTProtocol.serializer.loads(data)
except (ValueError, RecursionError):
    pass
"""


@pytest.mark.parametrize("kind", ["tuple", "dictionary"])
def test_hivemind_msgpack_on_extension_types_nested_deep(kind: str) -> None:
    """Run in a process of its own: the crash (SIGSEGV) takes the process. Every extension type
    counts: bounding tuples alone left 240 nested dictionary values (3.6 KB) a crash."""
    done = subprocess.run([sys.executable, "-c", NESTED, kind], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-300:]


STORE_NESTED = """
import sys, time
from diloco_node.swarm import serializer
if sys.argv[1] == "bound":
    serializer.bound()  # as swarm/dht.py's start_dht does before the DHT starts
from hivemind import DHT
from hivemind.utils import get_dht_time
node = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
peer = DHT(start=True, initial_peers=[str(m) for m in node.get_visible_maddrs()], client_mode=True)
nested = 1
for _ in range(400):
    nested = (nested,)
peer.store("key", 1, get_dht_time() + 60, subkey=nested)  # any peer may store under any key
time.sleep(2)
print("alive" if node.is_alive() else "dead")
node.shutdown()
peer.shutdown()
"""


@pytest.mark.parametrize("bound", [False, True])
def test_one_store_of_tuples_nested_deep_leaves_a_nodes_dht_alive(bound: bool) -> None:
    """Real DHTs: one store whose subkey is 400 tuples nested killed the node's DHT helper process
    (and with it the node); with the bound in place it is refused and the DHT lives on."""
    done = subprocess.run([sys.executable, "-c", STORE_NESTED, "bound" if bound else "none"], capture_output=True,
                          timeout=180)
    assert done.stdout.decode().strip().splitlines()[-1:] == (["alive"] if bound else ["dead"]), \
        done.stderr.decode(errors="replace")[-500:]


# --- the run's records as the DHT hands them over (swarm/records.py fetch, fetch_revocations) -----

RECORD = NodeRecord(IDENTITY_PEER, "0123456789abcdef", 3, 2, "0123456789abcdef").to_wire()  # `publish`'s value


def expiration(rng: Any, now: float) -> Any:
    """A subkey's expiration time as a peer stored it: any number msgpack carries."""
    beyond = now + records.RECORD_TTL + records.MAX_CLOCK_SKEW + 2  # stored to outlive any node's record
    return rng.choice([now + 1, now + records.RECORD_TTL, now - 1, beyond, now + rng.uniform(-100, 100),
                       float("nan"), float("inf"), float("-inf"), 0, True, 2**64 - 1])


def record_subkey(rng: Any) -> Any:
    choice = rng.randrange(5)
    if choice == 0:
        return OWNED
    if choice == 1:
        return rng.choice([PEER.encode(), b""]) + b"[owner:" + key_text(rng) + b"]"
    if choice == 2:
        return OWNED.decode()  # the same text, not bytes
    return any_key(rng, (OWNED, PEER, OWN_KEY_TEXT))


def dht_value(rng: Any, valid: dict[str, Any], read: bool) -> Any:
    """A value a peer stored in place of `valid`; `read`: as msgpack hands it to a reader."""
    if read and rng.random() < 0.1:
        return read_bytes(rng)
    value = mutated(rng, valid) if rng.random() < 0.6 else wild(rng, tuple(valid))
    return as_read(value) if read else value


@contextlib.contextmanager
def dht_holding(found: Any, max_read: int = records.MAX_RECORDS_READ) -> Iterator[None]:
    """`bounded.get` answering `found`, as hivemind's DHT.get: None, or a ValueWithExpiration."""
    with mock.patch.object(bounded, "get", lambda *_args, **_kwargs: found), \
            mock.patch.object(records, "MAX_RECORDS_READ", max_read):
        yield


def _check_records(rng: Any, read: bool) -> None:
    now = get_dht_time()
    entries: dict[Any, Any] = {}
    intact = rng.random() < 0.5
    if intact:
        entries[OWNED] = ValueWithExpiration(RECORD, now + records.RECORD_TTL)
    for _ in range(rng.randrange(6)):
        subkey = record_subkey(rng)
        value = dht_value(rng, RECORD, read)
        if value is DROPPED or subkey == OWNED and intact:
            continue
        entries[subkey] = ValueWithExpiration(value, expiration(rng, now)) if rng.random() < 0.9 else wild(rng)
    found = rng.choice([ValueWithExpiration(entries, now + 10)] * 8 + [None, ValueWithExpiration(wild(rng), now)])
    max_read = rng.choice([records.MAX_RECORDS_READ, 2, 0])
    with dht_holding(found, max_read):
        live, departed = records.fetch(None, "run")
        revoked = records.fetch_revocations(None, "run")
    assert all(isinstance(token, str) for token in revoked)
    signers = {bound(subkey) for subkey in entries if isinstance(subkey, bytes)}
    for peer, record in [*live.items(), *departed.items()]:
        # a record counts only under the key of the peer it claims to be
        assert isinstance(record, NodeRecord) and record.peer_id == peer and peer in signers
    if intact and found is not None and found.value is entries and len(entries) <= max_read:
        assert IDENTITY_PEER in live


@pytest.mark.filterwarnings("ignore::cryptography.utils.CryptographyDeprecationWarning")
@fuzzed
def test_run_records_as_the_dht_hands_them(rng: Any) -> None:
    """Subkeys and values of any type msgpack carries, any expiration: well-formed records or nothing."""
    _check_records(rng, read=True)


@pytest.mark.filterwarnings("ignore::cryptography.utils.CryptographyDeprecationWarning")
@fuzzed
def test_run_records_of_any_key_type(rng: Any) -> None:
    """The same with what msgpack could not carry (keys of any type at every level, integers beyond 64 bits)."""
    _check_records(rng, read=False)


# --- the configs peers publish (swarm/records.py fetch_configs, then config_difference) ----------

OURS = NodeConfig(run_id="fuzz", model="llama-2m", sync="blocking", compression="int8").fingerprint_fields()
CONFIG_KEYS = (*OURS, "model.extra", "tokenizer", "eval_data", "protocol", "min_group_size", "x\nforged line", "")


def their_config(rng: Any, read: bool) -> Any:
    """A config a peer published: ours with options changed, dropped, added, of any type."""
    config = dict(OURS)
    for _ in range(rng.randrange(1, 6)):
        key = rng.choice(CONFIG_KEYS)
        choice = rng.random()
        if choice < 0.2:
            config.pop(key, None)
        elif choice < 0.4:
            config[key] = rng.choice(["tiny", "hf:llama", "ab" * 40, "é" * 30, 7, 0.5, None, True, [1, 2], {"a": 1}])
        elif choice < 0.5 and not read:
            config[any_key(rng, (key,))] = config.pop(key, None)
        else:
            config[key] = wild(rng, CONFIG_KEYS)
    if rng.random() < 0.1:
        config = wild(rng, CONFIG_KEYS)
    return as_read(config) if read else config


def _fingerprint(config: Any) -> str | None:
    try:
        return fingerprint_of(config)
    except (TypeError, ValueError, RecursionError, AttributeError):
        return None


def _check_configs(rng: Any, read: bool) -> None:
    now = get_dht_time()
    published: dict[Any, Any] = {}
    wanted: list[Any] = []
    for _ in range(rng.randrange(1, 4)):
        config = their_config(rng, read)
        if config is DROPPED:
            continue
        fingerprint = _fingerprint(config) if rng.random() < 0.8 else None
        fingerprint = fingerprint or rng.choice(["0123456789abcdef", "", "x" * 64])
        published[fingerprint] = ValueWithExpiration(config, now + 100) if rng.random() < 0.9 else config
        wanted.append(fingerprint)
    for _ in range(rng.randrange(3)):
        junk = any_key(rng, ("0123456789abcdef",)) if not read else rng.choice(["0123456789abcdef", b"\x00", "y"])
        published[junk] = ValueWithExpiration(dht_value(rng, OURS, read), now) if rng.random() < 0.8 else wild(rng)
    wanted += rng.sample(["0123456789abcdef", "", "f" * 16, 5, None, b"ab", ("x",)], rng.randrange(3))
    found = rng.choice([ValueWithExpiration(published, now + 100)] * 8 + [None, ValueWithExpiration(wild(rng), now)])
    with dht_holding(found):
        taken = records.fetch_configs(None, "run", wanted)
    assert set(taken) == set(wanted)
    for fingerprint, config in taken.items():
        if config is None:
            continue
        assert isinstance(config, dict) and fingerprint_of(config) == fingerprint
        # a config a reader can get has text keys only (msgpack's strict_map_key and the DHT's schema
        # check); one of other keys crashes config_difference: test_config_difference_with_a_key_not_text
        if all(isinstance(key, str) for key in config):
            line = records.config_difference(OURS, config)
            assert isinstance(line, str) and line


@fuzzed
def test_published_configs_as_the_dht_hands_them(rng: Any) -> None:
    _check_configs(rng, read=True)


@fuzzed
def test_published_configs_of_any_key_type(rng: Any) -> None:
    _check_configs(rng, read=False)


def test_config_difference_with_a_key_not_text() -> None:
    theirs = {1: "x"}
    now = get_dht_time()
    with dht_holding(ValueWithExpiration({fingerprint_of(theirs): ValueWithExpiration(theirs, now + 100)}, now + 100)):
        taken = records.fetch_configs(None, "run", [fingerprint_of(theirs)])
    assert taken == {fingerprint_of(theirs): theirs}
    assert isinstance(records.config_difference(OURS, theirs), str)


# --- answers to our own requests over streams --------------------------------------------------


class Writer:
    """A stream's writing end that keeps what was written."""

    def __init__(self) -> None:
        self.data, self.closed = bytearray(), False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def stream(data: bytes) -> asyncio.StreamReader:
    """A stream's reading end holding `data`, then its end (on the running loop)."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


class Peer:
    """The peer's side of the streams we open to it (P2P.call_binary_stream_handler): the n-th
    stream reads the n-th of `answers`."""

    def __init__(self, answers: Iterator[bytes]):
        self._answers = answers

    async def call_binary_stream_handler(self, _peer_id: Any, _handler: str) -> tuple[None, Any, Writer]:
        return None, stream(next(self._answers)), Writer()


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(HEADER_LEN, "big") + data  # streams.send


def framed(rng: Any, body: bytes, limit: int) -> tuple[bytes, bool]:
    """`body` as streams.send frames it, or as a peer may (truncated, announcing more than `limit`,
    trailing bytes); and whether a reader gets `body` whole from it."""
    kind = rng.randrange(10)
    if kind == 0:
        return frame(body)[:rng.randrange(len(body) + HEADER_LEN)], False
    if kind == 1:
        return rng.choice([limit + 1, 2**63, 2**64 - 1]).to_bytes(HEADER_LEN, "big") + body, False
    if kind == 2:
        return frame(body) + rng.randbytes(rng.randrange(1, 16)), len(body) <= limit
    return frame(body), len(body) <= limit


def unframed(data: bytes) -> list[bytes]:
    messages = []
    while data:
        length = int.from_bytes(data[:HEADER_LEN], "big")
        messages.append(data[HEADER_LEN:HEADER_LEN + length])
        data = data[HEADER_LEN + length:]
    return messages


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records logger `name` emits meanwhile (kept from pytest's capture: 10^4 of them)."""
    logger, lines = logging.getLogger(name), []
    handler = logging.Handler()
    handler.emit = lines.append
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


# Why reading an answer may fail: the stream ended early, or parse_json/receive refused it
STREAM_REFUSALS = {"ValueError", "JSONDecodeError", "UnicodeDecodeError", "IncompleteReadError"}


@fuzzed
def test_dial_back_answers(rng: Any) -> None:
    """swarm/reachability.py _ask: True, False, or None (cannot tell) with one INFO line naming a
    stream or parse refusal; whether an answer is True, False or None is decided by its "reachable"."""
    reached = rng.choice([[True], [False, False], [], [True, False]])
    body = encoded(rng, peer_json(rng, {"reachable": reached}))  # DialBack._serve's answer
    data, whole = framed(rng, body, reachability.MAX_REQUEST_BYTES)
    with logged(reachability.__name__) as lines:
        answer = asyncio.run(reachability._ask(Peer(iter([data])), OTHER, "fuzz", ["/ip4/127.0.0.1/tcp/1"]))
    assert answer is None or answer is True or answer is False
    assert len(lines) <= 1 and all(line.levelno == logging.INFO and line.args[1] in STREAM_REFUSALS
                                   for line in lines)
    if whole:
        try:
            parsed = parse_json(body)
        except ValueError:
            assert answer is None and len(lines) == 1
            return
        told = parsed.get("reachable") if isinstance(parsed, dict) else None
        assert answer is (any(told) if isinstance(told, list) and told else None) and not lines


def state_header(rng: Any) -> dict[str, Any]:
    """StateService._serve's header: its metadata, the count of vectors, the rate it serves at."""
    rate = rng.choice([1_000_000 / 2, 125_000, 1, 2**40, 1e13])
    return {"sharing": True, "metadata": {"round": 7, "server": PEER, "in_flight": [6], "has_momentum": True},
            "vectors": 2, "rate": round(rate / statesync.MAX_SERVES)}


@fuzzed
def test_announced_rates(rng: Any) -> None:
    """swarm/statesync.py announced_rate: a positive finite float, or None (none or malformed)."""
    header = state_header(rng)
    if rng.random() < 0.5:
        header["rate"] = rng.choice([*EDGE_NUMBERS, *HUGE, *EDGE_TEXT, None, [1], {"a": 1}, 2**64 + 0.5])
    data = encoded(rng, peer_json(rng, header))
    rate = statesync.announced_rate(data)
    assert rate is None or (type(rate) is float and math.isfinite(rate) and rate > 0)
    try:
        parsed = parse_json(data, statesync.MAX_METADATA_DEPTH)
    except ValueError:
        assert rate is None
        return
    told = parsed.get("rate") if isinstance(parsed, dict) else None
    if type(told) in (int, float) and 0 < told < statesync.MAX_ANNOUNCED_RATE:
        assert rate == float(told)
    else:
        assert rate is None


def test_an_announced_rate_beyond_a_float_s_range() -> None:
    header = json.dumps({"sharing": True, "metadata": {"round": 7, "server": PEER}, "vectors": 2, "rate": 10**400})
    data = header.encode()
    with pytest.raises(statesync.StateRefused):  # no number of ours has more than 20 digits (MAX_INT_DIGITS)
        statesync.parse_header(data, 4)
    assert statesync.announced_rate(data) is None


# --- the manifest's request (ManifestService._serve) and the manifest (manifest.parse) --------------

STREAMS = SimpleNamespace(p2p=None, loop=None)  # ManifestService._serve touches neither
SIGNATURE = "A" * 86
SERVICES = {signature: manifest_wire.ManifestService(STREAMS, MANIFEST, lambda s=signature: s)
            for signature in (None, SIGNATURE)}


@fuzzed
def test_manifest_requests(rng: Any) -> None:
    """ManifestService._serve: a request it cannot read is refused in one line (PEER_FAILURES,
    caught inside), anything else escapes and fails here; one it reads is answered with the header
    the joiner's parse_header takes, then the manifest when the run is ours."""
    body = encoded(rng, peer_json(rng, {"run_id": rng.choice(["", "fuzz", "other"])}))  # manifests._ask's request
    data, whole = framed(rng, body, manifest_wire.MAX_REQUEST_BYTES)
    signature = rng.choice([None, SIGNATURE])
    writer = Writer()

    async def serve() -> None:
        await SERVICES[signature]._serve(SimpleNamespace(peer_id=PEER), stream(data), writer)

    asyncio.run(serve())
    assert writer.closed
    answer = unframed(bytes(writer.data))
    try:
        request = parse_json(body, max_depth=1) if whole else None
    except ValueError:
        request = None
    wanted = request.get("run_id", "") if isinstance(request, dict) else None
    if not isinstance(wanted, str):
        assert answer == []
        return
    header = json.loads(answer[0])
    ours = wanted in ("", MANIFEST.run_id)
    assert header["run_id"] == MANIFEST.run_id and header["size"] == (len(MANIFEST.encode()) if ours else 0)
    if ours:
        assert answer[1:] == [MANIFEST.encode()]
        assert manifest_wire.parse_header(answer[0], wanted or None) == (MANIFEST.run_id, len(answer[1]), signature)
    else:
        assert answer[1:] == []
        with pytest.raises(manifest.ManifestError):
            manifest_wire.parse_header(answer[0], wanted)


MODEL_CONFIG = json.loads(MANIFEST_JSON["model"]["config"])
TOKENIZER_TEXT = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}})


def _digest(text: Any) -> Any:
    try:
        return manifest.sha256(text)
    except (AttributeError, UnicodeEncodeError):
        return "0" * 64


def peer_manifest(rng: Any) -> Any:
    """A manifest a peer serves: a real one (a Llama config, now and then a tokenizer), changed at the
    top, in its settings, its data, or in its files' texts with their digests made to match."""
    fields: Any = copy.deepcopy(MANIFEST_JSON)
    if rng.random() < 0.5:
        fields["tokenizer"] = {"file": "tokenizer.json", "text": TOKENIZER_TEXT,
                               "digest": manifest.sha256(TOKENIZER_TEXT)}
    for _ in range(rng.randrange(1, 4)):
        if not isinstance(fields, dict):
            break
        where = rng.randrange(6)
        if where == 0:
            fields = peer_json(rng, fields)
        elif where == 1 and isinstance(fields.get("settings"), dict):
            key = rng.choice([*manifest.CHECKED, *manifest.SCHEDULE, "stray", SURROGATES[0], ""])
            if rng.random() < 0.2:
                fields["settings"].pop(key, None)
            else:
                fields["settings"][key] = oddities(rng, adversarial(rng)) if rng.random() < 0.7 else \
                    rng.choice([*EDGE_TEXT, *SURROGATES, *HUGE, -(1 << 62), 1 << 63, 0.0, None, True])
        elif where in (2, 3):  # a file's text and its digest: the checks past the digest
            section = "model" if where == 2 or not isinstance(fields.get("tokenizer"), dict) else "tokenizer"
            if not isinstance(fields.get(section), dict):
                continue
            text_key = "config" if section == "model" else "text"
            source = MODEL_CONFIG if section == "model" else json.loads(TOKENIZER_TEXT)
            text = rng.choice([json.dumps(oddities(rng, message(rng, source)), allow_nan=True),
                               "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(40))),
                               rng.choice(["[]", "5", "", "null", '"x"', "{}", SURROGATES[0], "[" * 5000])])
            fields[section][text_key] = text
            fields[section]["digest"] = _digest(text) if rng.random() < 0.9 else rng.choice([None, "0" * 64, 5])
        elif where == 4 and isinstance(fields.get("model"), dict):
            fields["model"] = peer_json(rng, fields["model"])
        elif where == 5:
            fields["data"] = peer_json(rng, rng.choice([
                {"source": "hf:fuzz/corpus", "kind": "hub", "eval_digest": None},
                {"source": "/data/run", "kind": "local", "eval_digest": "0123456789abcdef"}, MANIFEST_JSON["data"]]))
    return fields


@fuzzed
def test_manifests_with_matching_digests(rng: Any) -> None:
    """manifest.parse: a Manifest whose every field is checked, or ManifestError. What it accepts
    encodes to bytes it accepts again (what a joiner writes beside its checkpoint and reads on restart),
    `run show` prints it, and `take` makes a config of it or refuses in one line."""
    try:
        taken = manifest.parse(encoded(rng, peer_manifest(rng)))
    except manifest.ManifestError:
        return
    assert manifest.RUN_ID.fullmatch(taken.run_id) and taken.protocol == PROTOCOL
    assert manifest.HEX16.fullmatch(taken.fingerprint) and 0 < taken.parameters < 1 << 50
    assert set(taken.settings) <= {*manifest.CHECKED, *manifest.SCHEDULE}
    assert all(value is None or type(value) in (bool, str) or type(value) is int and abs(value) <= 1 << 62
               or type(value) is float and math.isfinite(value) for value in taken.settings.values())
    assert taken.model_config is None or manifest.sha256(taken.model_config) == taken.model_digest
    assert taken.tokenizer is None or manifest.sha256(taken.tokenizer) == taken.tokenizer_digest
    assert manifest.parse(taken.encode()) == taken
    assert isinstance(taken.show(), str)
    with tempfile.TemporaryDirectory() as directory:
        try:
            manifest.take(taken, {}, Path(directory))
        except (manifest.ManifestError, manifest.ManifestConflict) as exc:
            assert "\n" not in str(exc)
            return
    assert isinstance(taken.summary(), str)



def with_model_config(text: str) -> manifest.Manifest:
    """The real manifest with `text` as its model's config.json (and its digest)."""
    fields = copy.deepcopy(MANIFEST_JSON)
    fields["model"]["config"], fields["model"]["digest"] = text, manifest.sha256(text)
    return manifest.parse(json.dumps(fields).encode())  # accepted


def _model_config(**changes: Any) -> str:
    return json.dumps({**json.loads(MANIFEST_JSON["model"]["config"]), **changes})


@pytest.mark.parametrize("config", [
    pytest.param("[" * 5000, id="nested-5000-deep"),  # refused by parse already
    pytest.param(_model_config(dtype=1e20), id="dtype-1e20"),
    pytest.param(_model_config(dtype=1.5), id="dtype-1.5"),
    pytest.param(_model_config(model_type="\ud800"), id="model_type-lone-surrogate"),  # refused by parse now
])
def test_a_manifest_whose_model_config_crashes_take(config: str, tmp_path: Path) -> None:
    """A peer's manifest whose model config.json passes parse (its digest matches): take must refuse it
    in one line (ManifestError, which the joiner catches), not raise out of train/hf.py or pydantic."""
    with pytest.raises(manifest.ManifestError):
        manifest.take(with_model_config(config), {}, tmp_path)


def test_a_manifest_whose_model_config_is_no_object_is_refused() -> None:
    """parse checked the model config's digest, not that it is a JSON object: `diloco-node run show
    ADDR` ended in a traceback (AttributeError; JSONDecodeError for text that is no JSON)."""
    for text in ("[]", "not json", "[" * 5000):
        with pytest.raises(manifest.ManifestError, match="not a JSON object"):
            with_model_config(text)


def test_a_manifest_whose_model_config_escapes_a_lone_surrogate_is_refused() -> None:
    """`"\\ud800"` is valid JSON text but loads as no UTF-8 text: passed on, transformers logged it in a
    warning, which a UTF-8 log cannot print (a "Logging error" traceback; pytest-xdist's worker died
    on the report in CI)."""
    with pytest.raises(manifest.ManifestError, match="UTF-8 texts"):
        with_model_config('{"model_type": "llama", "rope_type": "\\ud800"}')


def test_a_manifest_without_inner_steps_is_summed_up(tmp_path: Path) -> None:
    fields = copy.deepcopy(MANIFEST_JSON)
    del fields["settings"]["inner_steps"]
    taken = manifest.parse(json.dumps(fields).encode())
    manifest.take(taken, {}, tmp_path)  # taken: the same fingerprint
    assert isinstance(taken.summary(), str)


# --- a butterfly part's answers (swarm/butterfly.py fetch_parts) ---------------------------------

ROUND = 5
GROUP = tuple(sorted([IDENTITY_PEER, PEER, OTHER]))
MAX_PART = 1 << 12
UNPACED = SimpleNamespace(reader=lambda r: r, writer=lambda w: w)
UNCOUNTED = SimpleNamespace(count=lambda *_, **__: None)


def butterfly_streams(p2p: Any) -> Any:
    return SimpleNamespace(p2p=p2p, loop=asyncio.get_running_loop(), count=lambda **_: None, throttle=UNPACED,
                           traffic=UNCOUNTED)


async def owner_answers() -> list[tuple[dict[str, Any], bytes]]:
    """Each part's answer as its owner's _serve_part sends it: the report (with its seal, the group
    and the count of parts) and the averaged part."""
    owner = Butterfly(butterfly_streams(None), "fuzz", MAX_PART, lambda *_: None, "", 1.0, Sealer(IDENTITY))
    rnd = owner._round(ROUND)
    assert rnd is not None
    rnd.group, rnd.owning, rnd.finished = GROUP, GROUP, True
    for index in range(len(GROUP)):
        part = (struct.pack("<8f", *(0.1 * (index + i) for i in range(8))),
                {"used": list(GROUP), "tokens": [10.0] * len(GROUP), "clipped": [], "rejected": [],
                 "declared": {peer: [1.0, 10.0, [0.5] * len(GROUP)] for peer in GROUP}})
        rnd.held[index] = part
        rnd.seals[index] = owner._sealer.seal(owner._statement(ROUND, rnd, index, digest(part)))
    answers = []
    for index in range(len(GROUP)):
        request = json.dumps({"round": ROUND, "part": index, "admission": ""}).encode()  # fetch_parts' request
        writer = Writer()
        await owner._serve_part(SimpleNamespace(peer_id=PEER), stream(frame(request) + frame(b"") + RECEIVED), writer)
        report, averaged = unframed(bytes(writer.data))
        answers.append((json.loads(report), averaged))
    return answers


OWNER_ANSWERS = asyncio.run(owner_answers())
# Why fetch_parts may fail: a stream that ended early or timed out, or an answer parse_report or
# receive refused (ValueError); transfer.py then loses the round in one line
PART_REFUSALS = (ValueError, asyncio.IncompleteReadError, TimeoutError, ConnectionError)


def part_answers(rng: Any) -> Iterator[bytes]:
    for index in range(10**6):
        report, averaged = OWNER_ANSWERS[index % len(OWNER_ANSWERS)]
        value: Any = report
        if rng.random() < 0.5:
            value = peer_json(rng, report)
        elif rng.random() < 0.4:
            value = {**report, "group": rng.choice([[*GROUP, *GROUP], [], [PEER] * 300, list(GROUP)[:1],
                                                    adversarial(rng), [1, 2, 3]]),
                     "parts": rng.choice([*EDGE_NUMBERS, *HUGE, 0, 1, 3, 4, 256, 257, "3"])}
        body = encoded(rng, value) if value is not report or rng.random() < 0.3 else json.dumps(value).encode()
        averaged = rng.choice([averaged, averaged, b"", rng.randbytes(rng.randrange(64)), b"x" * (MAX_PART + 1)])
        yield framed(rng, body, MAX_REPORT_BYTES)[0] + framed(rng, averaged, MAX_PART)[0]


@fuzzed
def test_butterfly_part_answers(rng: Any) -> None:
    """fetch_parts: the group (peer ids, at most `max_group`) and the parts it holds (index below the
    count it names, non-empty, the report without what serving added), None, or a stream or parse
    refusal (PART_REFUSALS)."""
    max_group = rng.choice([MAX_GROUP, len(GROUP), 2, 1])

    async def fetch() -> Any:
        member = Butterfly(butterfly_streams(Peer(part_answers(rng))), "fuzz", MAX_PART, lambda *_: None, "", 1.0,
                           Sealer(IDENTITY))
        return await member.fetch_parts(OTHER, ROUND, 1.0, max_group)

    try:
        held = asyncio.run(fetch())
    except PART_REFUSALS:
        return
    if held is None:
        return
    group, parts = held
    assert isinstance(group, tuple) and all(isinstance(p, str) for p in group) and 0 < len(group) <= max_group
    assert all(type(index) is int and 0 <= index < len(group) for index in parts)
    for averaged, report in parts.values():
        assert isinstance(averaged, bytes) and averaged and len(averaged) <= MAX_PART
        assert isinstance(report, dict) and not {"group", "parts", "seal"} & set(report)


def test_a_part_answer_declaring_tokens_beyond_a_float_s_range() -> None:
    report, averaged = OWNER_ANSWERS[0]
    answer = frame(json.dumps({**report, "tokens": [10**400] * len(GROUP)}).encode()) + frame(averaged)

    async def fetch() -> Any:
        member = Butterfly(butterfly_streams(Peer(iter([answer]))), "fuzz", MAX_PART, lambda *_: None, "", 1.0,
                           Sealer(IDENTITY))
        return await member.fetch_parts(OTHER, ROUND, 1.0)

    with pytest.raises(ValueError):
        asyncio.run(fetch())
