"""Permissioned runs: a run owner's key admits peer ids, and every node checks each peer it deals
with against it.

The owner keeps an Ed25519 key (`diloco-node keygen`); its public key is the run's `--run-owner`
and part of the run's config. An admission (`diloco-node admit`) is a token the owner signs,
naming one run, one peer id and an optional expiry; a revocation (`diloco-node revoke`) names one
run and one peer id and is published in the run's DHT, where every node reads it each heartbeat.
A token carries its kind, so a revocation can never pass for an admission.

Token: `dn1.<base64url JSON claims>.<base64url signature over the JSON bytes>`.

The owner also signs the run's manifest (`diloco-node run sign`, train/manifest.py): a detached signature,
base64url like a token's, over a context line and the manifest's canonical bytes (`sign_bytes`,
`signature_refusal`). A token's signed bytes are a JSON object and a manifest's start with that
context, so neither can pass for the other.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from diloco_node import registry
from diloco_node.errors import NodeError

TOKEN_PREFIX = "dn1"
MAX_TOKEN_CHARS = 1024
MAX_SIGNATURE_CHARS = 128  # a detached signature, base64url: an Ed25519 one is 86 characters
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")
_DURATION = re.compile(r"^(\d+)([smhdw])$")
_PEER_ID = re.compile(r"^(Qm[1-9A-HJ-NP-Za-km-z]{44}|12D3KooW[1-9A-HJ-NP-Za-km-z]{44})$")  # libp2p's base58 ids
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class AdmissionError(NodeError, ValueError):
    """A key, token or admission that cannot be used, phrased as one line for the user."""


# --- the owner's key ---------------------------------------------------------------------------

def generate_owner_key(path: Path) -> str:
    """Write a new owner key to `path` (readable by its owner only, never overwriting a file) and
    return its public key, the run's `--run-owner`."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AdmissionError(f"{path} already exists; an owner key is never overwritten") from None
    except OSError as exc:
        raise AdmissionError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as file:
        file.write(pem)
    return public_key_text(key.public_key())


def load_owner_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise AdmissionError(f"cannot read owner key {path}: {exc.strerror}") from None
    except (ValueError, TypeError):
        raise AdmissionError(f"{path} is not an owner key (made by `diloco-node keygen`)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AdmissionError(f"{path} is not an owner key (made by `diloco-node keygen`)")
    return key


def public_key_text(key: Ed25519PublicKey) -> str:
    return _b64(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def parse_public_key(text: str) -> Ed25519PublicKey:
    """An owner's public key (base64url of an Ed25519 key's 32 bytes); AdmissionError for any other
    text, a key of another type included (a manifest's --run-owner is a peer's text: cryptography's
    UnsupportedAlgorithm is a refusal like the rest, never raised)."""
    try:
        raw = _unb64(text)
        if len(raw) != 32:
            raise ValueError
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        shown = ascii(text)[1:-1] if isinstance(text, str) else repr(text)  # one line, whatever it holds
        shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
        raise AdmissionError(f"'{shown}' is not a run owner's public key (as printed by `diloco-node keygen`)") \
            from None


registry.PUBLIC_KEY_CHECK.declare(parse_public_key)  # what config/ checks --run-owner with


# --- tokens ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Claims:
    kind: str  # "admit" or "revoke"
    run_id: str
    peer_id: str
    expires: float | None = None  # unix time; None: never (admissions only)


def sign(owner: Ed25519PrivateKey, claims: Claims) -> str:
    body = json.dumps({"kind": claims.kind, "run": claims.run_id, "peer": claims.peer_id,
                       "expires": claims.expires}, sort_keys=True, separators=(",", ":")).encode()
    return f"{TOKEN_PREFIX}.{_b64(body)}.{_b64(owner.sign(body))}"


def read(token: str, owner: Ed25519PublicKey, run_id: str, kind: str) -> Claims:
    """The claims of a token the owner signed for `run_id`, of `kind`; AdmissionError otherwise.
    Expiry and revocation are not checked here (see `Gate.refusal`)."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or token.count(".") != 2:
        raise AdmissionError("not an admission token")
    prefix, body_text, signature_text = token.split(".")
    try:
        if prefix != TOKEN_PREFIX:
            raise ValueError
        body, signature = _unb64(body_text), _unb64(signature_text)
        owner.verify(signature, body)
        fields = json.loads(body)
    except (ValueError, InvalidSignature):
        raise AdmissionError("not signed by the run owner") from None
    expires = fields.get("expires")
    claims = Claims(fields.get("kind"), fields.get("run"), fields.get("peer"),
                    float(expires) if isinstance(expires, (int, float)) else None)
    if claims.kind != kind:
        raise AdmissionError(f"a {claims.kind} token, not an {kind} token")
    if claims.run_id != run_id:
        raise AdmissionError(f"issued for run '{claims.run_id}', not '{run_id}'")
    if not isinstance(claims.peer_id, str):
        raise AdmissionError("names no peer id")
    return claims


def sign_bytes(owner: Ed25519PrivateKey, data: bytes) -> str:
    """A detached signature of `data` with the owner's key, base64url (as a token carries its own)."""
    return _b64(owner.sign(data))


def signature_refusal(owner: str, data: bytes, signature: object) -> str | None:
    """Why `signature` is not the signature of `data` by the owner whose public key is `owner`
    (`--run-owner`'s text); None when it is. Both may be a peer's: a malformed signature, a key of
    an unknown type or shape, and anything cryptography raises are refusals, never exceptions."""
    if not isinstance(signature, str) or not 0 < len(signature) <= MAX_SIGNATURE_CHARS \
            or not _BASE64URL.fullmatch(signature):
        return "is malformed"
    try:
        key = parse_public_key(owner)
    except Exception as exc:  # AdmissionError; whatever else a peer's text makes cryptography raise
        return f"cannot be checked: {exc}" if isinstance(exc, AdmissionError) else "cannot be checked"
    try:
        raw = _unb64(signature)
        if _b64(raw) != signature:  # one text per signature: no spare bits set in its last character
            return "is malformed"
        key.verify(raw, data)
    except Exception:  # InvalidSignature, a wrong length, or any other refusal of a peer's bytes
        return "is not the run owner's"
    return None


def check_peer_id(text: str) -> str:
    if not _PEER_ID.match(text):
        raise AdmissionError(f"'{text}' is not a peer id (as printed by `diloco-node identity PATH`)")
    return text


def parse_expiry(text: str, now: float | None = None) -> float | None:
    """'never', a duration (90m, 12h, 30d, 2w) or a date (2026-12-31, UTC) → unix time or None."""
    now = time.time() if now is None else now
    if text == "never":
        return None
    if match := _DURATION.match(text):
        return now + int(match[1]) * _UNIT_SECONDS[match[2]]
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise AdmissionError(f"--expires '{text}' is not 'never', a duration like 30d or 12h, "
                             "or a date like 2026-12-31") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def load_token(value: str) -> str:
    """An admission given as the token itself or as a file holding it."""
    if value.startswith(f"{TOKEN_PREFIX}."):
        return value.strip()
    try:
        return Path(value).read_text().strip()
    except OSError as exc:
        raise AdmissionError(f"--admission '{value}' is neither a token nor a readable file ({exc.strerror})") \
            from None


# --- the check every node runs ---------------------------------------------------------------

class Gate:
    """Which peers this node deals with. An open run (no owner) admits everyone; a permissioned
    run admits a peer that shows a valid, unexpired, unrevoked admission for its own peer id."""

    def __init__(self, run_id: str, owner: Ed25519PublicKey | None = None, token: str = ""):
        self.run_id, self.owner, self.token = run_id, owner, token
        self._revoked: set[str] = set()
        self._lock = threading.Lock()  # the heartbeat adds revocations while handlers check

    @property
    def permissioned(self) -> bool:
        return self.owner is not None

    def refusal(self, peer_id: str, token: str, now: float | None = None) -> str | None:
        """Why `peer_id`, showing `token`, is not admitted; None when it is."""
        if self.owner is None:
            return None
        try:
            claims = read(token, self.owner, self.run_id, "admit")
        except AdmissionError as exc:
            return str(exc)
        if claims.peer_id != peer_id:
            return f"admission is for peer {claims.peer_id}"
        if claims.expires is not None and claims.expires <= (time.time() if now is None else now):
            return "admission expired"
        with self._lock:
            if peer_id in self._revoked:
                return "admission revoked"
        return None

    def own_refusal(self, peer_id: str) -> str | None:
        """Why our own admission would not let us in, phrased for our user; None when it would."""
        why = self.refusal(peer_id, self.token)
        return None if why is None else f"--admission does not admit this node ({peer_id}): {why}"

    def add_revocations(self, tokens: list[str]) -> set[str]:
        """Take in the run's published revocations (the invalid ones are ignored); returns the peer
        ids revoked for the first time."""
        if self.owner is None:
            return set()
        fresh = set()
        for token in tokens:
            try:
                fresh.add(read(token, self.owner, self.run_id, "revoke").peer_id)
            except AdmissionError:
                continue
        with self._lock:
            fresh -= self._revoked
            self._revoked |= fresh
        return fresh


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url") from None
