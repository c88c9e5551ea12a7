"""A permissioned run's manifest, signed by the run owner (manifest.sign, check_signed; issue #42,
must-holds 1 and 6): a joiner that knows the run's owner takes only a manifest that owner signed,
an open run's joiner takes its --peer's as before; the signature is a peer's bytes (bounded, fuzzed,
a key of an unknown type refused, never raised); the owner's `run sign` and a node serving the
signature its checkpoint directory holds."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed448, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_node.cli import main
from diloco_node.config import NodeConfig
from diloco_node.swarm.manifests import parse_header
from diloco_node.train import manifest
from diloco_node.train.manifest import Manifest, ManifestError, ServedSignature, check_signed
from diloco_node.trust import admission
from diloco_node.trust.admission import AdmissionError, Claims, parse_public_key, public_key_text, signature_refusal

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmeSev1BKG3Kmiv7T6PYYCy2aFZguvEDGo54MbRj2gtUNd"
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))  # the owner's: alike in every xdist worker
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
OWNER, OTHER_OWNER = public_key_text(KEY.public_key()), public_key_text(OTHER.public_key())


def permissioned(owner: str = OWNER, **settings: object) -> Manifest:
    cfg = NodeConfig(run_id="perm", run_owner=owner, admission="dn1.a.b", identity="id.key",  # type: ignore[arg-type]
                     **settings)
    return manifest.build(cfg, 1234)


UNSIGNED = permissioned()
SIGNED = manifest.sign(UNSIGNED, KEY)
OPEN = manifest.build(NodeConfig(run_id="open"), 1234)


def refusal(m: Manifest, owner: str = "") -> str:
    with pytest.raises(ManifestError) as caught:
        check_signed(m, owner)
    text = str(caught.value)
    assert "\n" not in text and len(text) < 200, text
    return text


# --- signing ------------------------------------------------------------------------------------


def test_the_signature_leaves_the_bytes_the_digest_and_the_fingerprint_as_they_were() -> None:
    assert SIGNED.encode() == UNSIGNED.encode() and SIGNED.digest == UNSIGNED.digest
    assert SIGNED.fingerprint == UNSIGNED.fingerprint == NodeConfig(
        run_id="perm", run_owner=OWNER, admission="dn1.a.b", identity="id.key").fingerprint()
    assert SIGNED == UNSIGNED and SIGNED.signature and len(SIGNED.signature) == 86  # Ed25519, base64url
    assert manifest.parse(SIGNED.encode()).signature is None  # never inside the manifest's bytes
    assert SIGNED.signed_bytes() == manifest.SIGNING_CONTEXT + SIGNED.encode()
    assert "signed by the run owner" in SIGNED.summary() and "signed" not in UNSIGNED.summary()
    assert f"permissioned: run owner {OWNER}, manifest signed by the run owner" in SIGNED.show()
    assert "manifest not signed by the run owner (joiners refuse it" in UNSIGNED.show()
    assert "permissioned" not in OPEN.show() and "signed" not in OPEN.summary()  # an open run's: as before


def test_only_the_owner_the_manifest_names_signs_it_and_an_open_run_has_nothing_to_sign() -> None:
    with pytest.raises(ManifestError, match=f"run perm's owner is {OWNER}, not this key's {OTHER_OWNER}"):
        manifest.sign(UNSIGNED, OTHER)
    with pytest.raises(ManifestError, match="run open is an open run .* nothing to sign"):
        manifest.sign(OPEN, KEY)


# --- what a joiner takes ------------------------------------------------------------------------


def test_a_joiner_takes_a_manifest_its_owner_signed() -> None:
    assert check_signed(SIGNED, OWNER) is SIGNED  # given --run-owner
    assert check_signed(SIGNED) is SIGNED  # given none: the owner the manifest names


def test_an_open_runs_manifest_is_taken_as_its_peer_serves_it() -> None:
    assert check_signed(OPEN) == OPEN
    # whatever a peer sent beside an open run's manifest is dropped, not kept or written
    assert check_signed(dataclasses.replace(OPEN, signature="junk")).signature is None


def _token_signature() -> str:
    """The signature part of an admission the owner signed: valid, over other bytes."""
    return admission.sign(KEY, Claims("admit", "perm", "QmeSev1BKG3Kmiv7T6PYYCy2aFZguvEDGo54MbRj2gtUNd")).split(".")[2]


@pytest.mark.parametrize(("m", "owner", "reason"), [
    (UNSIGNED, "", "its manifest is not signed by the run owner (the owner signs it once: diloco-node run sign)"),
    (UNSIGNED, OWNER, "its manifest is not signed by the run owner"),
    (manifest.sign(permissioned(OTHER_OWNER), OTHER), OWNER, "its manifest is of a run of another owner, not of"),
    (OPEN, OWNER, "its manifest is of an open run, not of --run-owner"),
    # signed by a key other than the one it names: a peer's own key proves nothing
    (dataclasses.replace(UNSIGNED, signature=manifest.sign(permissioned(OTHER_OWNER), OTHER).signature), "",
     "its manifest's signature is not the run owner's"),
    # the owner's valid signature of another manifest of the run (its settings changed since)
    (dataclasses.replace(UNSIGNED, signature=manifest.sign(permissioned(inner_steps=7), KEY).signature), OWNER,
     "its manifest's signature is not the run owner's"),
    # the owner's signature of an admission token: never of a manifest
    (dataclasses.replace(UNSIGNED, signature=_token_signature()), OWNER, "its manifest's signature is not the run"),
    (dataclasses.replace(UNSIGNED, signature=str(SIGNED.signature)[:-2]), OWNER, "signature is not the run owner's"),
    (dataclasses.replace(UNSIGNED, signature=str(SIGNED.signature) + "=="), OWNER, "its manifest's signature is "
     "malformed"),
    (dataclasses.replace(UNSIGNED, signature="A" * 200), OWNER, "its manifest's signature is malformed"),
    (dataclasses.replace(UNSIGNED, signature=str(SIGNED.signature) + "\n"), OWNER, "signature is malformed"),
    (dataclasses.replace(UNSIGNED, signature=""), OWNER, "its manifest's signature is malformed"),
], ids=["unsigned", "unsigned, owner given", "another owner's run", "open run, owner given", "another key",
        "another manifest", "an admission's", "truncated", "padded", "oversized", "newline", "empty"])
def test_a_manifest_not_signed_by_the_owner_is_refused_in_one_line(m: Manifest, owner: str, reason: str) -> None:
    assert reason in refusal(m, owner)


def _raw_key_text(key: object) -> str:
    return admission._b64(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))  # type: ignore[attr-defined]


RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
UNKNOWN_KEYS = [
    RSA_KEY.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode(),
    "ssh-ed25519 " + OWNER, "ssh-foo AAAA", _raw_key_text(ed448.Ed448PrivateKey.generate().public_key()),
    OWNER[:-1], OWNER + "AA", "", "====", "ü" * 43, "\udc80", "\x00" * 43, "x" * 200,
]


@pytest.mark.parametrize("owner_text", UNKNOWN_KEYS, ids=[f"key{i}" for i in range(len(UNKNOWN_KEYS))])
def test_a_manifest_naming_a_key_of_an_unknown_type_is_refused_never_raised(owner_text: str) -> None:
    """The owner a manifest names is a peer's text: a key cryptography cannot load as the owner's is
    a refusal like a bad signature (a past bug: UnsupportedAlgorithm escaped the seal check)."""
    raw = SIGNED.to_json()
    raw["settings"]["run_owner"] = owner_text
    try:
        named = dataclasses.replace(manifest.parse(json.dumps(raw).encode()), signature=SIGNED.signature)
    except ManifestError as exc:  # as the wire gives it: a lone surrogate, an RSA key's 200+ characters
        assert (owner_text == "\udc80" or len(owner_text) > 200) and "setting run_owner is not a text" in str(exc)
        named = dataclasses.replace(SIGNED, settings={**SIGNED.settings, "run_owner": owner_text})
        if owner_text == "\udc80":
            return
    if owner_text:
        assert refusal(named).startswith("its manifest's signature cannot be checked: ")
        assert str(named.signature_state()).startswith("its signature cannot be checked")
    else:  # names no owner: an open run's
        assert check_signed(named).signature is None
    assert signature_refusal(owner_text, SIGNED.signed_bytes(), SIGNED.signature) is not None


def test_a_key_type_cryptography_does_not_support_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(_data: bytes) -> Ed25519PublicKey:
        raise UnsupportedAlgorithm("ed25519 is not supported by this backend")

    monkeypatch.setattr(admission.Ed25519PublicKey, "from_public_bytes", unsupported)
    assert refusal(SIGNED).startswith("its manifest's signature cannot be checked: ")
    with pytest.raises(AdmissionError, match="is not a run owner's public key"):
        parse_public_key(OWNER)
    monkeypatch.undo()

    class Unverifiable:
        def verify(self, *_: object) -> None:
            raise UnsupportedAlgorithm("no")

    monkeypatch.setattr(admission, "parse_public_key", lambda _text: Unverifiable())
    assert signature_refusal(OWNER, SIGNED.signed_bytes(), SIGNED.signature) == "is not the run owner's"

    def raises_anything(_text: str) -> None:
        raise RuntimeError("a later cryptography's surprise")

    monkeypatch.setattr(admission, "parse_public_key", raises_anything)
    assert signature_refusal(OWNER, SIGNED.signed_bytes(), SIGNED.signature) == "cannot be checked"


# --- fuzz: a peer's signature and header never raise --------------------------------------------


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=140),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)


@FUZZ
@given(signature=st.one_of(JSON_VALUES, st.text(alphabet="ABCDEFabcdef0123456789-_=+/ \n", max_size=200)),
       owner=st.one_of(st.just(OWNER), st.text(max_size=80)))
def test_any_signature_or_owner_text_is_refused_or_valid_never_raised(signature: object, owner: str) -> None:
    why = signature_refusal(owner, SIGNED.signed_bytes(), signature)
    assert why is None and signature == SIGNED.signature and owner == OWNER or isinstance(why, str)
    named = dataclasses.replace(SIGNED, settings={**SIGNED.settings, "run_owner": owner})
    try:
        taken = check_signed(dataclasses.replace(named, signature=signature))  # type: ignore[arg-type]
    except ManifestError as exc:
        assert "\n" not in str(exc)
        return
    assert taken.signature in (None, SIGNED.signature)


@FUZZ
@given(cut=st.integers(0, 85), junk=st.text(alphabet="ABCDEFabcdef0123456789-_", min_size=1, max_size=4))
def test_a_damaged_signature_is_refused(cut: int, junk: str) -> None:
    signature = str(SIGNED.signature)
    damaged = signature[:cut] + junk + signature[cut + len(junk):]
    if damaged != signature:
        with pytest.raises(ManifestError):
            check_signed(dataclasses.replace(SIGNED, signature=damaged))


@FUZZ
@given(signature=JSON_VALUES)
def test_a_server_header_with_any_signature_field_parses_bounded_or_is_refused(signature: object) -> None:
    data = json.dumps({"run_id": "perm", "size": 10, "signature": signature}).encode()
    try:
        header = parse_header(data, None)
    except ManifestError as exc:
        assert str(exc).startswith("malformed answer") and "\n" not in str(exc)
        return
    assert header.signature is None or 0 < len(header.signature) <= manifest.MAX_SIGNATURE_CHARS


def test_a_header_carries_the_signature_bounded() -> None:
    header = parse_header(json.dumps({"run_id": "perm", "size": 10, "signature": SIGNED.signature}).encode(), None)
    assert header == ("perm", 10, SIGNED.signature)
    assert parse_header(b'{"run_id": "perm", "size": 10}', None).signature is None  # an open run's, an older node's
    for bad in ("x" * (manifest.MAX_SIGNATURE_CHARS + 1), "", 5, ["a"], {"a": 1}):
        with pytest.raises(ManifestError, match=r"^malformed answer"):
            parse_header(json.dumps({"run_id": "perm", "size": 10, "signature": bad}).encode(), None)


# --- on disk and served -------------------------------------------------------------------------


def test_the_signature_lies_beside_the_copy_on_disk(tmp_path: Path) -> None:
    path = manifest.local_path(str(tmp_path), "perm")
    manifest.write_local(SIGNED, path)
    assert (tmp_path / "perm" / manifest.SIGNATURE_NAME).read_text() == f"{SIGNED.signature}\n"
    assert manifest.read_local(path).signature == SIGNED.signature
    assert manifest.read_local(path).signature_state() == "signed by the run owner"
    manifest.write_local(UNSIGNED, path)  # an unsigned copy leaves no stale signature beside it
    assert not manifest.signature_path(path).exists() and manifest.read_local(path).signature is None
    for junk in (b"x" * 500, b"\xff\xfe", b""):  # a damaged file is no signature
        manifest.signature_path(path).write_bytes(junk)
        assert manifest.read_local(path).signature is None


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServedSignature, Path]]:
    path = manifest.signature_path(manifest.local_path(str(tmp_path), "perm"))
    yield ServedSignature(UNSIGNED, OWNER, path), path


def test_a_node_serves_the_signature_from_the_moment_it_is_written(served: tuple[ServedSignature, Path],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    signature, path = served
    assert signature() is None  # nothing signed yet
    manifest.write_local(SIGNED, path.with_name(manifest.MANIFEST_NAME))
    assert signature() == SIGNED.signature  # no restart
    other = manifest.sign(permissioned(inner_steps=7), KEY).signature
    path.write_text(f"{other}\n")  # the owner's signature of another manifest: not served, said once
    with caplog.at_level(logging.WARNING):
        assert signature() is None and signature() is None
    assert sum("not serving the run owner's signature" in r.getMessage() for r in caplog.records) == 1
    path.unlink()
    assert signature() is None


def test_an_open_run_serves_no_signature(tmp_path: Path) -> None:
    path = manifest.signature_path(manifest.local_path(str(tmp_path), "open"))
    path.parent.mkdir(parents=True)
    path.write_text(f"{SIGNED.signature}\n")
    assert ServedSignature(OPEN, "", path)() is None and ServedSignature(UNSIGNED, OWNER, None)() is None


# --- the CLI: the owner signs, a joiner refuses or takes ----------------------------------------


@pytest.fixture
def owner_key(tmp_path: Path) -> Path:
    path = tmp_path / "owner.key"
    path.write_bytes(KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def test_run_sign_writes_the_signed_manifest_where_a_node_serves_it(tmp_path: Path, owner_key: Path) -> None:
    source = tmp_path / "from" / "run.json"
    manifest.write_local(UNSIGNED, source)
    done = CliRunner().invoke(main, ["run", "sign", "--owner-key", str(owner_key), "--checkpoint-dir",
                                     str(tmp_path / "ck"), str(source)])
    assert done.exit_code == 0, done.output
    path = manifest.local_path(str(tmp_path / "ck"), "perm")
    assert done.stdout == f"signed run perm's manifest {UNSIGNED.digest} (fingerprint {UNSIGNED.fingerprint}): " \
                          f"{path}, {manifest.signature_path(path)}\n"
    assert manifest.read_local(path) == UNSIGNED and manifest.read_local(path).signature == SIGNED.signature
    shown = CliRunner().invoke(main, ["run", "show", str(path)])
    assert shown.exit_code == 0 and "manifest signed by the run owner" in shown.stdout


@pytest.mark.parametrize(("m", "line"), [
    (OPEN, "run open is an open run (no --run-owner): its joiners take their --peer's manifest, there is nothing "
           "to sign"),
    (permissioned(OTHER_OWNER), f"run perm's owner is {OTHER_OWNER}, not this key's {OWNER}"),
])
def test_run_sign_refuses_in_one_line(tmp_path: Path, owner_key: Path, m: Manifest, line: str) -> None:
    source = tmp_path / "run.json"
    manifest.write_local(m, source)
    done = CliRunner().invoke(main, ["run", "sign", "--owner-key", str(owner_key), "--checkpoint-dir",
                                     str(tmp_path / "ck"), str(source)])
    assert done.exit_code == 2 and done.stderr == f"diloco-node: error: {line}\n"
    assert not (tmp_path / "ck").exists()
    done = CliRunner().invoke(main, ["run", "sign", "--owner-key", str(source), str(source)])  # not a key
    assert done.exit_code == 2 and "is not an owner key" in done.stderr and len(done.stderr.splitlines()) == 1


def _join_taking(m: Manifest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str,  # type: ignore[no-untyped-def]
                 admission: tuple[str, ...] = ("--admission", "dn1.a.b")):
    """`join --peer PEER` of a permissioned run (its identity, its `admission`, `extra`) through the real
    fetch, its peer serving `m` (what `_fetch_one` got from the network)."""
    started: list[NodeConfig] = []
    monkeypatch.setattr("diloco_node.daemon.runner.run_node", lambda cfg: started.append(cfg) or 0)

    async def from_the_peer(*_: object) -> Manifest:
        return m

    monkeypatch.setattr("diloco_node.swarm.manifests._fetch_one", from_the_peer)
    done = CliRunner().invoke(main, ["join", "--peer", PEER, "--checkpoint-dir", str(tmp_path / "ck"),
                                     "--identity", str(tmp_path / "id.key"), *admission, *extra])
    return done, started


@pytest.mark.parametrize("given_owner", [True, False], ids=["--run-owner", "the named owner"])
def test_a_permissioned_joiner_refuses_an_unsigned_manifest_in_one_line_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given_owner: bool) -> None:
    done, started = _join_taking(UNSIGNED, tmp_path, monkeypatch, *(["--run-owner", OWNER] if given_owner else []))
    assert done.exit_code == 2 and not started
    assert done.stderr == f"diloco-node: error: no run manifest taken from {PEER}: its manifest is not signed by " \
                          "the run owner (the owner signs it once: diloco-node run sign)\n"
    assert not (tmp_path / "ck" / "perm").exists()  # no run.json, no run files


BADLY_SIGNED = dataclasses.replace(UNSIGNED, signature=SIGNED.signature[:-4] + "AAAA")


@pytest.mark.parametrize("served", [UNSIGNED, BADLY_SIGNED], ids=["unsigned", "badly signed"])
def test_a_permissioned_joiner_that_named_its_run_refuses_an_unsigned_manifest_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, served: Manifest) -> None:
    """The --run-id fallback (joining with the options given, docs/running.md) is for a peer that
    serves no manifest; to a joiner given the owner's key (--run-owner) a manifest that is not its
    owner's signed one ends the joiner as it ends one with --peer alone: one line, exit 2, nothing written."""
    warned: list[str] = []
    # hivemind's log handling (set up by the CLI) keeps records from pytest's capture: the call itself
    monkeypatch.setattr(logging.getLogger("diloco_node.cli"), "warning",
                        lambda message, *args: warned.append(message % args))
    done, started = _join_taking(served, tmp_path, monkeypatch, "--run-owner", OWNER,
                                 "--run-id", "perm", "--compression", "int8")
    assert done.exit_code == 2 and not started and not warned, done.output
    assert done.stderr == f"diloco-node: error: no run manifest taken from {PEER}: {refusal(served, OWNER)}\n"
    assert "took run" not in done.stdout
    assert not (tmp_path / "ck").exists()  # no run.json, no run files


@pytest.mark.parametrize("served", [UNSIGNED, BADLY_SIGNED], ids=["unsigned", "badly signed"])
def test_a_peer_claiming_the_run_permissioned_does_not_lock_out_a_joiner_that_named_its_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, served: Manifest) -> None:
    """Without --run-owner, only the peer says the run is permissioned: a hostile peer serving such a
    manifest would otherwise stop every joiner that named its run. The joiner goes on with its own
    options, as past a peer serving no manifest (the fingerprint holds them to the run), saying why.
    (A user with an admission names its owner: --admission needs --run-owner.)"""
    warned: list[str] = []
    monkeypatch.setattr(logging.getLogger("diloco_node.cli"), "warning",
                        lambda message, *args: warned.append(message % args))
    done, started = _join_taking(served, tmp_path, monkeypatch, "--run-id", "perm", "--compression", "int8",
                                 admission=())
    assert done.exit_code == 0 and len(started) == 1, done.output
    assert started[0].codec.compression == "int8" and started[0].permission.run_owner == ""
    assert warned == [f"no run manifest taken from {PEER}: {refusal(served, '')}; "
                      "joining run perm with the options given"]
    assert not manifest.local_path(str(tmp_path / "ck"), "perm").exists()


def test_a_permissioned_joiner_that_named_its_run_still_joins_past_a_peer_serving_no_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No manifest at all (an older node): nothing shows the run unsigned, and the joiner goes on with
    the options it was given, which the fingerprint (covering --run-owner) and the admissions still
    hold to the run."""
    warned: list[str] = []
    monkeypatch.setattr(logging.getLogger("diloco_node.cli"), "warning",
                        lambda message, *args: warned.append(message % args))
    started: list[NodeConfig] = []
    monkeypatch.setattr("diloco_node.daemon.runner.run_node", lambda cfg: started.append(cfg) or 0)

    async def no_manifest(*_: object) -> Manifest:
        raise ConnectionError("protocol not supported")

    monkeypatch.setattr("diloco_node.swarm.manifests._fetch_one", no_manifest)
    done = CliRunner().invoke(main, ["join", "--peer", PEER, "--checkpoint-dir", str(tmp_path / "ck"), "--identity",
                                     str(tmp_path / "id.key"), "--admission", "dn1.a.b", "--run-owner", OWNER,
                                     "--run-id", "perm", "--compression", "int8"])
    assert done.exit_code == 0, done.output
    assert warned == [f"no run manifest taken from {PEER}: it serves no manifest (a node of an older version?); "
                      "joining run perm with the options given"]
    assert started[0].codec.compression == "int8" and started[0].permission.run_owner == OWNER
    assert not manifest.local_path(str(tmp_path / "ck"), "perm").exists()


def test_a_permissioned_joiner_takes_a_signed_manifest_and_keeps_its_signature(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done, started = _join_taking(SIGNED, tmp_path, monkeypatch, "--run-owner", OWNER)
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("took run perm: ") and "signed by the run owner), from " in done.stdout
    assert started[0].fingerprint() == SIGNED.fingerprint and started[0].permission.run_owner == OWNER
    path = manifest.local_path(str(tmp_path / "ck"), "perm")
    assert manifest.read_local(path).signature == SIGNED.signature  # it serves the signature in turn
    # another owner's key given: the signed manifest of this run is not that owner's
    done, started = _join_taking(SIGNED, tmp_path / "2", monkeypatch, "--run-owner", OTHER_OWNER)
    assert done.exit_code == 2 and "its manifest is of a run of another owner" in done.stderr and not started


def test_a_malformed_run_owner_is_one_line_before_any_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done, started = _join_taking(SIGNED, tmp_path, monkeypatch, "--run-owner", "ssh-foo AAAA")
    assert done.exit_code == 2 and done.stderr == "diloco-node: error: 'ssh-foo AAAA' is not a run owner's public " \
                                                  "key (as printed by `diloco-node keygen`)\n"


def test_an_open_runs_joiner_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[NodeConfig] = []
    monkeypatch.setattr("diloco_node.daemon.runner.run_node", lambda cfg: started.append(cfg) or 0)

    async def from_the_peer(*_: object) -> Manifest:
        return dataclasses.replace(OPEN, signature="whatever a peer sends")

    monkeypatch.setattr("diloco_node.swarm.manifests._fetch_one", from_the_peer)
    done = CliRunner().invoke(main, ["join", "--peer", PEER, "--checkpoint-dir", str(tmp_path / "ck")])
    assert done.exit_code == 0 and done.stdout.startswith("took run open: ") and "signed" not in done.stdout
    path = manifest.local_path(str(tmp_path / "ck"), "open")
    assert path.exists() and not manifest.signature_path(path).exists()
