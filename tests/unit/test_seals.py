"""Owner seals on butterfly parts (swarm/seals.py): only the owner's key, over the very statement,
makes a seal that checks."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from diloco_node.identity import peer_id_of_public_key
from diloco_node.swarm.seals import Seal, Sealer, parse_seal, sealed_by, statement

KEYS = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2)]
OWNER, OTHER = (peer_id_of_public_key(key.public_key()) for key in KEYS)
SIGNED = statement("run_fp", 7, 1, [OTHER, OWNER], "ab" * 32)


def test_a_seal_checks_for_its_owner_and_statement_only() -> None:
    seal = Sealer(KEYS[0]).seal(SIGNED)
    assert sealed_by(OWNER, SIGNED, seal)
    assert not sealed_by(OTHER, SIGNED, seal)  # the key is not that peer's
    for changed in (statement("run_fp", 8, 1, [OTHER, OWNER], "ab" * 32),  # another round
                    statement("run_fp", 7, 0, [OTHER, OWNER], "ab" * 32),  # another part
                    statement("run_fp", 7, 1, [OWNER, OTHER], "ab" * 32),  # other owners
                    statement("other", 7, 1, [OTHER, OWNER], "ab" * 32),  # another run
                    statement("run_fp", 7, 1, [OTHER, OWNER], "cd" * 32)):  # other bytes
        assert not sealed_by(OWNER, changed, seal)


def test_a_seal_made_with_another_key_does_not_check_even_naming_the_owners_key() -> None:
    forged = Sealer(KEYS[1]).seal(SIGNED)
    assert not sealed_by(OWNER, SIGNED, Seal(forged.signature, Sealer(KEYS[0]).seal(SIGNED).key))


@pytest.mark.parametrize("value", [None, [], "x", {"signature": "a"}, {"signature": "a", "key": 5},
                                   {"signature": "", "key": "k"}, {"signature": "a" * 701, "key": "k"},
                                   {"signature": "a", "key": "k" * 801}, {"signature": "a", "key": "k", "x": 1}])
def test_a_malformed_seal_is_refused(value: object) -> None:
    assert parse_seal(value) is None


@pytest.mark.parametrize("seal", [Seal("not base64!", "ssh-rsa AAAA"), Seal("AAAA", "ssh-ed25519 AAAA"),
                                  Seal("AAAA", "garbage")])
def test_a_seal_that_is_no_signature_or_no_rsa_key_is_false_not_an_error(seal: Seal) -> None:
    assert not sealed_by(OWNER, SIGNED, seal)
