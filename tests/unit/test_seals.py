"""Owner seals on butterfly parts (trust/seals.py): only the owner's key, over the very statement,
makes a seal that checks."""

from __future__ import annotations

import base64
import random
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_node.trust.peer_ids import peer_id_of_public_key
from diloco_node.trust.seals import Seal, Sealer, parse_seal, sealed_by, sealed_versions, statement

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


def test_the_versions_of_a_part_are_the_hashes_its_owner_sealed_held_by_other_members() -> None:
    """What butterfly's comparison counts: sealed hashes held by members other than the owner (ours
    first), the owner's own word never, and the members that told an unsealed hash."""
    def signed(part_hash: str) -> bytes:
        return statement("run_fp", 7, 1, [OTHER, OWNER], part_hash)

    sealer = Sealer(KEYS[0])
    one, two = "ab" * 32, "cd" * 32
    told = [("m1", one, sealer.seal(signed(one))), (OWNER, two, sealer.seal(signed(two))),
            ("m2", two, Sealer(KEYS[1]).seal(signed(two))), ("m3", one, sealer.seal(signed(one)))]
    assert sealed_versions(OWNER, "us", one, told, signed) == ({one: ["us", "m1", "m3"]}, {"m2"})
    assert sealed_versions(OWNER, OWNER, one, told, signed) == ({one: ["m1", "m3"]}, {"m2"})  # the owner's word
    split = [*told, ("m4", two, sealer.seal(signed(two)))]  # the owner sealed two versions
    assert sealed_versions(OWNER, "us", None, split, signed) == ({one: ["m1", "m3"], two: ["m4"]}, {"m2"})


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


def _ssh_string(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _ssh_text(kind: str, *fields: bytes) -> str:
    """OpenSSH public-key text of type `kind` with the given wire fields (any content, even absurd)."""
    blob = _ssh_string(kind.encode()) + b"".join(_ssh_string(field) for field in fields)
    return f"{kind} {base64.b64encode(blob).decode()}"


def _openssh(key: Any) -> str:
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


REAL = Sealer(KEYS[0]).seal(SIGNED)
MALFORMED_KEYS = [
    "ssh-foo AAAA", "ssh-foo AAAAB3NzaC1yc2E=", _ssh_text("ssh-foo", b"x"),  # a type cryptography does not know
    _ssh_text("ssh-rsa-cert-v01@openssh.com", b"nonce"), "sk-ssh-ed25519@openssh.com AAAA",
    _ssh_text("sk-ecdsa-sha2-nistp256@openssh.com", b"nistp256", b"\x04"), "ssh-dss AAAA",
    _ssh_text("ecdsa-sha2-nistp999", b"nistp999", b"\x04"),
    _openssh(ed25519.Ed25519PrivateKey.generate().public_key()),  # valid keys of another class
    _openssh(ec.generate_private_key(ec.SECP256R1()).public_key()),
    _openssh(ec.generate_private_key(ec.SECP384R1()).public_key()),
    _ssh_text("ssh-rsa", b"\x01", b"\x01"), _ssh_text("ssh-rsa", b"", b""), _ssh_text("ssh-rsa", b"\x03"),
    _ssh_text("ssh-rsa", b"\x01\x00\x01", b"\x00" * 300), _ssh_text("ssh-rsa", b"\xff" * 4, b"\xff" * 64),
    _ssh_text("ssh-ed25519", b"short"), "ssh-rsa " + REAL.key.split()[1][:-8],  # truncated blob
    "ssh-rsa", "ssh-rsa ", " ", "\x00", "ssh-rsa \udc80", "\ud800 AAAA",
    "ssh-rsa AAAA\x00", "ssh-ed25519 " + REAL.key.split()[1], REAL.key.replace("ssh-rsa", "ssh-foo"),
    "x" * 800, REAL.key.upper(),
]
MALFORMED_SIGNATURES = ["", "=", "A", "AAA", "not base64!", "ü" * 10, "\udc80", "AAAA\n", "A" * 700,
                        base64.b64encode(b"\x00" * 255).decode(), base64.b64encode(b"\xff" * 257).decode(),
                        base64.b64encode(b"\xff" * 256).decode(), REAL.signature[:-4], REAL.signature + "AAAA",
                        REAL.signature.replace("=", ""), " " + REAL.signature]


# some keys are generated at import: ids by position, alike in every pytest-xdist worker
@pytest.mark.parametrize("key", MALFORMED_KEYS, ids=[f"key{i}" for i in range(len(MALFORMED_KEYS))])
def test_a_seal_whose_key_is_of_any_unknown_type_or_shape_is_one_invalid_seal(key: str) -> None:
    """docs/architecture.md §9: a key cryptography cannot load (`ssh-foo …` raised
    UnsupportedAlgorithm out of `exchange()`) is refused like a bad signature, never raised."""
    for signature in (REAL.signature, "AAAA", "not base64!"):
        assert not sealed_by(OWNER, SIGNED, Seal(signature, key))
        seal = parse_seal({"signature": signature, "key": key})
        assert seal is None or not sealed_by(OWNER, SIGNED, seal)


@pytest.mark.parametrize("signature", MALFORMED_SIGNATURES)
def test_a_malformed_signature_under_the_owners_own_key_is_one_invalid_seal(signature: str) -> None:
    assert not sealed_by(OWNER, SIGNED, Seal(signature, REAL.key))


def _mutated(text: str, rng: random.Random) -> str:
    """`text` with a few characters replaced, inserted or cut, or its base64 blob's bytes changed."""
    kind, _, rest = text.partition(" ")
    if rest and rng.random() < 0.5:  # change the decoded blob: reaches the key parser past base64
        try:
            blob = bytearray(base64.b64decode(rest))
        except ValueError:
            blob = bytearray(rest.encode())
        for _ in range(rng.randint(1, 4)):
            if blob and rng.random() < 0.7:
                blob[rng.randrange(len(blob))] = rng.randrange(256)
            else:
                del blob[rng.randrange(len(blob) + 1):]
        return f"{rng.choice([kind, 'ssh-rsa', 'ssh-foo', 'ssh-ed25519', 'ecdsa-sha2-nistp256'])} " \
               f"{base64.b64encode(bytes(blob)).decode()}"
    chars = list(text)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(chars) + 1)
        choice = rng.random()
        if choice < 0.4 and at < len(chars):
            chars[at] = chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x800), 0xDC80, 0]))
        elif choice < 0.7:
            chars.insert(at, chr(rng.randrange(0, 0x3000)))
        else:
            del chars[at:at + rng.randint(1, 8)]
    return "".join(chars)


def _checks(seal: Seal | None) -> bool:
    """Whether a parsed seal checks, asserting that only the true signature can (the key's text may
    still vary where OpenSSH text allows it: a comment, trailing characters)."""
    if seal is None or not sealed_by(OWNER, SIGNED, seal):
        return False
    assert base64.b64decode(seal.signature) == base64.b64decode(REAL.signature)
    return True


def test_thousands_of_mutated_seals_are_refused_never_raised() -> None:
    """Fuzz (seeded from a real seal): no mutation of its key or signature raises, and none checks
    but with the owner's true signature."""
    rng = random.Random(40)
    for _ in range(3000):
        key = _mutated(REAL.key, rng) if rng.random() < 0.7 else rng.choice(MALFORMED_KEYS)
        signature = _mutated(REAL.signature, rng) if rng.random() < 0.5 else REAL.signature
        _checks(parse_seal({"signature": signature, "key": key}))


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(key=st.one_of(st.text(max_size=200), st.sampled_from(MALFORMED_KEYS),
                     st.builds(lambda kind, blob: f"{kind} {base64.b64encode(blob).decode()}",
                               st.text(max_size=40), st.binary(max_size=300)),
                     st.builds(lambda kind, fields: _ssh_text(kind, *fields),
                               st.sampled_from(["ssh-rsa", "ssh-foo", "ssh-ed25519", "ssh-dss",
                                                "ecdsa-sha2-nistp256", "sk-ssh-ed25519@openssh.com",
                                                "ssh-rsa-cert-v01@openssh.com"]),
                               st.lists(st.binary(max_size=64), max_size=4))),
       signature=st.one_of(st.text(max_size=100), st.just(REAL.signature),
                           st.binary(max_size=300).map(lambda raw: base64.b64encode(raw).decode())))
def test_any_seal_text_is_refused_or_checked_never_raised(key: str, signature: str) -> None:
    checks = _checks(parse_seal({"signature": signature, "key": key}))
    assert checks or (key, signature) != (REAL.key, REAL.signature)
