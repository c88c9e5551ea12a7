"""The manifest's wire (swarm/manifests.py) between real p2p daemons on loopback: served and taken
whole, another run named, a node of an older version that serves none, and hostile servers (an
oversized announcement, junk), each one line naming the address, never a traceback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from hivemind import DHT

from diloco_node.config import NodeConfig
from diloco_node.swarm.manifests import HANDLER, ManifestService, ManifestUnavailable, fetch
from diloco_node.swarm.streams import Streams, receive, send
from diloco_node.train import manifest

Handler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Streams, str]]:
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    streams = Streams(dht)
    try:
        yield streams, str(dht.get_visible_maddrs()[0])
    finally:
        streams.close()
        dht.shutdown()


def serving(streams: Streams, handler: Handler) -> None:
    streams.run(streams.p2p.add_binary_stream_handler(HANDLER, handler), 10)


def unserve(streams: Streams) -> None:
    streams.run(streams.p2p.remove_binary_stream_handler(HANDLER), 10)


def refusal(address: str, wanted: str | None = None) -> str:
    with pytest.raises(ManifestUnavailable) as caught:
        fetch([address], wanted)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"no run manifest taken from {address}: "), text
    return text.removeprefix(f"no run manifest taken from {address}: ")


def test_a_node_of_an_older_version_serves_none(node: tuple[Streams, str]) -> None:
    assert refusal(node[1]) == "it serves no manifest (a node of an older version?)"
    with pytest.raises(ManifestUnavailable) as caught:
        fetch([node[1]], None)
    assert not caught.value.unsigned  # nothing says the run is permissioned: a named run may join on its options


def test_served_and_taken_whole_with_or_without_a_run_id(node: tuple[Streams, str]) -> None:
    streams, address = node
    m = manifest.build(NodeConfig(run_id="wire", sync="blocking"), 1234)
    service = ManifestService(streams, m)
    service.attach()
    try:
        assert fetch([address], None) == (m, address)
        assert fetch([address], "wire") == (m, address)
        assert refusal(address, "other") == "it serves run 'wire', not 'other'"
    finally:
        service.detach()


def test_a_permissioned_runs_manifest_is_taken_only_with_its_owners_signature(node: tuple[Streams, str]) -> None:
    """Served beside the manifest in the header; served once the owner's signature is there (a
    node's run.sig, read again on each ask: `signature`), and `run show` takes either as it is."""
    from tests.unit.test_manifest_signed import KEY, OWNER, SIGNED, UNSIGNED

    streams, address = node
    signature: list[str | None] = [None]
    service = ManifestService(streams, UNSIGNED, lambda: signature[0])
    service.attach()
    try:
        assert refusal(address) == "its manifest is not signed by the run owner (the owner signs it once: " \
                                   "diloco-node run sign)"
        with pytest.raises(ManifestUnavailable, match="its manifest is not signed by the run owner") as caught:
            fetch([address], None, OWNER)
        assert caught.value.unsigned  # the run is known permissioned: no --run-id fallback (join.config_of_run)
        assert fetch([address], None, signed=False)[0].signature is None  # `run show`, `run sign`
        signature[0] = manifest.sign(manifest.build(NodeConfig(run_id="perm", run_owner=OWNER, admission="dn1.a.b",
                                                                identity="id.key", inner_steps=7), 1234),
                                     KEY).signature  # the owner's, of another manifest
        assert refusal(address) == "its manifest's signature is not the run owner's"
        signature[0] = SIGNED.signature
        taken, _ = fetch([address], "perm", OWNER)
        assert taken == SIGNED and taken.signature == SIGNED.signature
    finally:
        service.detach()


async def _read_request(reader: asyncio.StreamReader) -> None:
    await receive(reader, 256, 5)


@pytest.mark.parametrize(("answer", "reason"), [
    ([b'{"run_id": "wire", "size": 99}', None], "it broke off its answer"),  # announced, never sent
    ([b'{"run_id": "wire", "size": 99999999999}'], "malformed answer"),  # over the bound: refused unread
    ([b"\xff" * 40], "malformed answer"),
    ([b'{"run_id": "wire", "size": 5}', b"{bad}"], "malformed manifest: not JSON"),
    ([b'{"run_id": "wire", "size": 2}', b"[]"], "malformed manifest: not a JSON object"),
    ([b'{"run_id": "wire", "size": 2, "signature": 7}', b"{}"], "malformed answer (malformed signature"),
    ([b'{"run_id": "wire", "size": 2, "signature": "' + b"A" * 400 + b'"}', b"{}"], "malformed answer (malformed"),
    ([b'{"run_id": "wire", "size": 2, "signature": "' + b"A" * 600 + b'"}', b"{}"], "its answer is too large"),
])
def test_hostile_servers_are_one_line(node: tuple[Streams, str], answer: list[bytes | None], reason: str) -> None:
    streams, address = node

    async def hostile(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        for message in answer:
            if message is not None:
                await send(writer, message)
        writer.close()

    serving(streams, hostile)
    try:
        assert refusal(address).startswith(reason)
    finally:
        unserve(streams)


def test_an_oversized_message_is_refused_before_it_is_read(node: tuple[Streams, str]) -> None:
    streams, address = node

    async def huge(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await send(writer, b'{"run_id": "wire", "size": 10}')
        writer.write((1 << 40).to_bytes(8, "big"))  # announces a terabyte
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    serving(streams, huge)
    try:
        assert refusal(address).startswith("its answer is too large (message of 1099511627776 bytes exceeds")
    finally:
        unserve(streams)
