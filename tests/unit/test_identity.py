"""Identity keys: the peer id a key gives, and the key files that are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from hivemind.p2p import P2P

from diloco_node.swarm.identity import IdentityError, create, load, peer_id
from diloco_node.trust.peer_ids import peer_id_of_public_key


def test_a_created_key_keeps_its_peer_id_and_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "identity.key"
    first = create(path)
    assert first.startswith("Qm"), first  # RSA, as hivemind writes keys
    assert path.stat().st_mode & 0o777 == 0o600
    content = path.read_bytes()
    assert create(path) == first == peer_id(path)
    assert path.read_bytes() == content
    assert create(tmp_path / "other.key") != first


def test_the_peer_id_of_a_public_key_is_the_one_hivemind_gives(tmp_path: Path) -> None:
    """trust/peer_ids.py derives peer ids without hivemind: the same ids as libp2p's, for our keys
    and for hivemind's."""
    ours, theirs = tmp_path / "ours.key", tmp_path / "theirs.key"
    create(ours)
    P2P.generate_identity(str(theirs))
    for path in (ours, theirs):
        assert peer_id_of_public_key(load(path).public_key()) == peer_id(path)


def test_a_key_written_by_hivemind_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "rsa.key"
    P2P.generate_identity(str(path))  # RSA, mode 0400
    assert peer_id(path).startswith("Qm")


@pytest.mark.parametrize("content", [b"", b"not a key", b"\x08\x01\x12\x40" + bytes(64), b"\x08\x00\x12\x02ab",
                                     b"\x08\x00\x12\x40" + bytes(64)])
def test_corrupt_keys_are_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="not a libp2p RSA private key"):
        peer_id(path)


def test_a_key_of_another_type_is_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.proto import crypto_pb2

    raw = Ed25519PrivateKey.generate().private_bytes_raw()
    path = tmp_path / "identity.key"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=raw * 2).SerializeToString())
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="not a libp2p RSA private key"):
        peer_id(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_key_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "identity.key"
    create(path)
    path.chmod(mode)
    with pytest.raises(IdentityError, match="readable by others"):
        create(path)


def test_a_directory_is_not_a_key(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(IdentityError):
        peer_id(tmp_path / "dir")
