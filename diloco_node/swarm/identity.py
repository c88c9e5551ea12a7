"""A node's persistent libp2p identity: the private key its peer id is derived from.

A key kept on disk gives a node the same peer id, and so the same `peer address:`, every time it
starts: a bootstrap address can be written into a compose file or a volunteer's instructions before
the node first runs (`diloco-node identity PATH`), and peers that remembered it find it again.

The file is what p2pd reads with `-id`: a libp2p PrivateKey protobuf holding an RSA key, as
hivemind writes them (hivemind's check that no live peer already holds an identity reads only RSA
keys). Because whoever holds the key can speak as the node, a key readable by others is refused,
as ssh refuses one.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from diloco_node.errors import NodeError

RSA_BITS = 2048


class IdentityError(NodeError, ValueError):
    """An identity file that cannot be used, phrased as one line for the user."""


def create(path: Path) -> str:
    """Write a new key to `path` (readable by its owner only) and return its peer id; an existing
    key is never overwritten: its peer id is returned instead."""
    if path.exists():
        return peer_id(path)
    key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS)
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                            serialization.NoEncryption())
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # created with its final mode, so the key is never readable by others, not even for a moment
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it first: use theirs
        return peer_id(path)
    except OSError as exc:
        raise IdentityError(f"cannot create identity key {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return peer_id(path)


def peer_id(path: Path) -> str:
    """The peer id of the key at `path`, after checking that only its owner can read it."""
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read identity key {path}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise IdentityError(f"identity key {path} is not a file")
    if mode & 0o077:
        raise IdentityError(f"identity key {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
                            f"run: chmod 600 {path}")
    return _peer_id_of(data, path)


def load(path: Path) -> rsa.RSAPrivateKey:
    """The private key at `path` (checked as `peer_id` checks it): it also signs our DHT records,
    which binds them to our peer id (trust/peer_ids.py)."""
    peer_id(path)
    der = crypto_pb2.PrivateKey.FromString(path.read_bytes()).data
    key = serialization.load_der_private_key(der, password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return key


def ephemeral() -> Path:
    """A fresh key in a private temporary directory, for a node without a persistent identity: we
    still hold the key our peer id comes from. The caller removes it once p2pd has read it."""
    return Path(tempfile.mkdtemp(prefix="diloco-identity-")) / "identity.key"


def _peer_id_of(data: bytes, path: Path) -> str:
    try:
        key = crypto_pb2.PrivateKey.FromString(data)
        if key.key_type != crypto_pb2.KeyType.RSA or not isinstance(
                serialization.load_der_private_key(key.data, password=None), rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
        return str(PeerID.from_identity(data).to_base58())
    except Exception:  # protobuf's DecodeError, cryptography's ValueError and kin: the file is no key
        raise IdentityError(f"identity key {path} is not a libp2p RSA private key "
                            "(corrupt or another format)") from None
