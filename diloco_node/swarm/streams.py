"""Length-prefixed messages on libp2p streams, the framing of our two protocols (payloads, state)."""

from __future__ import annotations

import asyncio

HEADER_LEN = 8


async def send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(len(data).to_bytes(HEADER_LEN, "big"))
    writer.write(data)
    await writer.drain()


async def receive(reader: asyncio.StreamReader, limit: int, timeout: float) -> bytes:
    """Read one message, refusing (before allocating) anything over `limit`."""
    header = await asyncio.wait_for(reader.readexactly(HEADER_LEN), timeout)
    length = int.from_bytes(header, "big")
    if length > limit:
        raise ValueError(f"message of {length} bytes exceeds the limit of {limit}")
    return await asyncio.wait_for(reader.readexactly(length), timeout)
