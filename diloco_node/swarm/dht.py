"""The swarm's start-up: hivemind's DHT under our identity, whether peers can dial us, and the run
owner's one-off revocation store. Every start-up failure becomes one SwarmError line."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator

from diloco_node.errors import NodeError
from diloco_node.swarm import identity, records, serializer
from diloco_node.swarm.reachability import detect
from diloco_node.trust.admission import Gate
from diloco_node.trust.seals import Sealer

logger = logging.getLogger(__name__)

BOOTSTRAP_ATTEMPTS = 3


class SwarmError(NodeError, RuntimeError):
    """A problem joining or talking to the swarm, phrased as one line for the user."""


@dataclass(frozen=True)
class SwarmSettings:
    run_id: str
    fingerprint: str
    config: dict[str, Any]  # the fingerprinted fields, shown to peers when refusing them
    initial_peers: Sequence[str]
    listen: Sequence[str]
    announce: Sequence[str]
    matchmaking_time: float
    round_timeout: float
    max_payload_bytes: int  # the most one encoded vector may take (the codec's bound; NoLoCo sends two)
    group_size: int | None = None  # NoLoCo: at most this many per group; None: one group for everyone
    identity: Path | None = None  # libp2p key file (swarm/identity.py); None: a new peer id each start
    gate: Gate | None = None  # who is admitted (trust/admission.py); None: an open run
    # groups of at least this many exchange by butterfly (butterfly.py), smaller ones by all-gather;
    # None: always all-gather. Fingerprinted config decides it, so every member of a group agrees.
    butterfly_from: int | None = None
    butterfly_possible: bool = False  # whether the run can exchange by butterfly (a group with a client must)
    reachability: str = "auto"  # public, private or auto (reachability.py)
    min_group_size: int = 2  # smaller groups take no outer step (round.held); hivemind forms none below it
    # how long the barrier waits for peers (None: round_timeout); shorter under --round-seconds, where a
    # peer not ready soon after the common deadline is frozen or gone (docs/architecture.md §13)
    barrier_timeout: float | None = None
    upload_limit: float = 0.0  # bytes/s every stream of ours sends at most together; 0: no cap (throttle.py)
    download_limit: float = 0.0  # bytes/s they receive at most together; 0: no cap
    manifest: Any = None  # the run's manifest.Manifest, served to whoever asks (swarm/manifests.py); None: none
    # the run owner's signature of it, when there is one to serve (manifest.ServedSignature); None: the manifest's own
    manifest_signature: Any = None


def start_dht(settings: SwarmSettings) -> tuple[DHT, RSASignatureValidator, Sealer]:
    """Start hivemind's DHT under our libp2p identity, with the signer of our records and the sealer
    of our butterfly parts, both holding that identity's key; a first contact that fails is
    retried, since busy peers answer late."""
    serializer.bound()  # before the DHT's helper process is forked: one peer's store could kill it
    path = settings.identity or identity.ephemeral()
    try:
        identity.create(path)
        key = identity.load(path)
        signed_by, sealer = records.signer(key), Sealer(key)
        attempt = 1
        while True:
            try:
                return DHT(initial_peers=list(settings.initial_peers), host_maddrs=list(settings.listen),
                           announce_maddrs=list(settings.announce) or None, start=True, startup_timeout=30,
                           record_validators=records.validators(settings.run_id, signed_by,
                                                                settings.gate.owner if settings.gate else None),
                           identity_path=str(path), client_mode=settings.reachability == "private"), signed_by, sealer
            except Exception as exc:  # hivemind reports p2pd and bootstrap failures as generic errors
                message = explain_start_failure(settings, exc)
                if attempt == BOOTSTRAP_ATTEMPTS or not message.startswith("cannot reach"):
                    raise SwarmError(message) from None
                logger.warning("attempt=%d %s; retrying", attempt, message)
                attempt += 1
    finally:
        if settings.identity is None:  # p2pd has read it; a key of a node that keeps no identity leaves no trace
            shutil.rmtree(path.parent, ignore_errors=True)


def is_client(settings: SwarmSettings, dht: DHT, namespace: str) -> bool:
    """Whether we join as a client (reachability.py): declared, or no peer could dial us back."""
    if settings.reachability != "auto":
        return settings.reachability == "private"
    reachable = detect(dht, namespace, settings.initial_peers)
    if reachable is False:
        if not settings.butterfly_possible:
            raise SwarmError("no peer can connect to this node (behind a NAT?), and this run exchanges by all-gather, "
                             "which needs it: forward a port and --announce it, or join a run that can use butterfly")
        logger.warning("no peer can connect to this node (behind a NAT?): joining as a client")
    elif reachable is None and settings.initial_peers:
        logger.info("no peer could tell whether it can connect to us; taking us as reachable")
    return reachable is False


def publish_revocation(initial_peers: Sequence[str], run_id: str, token: str, owner: Ed25519PublicKey) -> None:
    """Store the owner's revocation `token` in the run's DHT (reached through `initial_peers`)."""
    serializer.bound()
    try:
        dht = DHT(initial_peers=list(initial_peers), start=True, client_mode=True, startup_timeout=30,
                  record_validators=records.validators(run_id, RSASignatureValidator(), owner))
    except Exception as exc:  # hivemind reports bootstrap failures as generic errors
        raise SwarmError(f"cannot reach any peer ({', '.join(initial_peers)}): {str(exc).splitlines()[0]}") from None
    try:
        if not records.publish_revocation(dht, run_id, token):
            raise SwarmError("no node of the run stored the revocation")
    finally:
        dht.shutdown()


def explain_start_failure(settings: SwarmSettings, exc: Exception) -> str:
    text = str(exc)
    if "already taken" in text:  # hivemind checks that no live peer holds this identity
        return (f"identity {settings.identity} is in use by another running node; "
                "give each node its own --identity")
    if "address already in use" in text.lower():
        return f"cannot listen on {', '.join(settings.listen)}: address already in use"
    if settings.initial_peers and ("bootstrap" in text.lower() or "connect" in text.lower()):
        return f"cannot reach any peer ({', '.join(settings.initial_peers)}): {text.splitlines()[0]}"
    return f"cannot start the swarm node: {text.splitlines()[0] if text else type(exc).__name__}"
