"""Which key speaks for which peer id: a libp2p peer id is the hash of its public key, so a record
or a seal counts for a peer only when the RSA key that signed it hashes to that peer's id
(docs/architecture.md §9, "free identities": anyone can make keys, but not someone else's).

Computed here with cryptography and the standard library, without hivemind: the PublicKey protobuf
(crypto.proto, proto2: key_type = 1 (RSA = 0), data = 2), its SHA-256 multihash and base58btc,
byte for byte what hivemind's PeerID gives (tests/unit/test_identity.py holds the two side by side).
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_SHA256_MULTIHASH = bytes([0x12, 0x20])  # multihash: sha2-256, 32 bytes
_RSA_KEY_TYPE = bytes([0x08, 0x00])  # protobuf field 1 (varint): KeyType.RSA


def peer_id_of_public_key(key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key: the multihash of its protobuf encoding (for any
    key as long as ours, libp2p hashes rather than inlines it)."""
    spki = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = _RSA_KEY_TYPE + b"\x12" + _varint(len(spki)) + spki  # field 2 (bytes): the key
    return _base58(_SHA256_MULTIHASH + hashlib.sha256(encoded).digest())


def peer_id_of_ssh_key(text: bytes) -> str | None:
    """The peer id of the RSA public key in OpenSSH text (as a record's subkey carries it,
    swarm/records.py's `bound_peer_id`); None when the text holds no RSA key — also for a key type
    cryptography does not know (`ssh-foo …` raises UnsupportedAlgorithm, which a peer can write) or
    an encoding of a known one it does not read (an ECDSA key's compressed point: NotImplementedError)."""
    try:
        key = serialization.load_ssh_public_key(text)
    except (ValueError, TypeError, UnsupportedAlgorithm, NotImplementedError):
        return None
    return peer_id_of_public_key(key) if isinstance(key, rsa.RSAPublicKey) else None


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _base58(data: bytes) -> str:
    """Bitcoin's base58 alphabet, a leading zero byte as '1' (libp2p's peer ids)."""
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, digit = divmod(number, 58)
        digits.append(_BASE58[digit])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(digits))
