"""Owner seals on averaged butterfly parts (docs/architecture.md §9, "Butterfly").

An owner signs each averaged part it answers with the libp2p key its peer id is derived from: the
seal covers the run, the round, the part's index, the owners in part order and the hash of the part
with its report. So a member cannot claim a hash the owner did not sign, and two valid seals of one
part with different hashes prove that its owner sent different bytes to different members.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from diloco_node.trust.peer_ids import peer_id_of_public_key

MAX_SIGNATURE_CHARS = 700  # base64 of an RSA signature up to 4096 bits (ours: 2048 bits, 344 chars)
MAX_KEY_CHARS = 800  # OpenSSH text of an RSA public key up to 4096 bits (ours: 2048 bits, 372 chars)


@dataclass(frozen=True)
class Seal:
    signature: str  # base64, PKCS #1 v1.5 over SHA-256 of the statement
    key: str  # the owner's public key, OpenSSH text: its peer id must be the owner's

    def to_wire(self) -> dict[str, str]:
        return asdict(self)


def statement(namespace: str, round_: int, index: int, owning: Sequence[str], part_hash: str) -> bytes:
    """What an owner signs: its answer for part `index` of `round_` among `owning`, in this run."""
    return json.dumps([namespace, round_, index, list(owning), part_hash]).encode()


class Sealer:
    """Signs statements with our libp2p identity's private key."""

    def __init__(self, key: rsa.RSAPrivateKey):
        self._key = key
        self._public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH).decode()

    def seal(self, signed: bytes) -> Seal:
        signature = self._key.sign(signed, padding.PKCS1v15(), hashes.SHA256())
        return Seal(base64.b64encode(signature).decode(), self._public)


@functools.lru_cache(maxsize=1024)  # a group's owners seal every round with the same keys
def _key_of(text: str) -> tuple[rsa.RSAPublicKey, str] | None:
    """The RSA key in OpenSSH text and its peer id; None when it is no RSA key.

    Any failure is "no key": cryptography raises UnsupportedAlgorithm for a key type it does not
    know (`ssh-foo …`), ValueError, TypeError or UnicodeError for damaged text, and may raise others
    in a later version; a peer's text must never raise out of `exchange()` (docs/architecture.md §9,
    "Butterfly": every malformed seal is one invalid seal)."""
    try:
        key = serialization.load_ssh_public_key(text.encode())
        if not isinstance(key, rsa.RSAPublicKey):
            return None
        return key, peer_id_of_public_key(key)
    except Exception:  # a peer's bytes: whatever the loader raises, the seal is invalid
        return None


def _signature_of(text: str) -> bytes | None:
    """The signature bytes in base64 text; None when it is no strict base64."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):  # ValueError: non-ASCII characters
        return None


def sealed_by(owner: str, signed: bytes, seal: Seal) -> bool:
    """Whether `seal` is `owner`'s signature of `signed`: False, never an exception, for any seal
    whose key or signature is malformed (docs/architecture.md §9, "Butterfly")."""
    loaded = _key_of(seal.key)
    if loaded is None or loaded[1] != owner:
        return False
    signature = _signature_of(seal.signature)
    if signature is None:
        return False
    try:
        loaded[0].verify(signature, signed, padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, Exception):  # a wrong length or any other refusal of a peer's bytes
        return False
    return True


def sealed_versions(owner: str, ourselves: str, mine: str | None, told: Iterable[tuple[str, str, Seal]],
                    signed: Callable[[str], bytes]) -> tuple[dict[str, list[str]], set[str]]:
    """The versions of `owner`'s averaged part that members other than the owner hold: each hash
    validly sealed by the owner (`signed`: the statement of a hash) with its holders, ourselves
    first when we hold it (`mine`, checked as we took it); and the members that told (`told`:
    member, hash, seal) a hash the owner did not seal. An owner's own word counts for nothing: it
    would let it show a part to some members only. One version: the part is agreed; two or more:
    the two seals prove the owner sent different bytes (docs/architecture.md §9, "Butterfly")."""
    versions: dict[str, list[str]] = {}
    if ourselves != owner and mine is not None:
        versions[mine] = [ourselves]
    unsealed = set()
    for peer, part_hash, seal in told:
        if peer == owner:
            continue
        if sealed_by(owner, signed(part_hash), seal):
            versions.setdefault(part_hash, []).append(peer)
        else:
            unsealed.add(peer)
    return versions, unsealed


def parse_seal(value: Any) -> Seal | None:
    """A seal as it comes on the wire (`{"signature": …, "key": …}`); None when malformed."""
    if not isinstance(value, dict) or set(value) != {"signature", "key"}:
        return None
    signature, key = value["signature"], value["key"]
    if not (isinstance(signature, str) and 0 < len(signature) <= MAX_SIGNATURE_CHARS
            and isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS):
        return None
    return Seal(signature, key)
