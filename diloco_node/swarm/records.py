"""Presence records in the DHT: storing ours, reading the run's (the record's schema and what the
records decide together are trust/records.py's; whose records count, trust/proofs.py's).

Every node keeps one record under the DHT key `<run_id>_nodes`, refreshed by a heartbeat so that a
crashed node's record expires on its own. The subkey carries the public key of the node's libp2p
identity, so hivemind's RSASignatureValidator signs the record with the key the peer id is derived
from: nobody else can overwrite it, and a record counts only when that key hashes to the peer id it
claims (anyone can make keys, but not someone else's: trust/peer_ids.py). The same pydantic schema
(trust/records.py) is enforced by the DHT on store (SchemaValidator) and by us on read, so a peer
that writes nonsense is ignored and cannot break the barrier or the dashboard.

A permissioned run's revocations live under `<run_id>_revoked`, one subkey per owner-signed token
(the subkey, not the value: a value can be replaced by anyone storing a later one, a subkey cannot
be taken away). `RunValidator` stores a subkey there only when the run owner signed it (none in an
open run), and bounds the bytes of every record of the run, on store and on read (§9).

The fingerprinted config is not in the record: every DHT read of the records returns all of them and
every heartbeat sends ours, and the config is needed only to tell a refused peer what differs. It
lives under `<run_id>_configs`, one subkey per fingerprint, stored for CONFIG_TTL and again every
half of it; a reader takes it only when its fingerprint hashes to that subkey, so nobody can pin
another config on a fingerprint.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import pydantic.v1 as pydantic  # hivemind's SchemaValidator speaks pydantic v1
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from diloco_node.fingerprint import fingerprint_of
from diloco_node.lru import trim_oldest
from diloco_node.swarm import bounded
from diloco_node.trust import admission
from diloco_node.trust.peer_ids import peer_id_of_ssh_key
from diloco_node.trust.records import NodeRecord, NodeValue, Token, parse_record
from diloco_node.trust.shown import shown

logger = logging.getLogger(__name__)

CONFIG_TTL = 3600.0  # seconds a published config stays; nodes store theirs again every half of it
RECORD_TTL = 25.0  # seconds; a node silent for this long is treated as gone (presence.REFRESH_SECONDS)
REVOCATION_TTL = 365 * 86400.0  # a revocation stays for as long as any admission is likely to
# The most bytes one record's value may take (after its signature is stripped): a node's record is
# ~0.6 KB (~3 KB with an admission, 8 vouched and 16 proven peers; the caps and link rates of the stats
# add ~130 B, their largest stats are 555 B of msgpack), a config ~2 KB; a 3 MB digest was stored before
# these bounds
MAX_NODE_RECORD_BYTES = 4096
MAX_CONFIG_BYTES = 32768
MAX_REVOCATION_BYTES = 16


class RunRecords(pydantic.BaseModel):
    nodes: dict[BytesWithPublicKey, NodeValue]  # type: ignore[valid-type]
    revoked: dict[Token, pydantic.StrictBool]  # type: ignore[valid-type]
    configs: dict[pydantic.constr(strict=True, max_length=64), dict[pydantic.StrictStr, Any]]  # type: ignore[valid-type]


def signer(identity: Any) -> RSASignatureValidator:
    """hivemind's record signer holding our libp2p identity's private key (a cryptography RSA key),
    so that our records are provably ours (`bound_peer_id`)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind only makes fresh keys; this one is restored
    key.__setstate__({"_private_key": identity.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())})
    return RSASignatureValidator(key)


class RunValidator(RecordValidatorBase):
    """The run's own rules beyond the schema: a size bound on each record's value, and revocation
    subkeys only when the run owner signed them (`owner`; None: an open run, which has none).
    Without it anyone could store junk under `<run>_revoked` (4,000 subkeys cost 0.46 s and
    3.8 MiB per heartbeat read) or a node record with a 3 MB digest."""

    def __init__(self, run_id: str, owner: Ed25519PublicKey | None):
        self._run_id, self._owner = run_id, owner
        self._bounds = {DHTID.generate(source=key).to_bytes(): bound for key, bound in (
            (records_key(run_id), MAX_NODE_RECORD_BYTES), (configs_key(run_id), MAX_CONFIG_BYTES),
            (revocations_key(run_id), MAX_REVOCATION_BYTES))}
        self._revoked_key = DHTID.generate(source=revocations_key(run_id)).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        bound = self._bounds.get(record.key)
        if bound is None:  # not one of the run's keys (hivemind's own, the averager's)
            return True
        if len(record.value) > bound:
            return False
        return record.key != self._revoked_key or self.revocation_signed(record.subkey)

    def revocation_signed(self, subkey: bytes) -> bool:
        """Whether a serialized `<run>_revoked` subkey is a revocation the run owner signed."""
        if self._owner is None or len(subkey) > 2 * admission.MAX_TOKEN_CHARS:
            return False
        try:
            token = DHTProtocol.serializer.loads(subkey)
            admission.read(token, self._owner, self._run_id, "revoke")
        except Exception:  # msgpack's errors, AdmissionError: not a revocation of this run's owner
            return False
        return True


def validators(run_id: str, signed_by: RSASignatureValidator, owner: Ed25519PublicKey | None = None) -> list[Any]:
    """The DHT record validators every node of a run installs (schema first, then signatures, and
    the run's bounds; `owner`: the run owner's key, whose revocations alone are stored)."""
    return [SchemaValidator(RunRecords, allow_extra_keys=True, prefix=run_id), signed_by, RunValidator(run_id, owner)]


def bound_peer_id(subkey: bytes) -> str | None:
    """The peer id of the libp2p key that signed a record stored under `subkey` (the DHT checked
    the signature on store), None when the subkey holds no RSA key."""
    keys = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey)
    return peer_id_of_ssh_key(keys[0]) if len(keys) == 1 else None


def records_key(run_id: str) -> str:
    return f"{run_id}_nodes"


def revocations_key(run_id: str) -> str:
    return f"{run_id}_revoked"


def configs_key(run_id: str) -> str:
    return f"{run_id}_configs"


def owned_subkey(peer_id: str, signed_by: RSASignatureValidator) -> bytes:
    """Our peer id followed by our public key: the key makes hivemind sign the record."""
    return peer_id.encode() + signed_by.local_public_key


def publish(dht: DHT, run_id: str, record: NodeRecord, signed_by: RSASignatureValidator) -> None:
    bounded.store(dht, records_key(run_id), subkey=owned_subkey(record.peer_id, signed_by), value=record.to_wire(),
                  expiration_time=get_dht_time() + RECORD_TTL)


def publish_revocation(dht: DHT, run_id: str, token: str) -> bool:
    return bounded.store(dht, revocations_key(run_id), subkey=token, value=True,
                         expiration_time=get_dht_time() + REVOCATION_TTL)


def fetch_revocations(dht: DHT, run_id: str) -> list[str]:
    """The run's published revocation tokens, unchecked (admission.Gate checks the owner's signature)."""
    found = bounded.get(dht, revocations_key(run_id))
    if found is None or not isinstance(found.value, dict):
        return []
    return [subkey for subkey in found.value if isinstance(subkey, str)]


def publish_config(dht: DHT, run_id: str, config: dict[str, Any]) -> None:
    bounded.store(dht, configs_key(run_id), subkey=fingerprint_of(config), value=config,
                  expiration_time=get_dht_time() + CONFIG_TTL)


def fetch_configs(dht: DHT, run_id: str, fingerprints: Collection[str]) -> dict[str, dict[str, Any] | None]:
    """The configs published for `fingerprints`, in one read of the DHT (a read per fingerprint,
    under the presence's DHT lock, let 200 fresh fingerprints hold it for seconds): each one only
    when it hashes to its fingerprint, else None."""
    found = bounded.get(dht, configs_key(run_id))
    published = found.value if found is not None and isinstance(found.value, dict) else {}
    configs: dict[str, dict[str, Any] | None] = {}
    for fingerprint in fingerprints:
        item = published.get(fingerprint) if isinstance(fingerprint, str) else None
        config = item.value if isinstance(item, ValueWithExpiration) else None
        configs[fingerprint] = config if isinstance(config, dict) and _hashes_to(config, fingerprint) else None
    return configs


def _hashes_to(config: dict[Any, Any], fingerprint: str) -> bool:
    """Whether a peer's published config has `fingerprint`; one that cannot be hashed (keys of
    mixed types, bytes values: anything canonical JSON refuses) has none."""
    try:
        return fingerprint_of(config) == fingerprint
    except (TypeError, ValueError, RecursionError):
        return False


def withdraw(dht: DHT, run_id: str, record: NodeRecord, signed_by: RSASignatureValidator) -> None:
    """Mark our record as left, so peers stop waiting for us at once.

    The DHT keeps the value with the latest expiration, so the marker must outlive the record it
    replaces; readers skip it like an expired record.
    """
    bounded.store(dht, records_key(run_id), subkey=owned_subkey(record.peer_id, signed_by),
                  value={**record.to_wire(), "left": True},
                  expiration_time=get_dht_time() + RECORD_TTL + 1)


def fetch(dht: DHT, run_id: str) -> tuple[dict[str, NodeRecord], dict[str, NodeRecord]]:
    """The run's well-formed records by peer id: the live nodes', and those of nodes that left
    within the last RECORD_TTL seconds (as they were when they left). Records are free, and each
    costs CPU to check (4,000 took 1.6 s a read): at most MAX_RECORDS_READ are read, those under
    keys read before first (the run's nodes, read at every heartbeat), then the latest to expire;
    none stored to expire later than a node's record can (RECORD_TTL, give or take MAX_CLOCK_SKEW)."""
    found = bounded.get(dht, records_key(run_id))
    if found is None or not isinstance(found.value, dict):
        return {}, {}
    now = get_dht_time()
    # a record stored to outlive any node's (a reader with no keys read before keeps the latest to
    # expire, so one store could otherwise hide the run's records from it for good): passed over
    horizon = now + RECORD_TTL + 1 + MAX_CLOCK_SKEW
    items = [(subkey, item) for subkey, item in found.value.items()
             if isinstance(subkey, bytes) and isinstance(item, ValueWithExpiration)
             and now < item.expiration_time <= horizon]
    if len(items) > MAX_RECORDS_READ:
        items.sort(key=lambda pair: (pair[0] not in _SIGNERS, -pair[1].expiration_time))
        del items[MAX_RECORDS_READ:]
    live: dict[str, NodeRecord] = {}
    departed: dict[str, NodeRecord] = {}
    for subkey, item in items:
        parsed = parse_record(item.value)
        # signed (the DHT checked) by the libp2p key of the peer the record claims to be
        if parsed is not None and _signer(subkey) == parsed[0].peer_id:
            (departed if parsed[1] else live)[parsed[0].peer_id] = parsed[0]
    return live, departed


MAX_RECORDS_READ = 1024  # far above a run's nodes; what a flood of free records can cost a read
# how far ahead of ours another node's clock may be for its records to count (its expirations are its
# time + RECORD_TTL): a flood that outranks the run's records must be stored again this often
MAX_CLOCK_SKEW = 60.0
# subkey → the peer id its key hashes to (bound_peer_id), for the keys read last: a heartbeat reads
# the same records again and again, and the keys read before are the run's nodes
_SIGNERS: OrderedDict[bytes, str | None] = OrderedDict()
_SIGNERS_KEPT = 4 * MAX_RECORDS_READ


def _signer(subkey: bytes) -> str | None:
    if subkey in _SIGNERS:
        _SIGNERS.move_to_end(subkey)
        return _SIGNERS[subkey]
    signer = _SIGNERS[subkey] = bound_peer_id(subkey)
    trim_oldest(_SIGNERS, _SIGNERS_KEPT)
    return signer


# The fingerprint's keys that --model sets: a preset's shape (train/presets.py) and, for a Hugging Face
# model, one `model.<entry>` key per config entry (train/hf.py)
MODEL_SHAPE_KEYS = frozenset({"model", "n_layer", "d_model", "n_head", "vocab_size", "max_seq_len"})
# fingerprint keys named otherwise than the option that sets them (config.fingerprint_fields)
OPTION_OF_KEY = {"tokenizer": "--tokenizer", "eval_data": "--data", "protocol": "protocol version"}
SHOWN_OPTIONS = 3  # options a refusal spells out; the rest are counted ("and N more")
SHOWN_ENTRIES = 2  # entries of one model's config spelled out when both sides name the same model
SHOWN_HASH_CHARS = 12  # a digest is cut to this many characters: enough to tell two apart
SHOWN_KEY_CHARS = 64  # a peer's config key, escaped: ours are all shorter
SHOWN_VALUE_CHARS = 24  # any other value longer than this is cut (a run owner's key, a long path)


def option_of(key: str) -> str:
    """The command-line option that sets fingerprint key `key`, as a user types it: a refused
    user is told what to change, not our internal keys (every model entry folds into --model)."""
    if key in MODEL_SHAPE_KEYS or key.startswith("model."):
        return "--model"
    return OPTION_OF_KEY.get(key, "--" + key.replace("_", "-"))  # every other key is a NodeConfig field


def shown_value(value: Any, present: bool = True) -> str:
    """`value` as a refusal prints it: short, since one line holds several (a digest is cut to
    SHOWN_HASH_CHARS, a key absent from a config is its default), and escaped: it is a peer's text
    (trust/shown.py)."""
    if not present:
        return "default"
    text = "none" if value is None else str(value)
    if len(text) > SHOWN_HASH_CHARS and all(c in "0123456789abcdefABCDEF" for c in text):
        return text[:SHOWN_HASH_CHARS] + "…"
    return shown(text, SHOWN_VALUE_CHARS)


def _option_difference(option: str, keys: list[str], ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """'OPTION THEIRS (ours: OURS)' for one option whose `keys` differ. --model names the model
    (hf:llama, tiny) and, when both name the same one, its first SHOWN_ENTRIES entries that differ
    (one changed entry often moves a derived one: hidden_size and head_dim)."""
    def pair(key: str) -> str:
        return f"{shown_value(theirs.get(key), key in theirs)} (ours: {shown_value(ours.get(key), key in ours)})"

    if option == "--model" and ours.get("model") == theirs.get("model"):
        entries = [f"{key.removeprefix('model.')}={pair(key)}" for key in keys[:SHOWN_ENTRIES]]
        more = f" and {len(keys) - SHOWN_ENTRIES} more entries" if len(keys) > SHOWN_ENTRIES else ""
        return f"--model {shown_value(theirs.get('model'))}: {', '.join(entries)}{more}"
    return f"{option} {pair('model' if option == '--model' else keys[0])}"


def config_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """What makes two fingerprinted configs incompatible, as one short line of the options that set
    them (`--model hf:llama (ours: tiny); --tokenizer 026b1f2a3c4d… (ours: default) and 2 more options`): a
    joiner refused for 25 internal keys could not tell what to change (docs/architecture.md §4).
    The run's value first, ours in brackets; the protocol version, model and data options first. A
    peer's key that is no text (its config came through msgpack) is an option of its own, shown escaped."""
    theirs = {shown(key if isinstance(key, str) else repr(key), SHOWN_KEY_CHARS): value
              for key, value in theirs.items()}
    keys = [*ours, *(key for key in theirs if key not in ours)]
    by_option: dict[str, list[str]] = {}
    for key in keys:
        if key in ours and key in theirs and ours[key] == theirs[key] or \
                key not in ours and key not in theirs:
            continue
        by_option.setdefault(option_of(key), []).append(key)
    first = ("protocol version", "--model", "--tokenizer", "--data")
    options = sorted(by_option, key=lambda option: first.index(option) if option in first else len(first))
    if not options:
        return "unknown difference"
    lines = [_option_difference(option, by_option[option], ours, theirs) for option in options[:SHOWN_OPTIONS]]
    more = len(options) - len(lines)
    return "; ".join(lines) + (f" and {more} more options" if more else "")
