"""Serving the run's manifest (manifest.py) to whoever asks, and fetching it from a `--peer` address.

A libp2p stream handler on the node's P2P daemon, like the state's (swarm/statesync.py): a joiner
given `--peer ADDR` can reach exactly that address (the status server listens on loopback by
default, and on another port). The handler's name is the same in every run, so a joiner that knows
no run id yet can ask; the answer says which run the node serves. The manifest is public (run
settings, the model's config, the tokenizer): an open run's joiner needs it before anything else,
and a permissioned run admits peers, not readers of its settings.

Wire: request {"run_id": ID or ""} → header {"run_id": the node's, "size": N (0: not that run),
and in a permissioned run whose owner signed the manifest "signature": the owner's detached
signature (manifest.sign, at most 128 characters)} → the manifest's N bytes, each message
length-prefixed (streams.send). Everything a peer sends is bounded before it is read and parsed by
manifest.parse: one line, never a traceback. A joiner takes a permissioned run's manifest only with
a valid signature by the run's owner (manifest.check_signed); an older joiner ignores the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hivemind.p2p import P2P, PeerID

from diloco_node.errors import NodeError
from diloco_node.swarm.streams import PEER_FAILURES, Limits, Streams, StreamService, parse_json, receive, send
from diloco_node.train.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    ManifestUnsigned,
    check_signature_text,
    check_signed,
    parse,
)

logger = logging.getLogger(__name__)

HANDLER = "diloco_manifest_v1"  # one name for every run: a joiner may not know the run id
MAX_REQUEST_BYTES = 256
MAX_HEADER_BYTES = 512  # a run id of 64 characters and a signature of 128 fit well within it
READ_TIMEOUT = 10.0
CONNECT_TIMEOUT = 30.0  # starting our own p2p daemon and reaching the peer
# a few asks per peer: joiners ask once, `run show` once; a third of the strangers' slots per host
# group (streams.Limits), since a joiner asks once and does not retry, and a lab's machines behind one
# address start together
MANIFEST_LIMITS = Limits(per_peer=2, total=16, rate=1.0, burst=4.0, reserved=4, per_host=4)


class ManifestUnavailable(NodeError, RuntimeError):
    """No peer given served a manifest we could take (each one's reason, in one line). `unsigned`:
    some peer served a permissioned run's manifest its owner did not sign (manifest.ManifestUnsigned),
    so the run is known to be permissioned and a joiner may not go on without a signed one."""

    def __init__(self, message: str, unsigned: bool = False):
        super().__init__(message)
        self.unsigned = unsigned


class ManifestService(StreamService):
    """Serves `manifest` (its bytes, encoded once) to every peer that asks, with the run owner's
    signature `signature()` gives when it gives one (manifest.ServedSignature: the node's run.sig,
    read again when it changes); without `signature`, the manifest's own, if any."""

    def __init__(self, streams: Streams, manifest: Manifest, signature: Callable[[], str | None] | None = None):
        super().__init__(streams, HANDLER, MANIFEST_LIMITS)
        self._run_id, self._data = manifest.run_id, manifest.encode()
        self._signature = signature if signature is not None else lambda: manifest.signature

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)
        try:
            request = parse_json(await receive(reader, MAX_REQUEST_BYTES, READ_TIMEOUT), max_depth=1)
            wanted = request.get("run_id", "") if isinstance(request, dict) else None
            if not isinstance(wanted, str):
                raise ValueError("malformed request")
            ours = wanted in ("", self._run_id)
            header: dict[str, Any] = {"run_id": self._run_id, "size": len(self._data) if ours else 0}
            if ours and (signature := self._signature()) is not None:
                header["signature"] = signature
            await send(writer, json.dumps(header).encode())
            if ours:
                await send(writer, self._data)
        except PEER_FAILURES as exc:
            self._refuse_once(peer, type(exc).__name__, "manifest request from peer=%s failed: %s", peer,
                              str(exc)[:120] or type(exc).__name__)
        finally:
            writer.close()


class Header(NamedTuple):
    run_id: str  # the run the server serves
    size: int  # its manifest's bytes
    signature: str | None  # the run owner's signature of it, as sent (bounded; checked by check_signed)


def parse_header(data: bytes, wanted: str | None) -> Header:
    """A server's header; ManifestError for anything else, and when it serves another run than `wanted`."""
    try:
        header = parse_json(data, max_depth=1)
    except ValueError:
        raise ManifestError("malformed answer") from None
    run_id, size = (header.get("run_id"), header.get("size")) if isinstance(header, dict) else (None, None)
    if not isinstance(run_id, str) or isinstance(size, bool) or not isinstance(size, int) \
            or not 0 <= size <= MAX_MANIFEST_BYTES:
        raise ManifestError("malformed answer")
    if size == 0:
        raise ManifestError(f"it serves run {run_id[:64]!r}, not {wanted!r}")
    try:
        signature = check_signature_text(header.get("signature"))
    except ManifestError as exc:
        raise ManifestError(f"malformed answer ({exc})") from None
    return Header(run_id, size, signature)


async def _ask(p2p: P2P, peer: str, wanted: str | None) -> Manifest:
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(PeerID.from_base58(peer), HANDLER),
                                               READ_TIMEOUT)
    try:
        await send(writer, json.dumps({"run_id": wanted or ""}).encode())
        header = parse_header(await receive(reader, MAX_HEADER_BYTES, READ_TIMEOUT), wanted)
        manifest = parse(await receive(reader, MAX_MANIFEST_BYTES, READ_TIMEOUT))
    finally:
        writer.close()
    if manifest.run_id != header.run_id or (wanted and manifest.run_id != wanted):
        raise ManifestError(f"its manifest is of run {manifest.run_id!r}, not {wanted or header.run_id!r}")
    return dataclasses.replace(manifest, signature=header.signature)


async def _fetch_one(address: str, wanted: str | None) -> Manifest:
    p2p = await P2P.create(initial_peers=[address], host_maddrs=[], no_listen=True, dht_mode="client",
                           auto_nat=False, nat_port_map=False, use_relay=False, startup_timeout=CONNECT_TIMEOUT)
    try:
        return await _ask(p2p, address.rsplit("/p2p/", 1)[1], wanted)
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ManifestError):
        return str(exc)
    if isinstance(exc, ValueError) and "exceeds the limit" in str(exc):
        return f"its answer is too large ({exc})"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "handler" in text.lower() or "protocol" in text.lower():
        return "it serves no manifest (a node of an older version?)"
    if isinstance(exc, ConnectionError | asyncio.IncompleteReadError):
        return f"it broke off its answer ({text[:120]})"
    if isinstance(exc, TimeoutError):
        return "it did not answer in time"
    if isinstance(exc, ValueError):  # parse_json's refusals of a request or header
        return f"malformed answer ({text[:120]})"
    return f"cannot reach it ({text[:120]})"


def fetch(addresses: Sequence[str], wanted: str | None, owner: str = "", signed: bool = True) -> tuple[Manifest, str]:
    """The run's manifest from the first of `addresses` that serves one we take, and that address;
    ManifestUnavailable naming each address's reason otherwise. `wanted`: the run id, when known.
    `signed`: take a permissioned run's manifest only when its owner signed it (`owner`: the
    joiner's --run-owner, '' for the one the manifest names; manifest.check_signed); without it (`run
    show`, `run sign`), as it came, its signature unchecked."""
    reasons, unsigned = [], False
    for address in addresses:
        try:
            manifest = asyncio.run(asyncio.wait_for(_fetch_one(address, wanted), CONNECT_TIMEOUT + 3 * READ_TIMEOUT))
            return (check_signed(manifest, owner) if signed else manifest), address
        except (ManifestError, *PEER_FAILURES, OSError, RuntimeError) as exc:
            unsigned = unsigned or isinstance(exc, ManifestUnsigned)
            reasons.append(f"{address}: {_reason(exc)}")
            logger.debug("manifest from %s not taken", address, exc_info=True)
        except Exception as exc:  # hivemind's daemon and bootstrap errors are generic
            reasons.append(f"{address}: {_reason(exc)}")
    raise ManifestUnavailable("no run manifest taken from " + "; ".join(reasons), unsigned)
