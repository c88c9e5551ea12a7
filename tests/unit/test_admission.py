"""Admissions: the owner's key, tokens, and the gate every node checks peers against."""

from __future__ import annotations

import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from diloco_node.trust.admission import (
    AdmissionError,
    Claims,
    Gate,
    check_peer_id,
    generate_owner_key,
    load_owner_key,
    load_token,
    parse_expiry,
    parse_public_key,
    public_key_text,
    sign,
)

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
OTHER = "QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"


def test_keygen_writes_a_private_key_once_and_prints_its_public_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "owner.key"
    public = generate_owner_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert public_key_text(load_owner_key(path).public_key()) == public
    assert parse_public_key(public) is not None
    with pytest.raises(AdmissionError, match="never overwritten"):
        generate_owner_key(path)
    (tmp_path / "junk").write_text("not a key")
    with pytest.raises(AdmissionError, match="not an owner key"):
        load_owner_key(tmp_path / "junk")
    for bad in ("", "abc", "!!!", public[:-2]):
        with pytest.raises(AdmissionError, match="not a run owner's public key"):
            parse_public_key(bad)


def test_the_gate_admits_only_the_peer_run_and_time_the_owner_signed() -> None:
    owner, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    gate = Gate("run", owner.public_key())
    token = sign(owner, Claims("admit", "run", PEER))
    assert gate.refusal(PEER, token) is None
    assert "is for peer" in str(gate.refusal(OTHER, token))  # a stolen token names its own peer
    assert "issued for run 'other'" in str(gate.refusal(PEER, sign(owner, Claims("admit", "other", PEER))))
    assert "not signed by the run owner" in str(gate.refusal(PEER, sign(stranger, Claims("admit", "run", PEER))))
    head, body, signature = token.split(".")
    forged_body = sign(owner, Claims("admit", "run", OTHER)).split(".")[1]
    assert "not signed" in str(gate.refusal(OTHER, f"{head}.{forged_body}.{signature}"))  # body swapped
    assert gate.refusal(PEER, "") is not None and gate.refusal(PEER, "x" * 5000) is not None
    expiring = sign(owner, Claims("admit", "run", PEER, expires=1000.0))
    assert gate.refusal(PEER, expiring, now=999.0) is None
    assert gate.refusal(PEER, expiring, now=1000.0) == "admission expired"
    revocation = sign(owner, Claims("revoke", "run", PEER))
    assert "not an admit token" in str(gate.refusal(PEER, revocation))  # a revocation never admits
    assert gate.add_revocations([revocation, sign(stranger, Claims("revoke", "run", OTHER)), "junk"]) == {PEER}
    assert gate.refusal(PEER, token) == "admission revoked"
    assert gate.add_revocations([revocation]) == set()  # reported once
    assert Gate("run").refusal(PEER, "") is None  # an open run admits everyone


def test_expiry_and_token_inputs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert parse_expiry("never") is None
    assert parse_expiry("30d", now=100.0) == 100.0 + 30 * 86400
    assert parse_expiry("12h", now=0.0) == 12 * 3600
    assert parse_expiry("2026-12-31") == 1798675200.0
    with pytest.raises(AdmissionError, match="not 'never'"):
        parse_expiry("soon")
    assert check_peer_id(PEER) == PEER
    with pytest.raises(AdmissionError, match="is not a peer id"):
        check_peer_id("QmNotBase58!")
    token = sign(Ed25519PrivateKey.generate(), Claims("admit", "run", PEER))
    assert load_token(token) == token
    (tmp_path / "admission").write_text(token + "\n")
    assert load_token(str(tmp_path / "admission")) == token
    with pytest.raises(AdmissionError, match="neither a token nor a readable file"):
        load_token(str(tmp_path / "missing"))
