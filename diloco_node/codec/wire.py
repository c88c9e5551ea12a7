"""The wire format of one pseudo-gradient payload, validated before anything is allocated.

    magic "DLCP" | version u8 | codec u8 | dtype u8 | flags u8 | numel u64 |
    param_a u32 | param_b u32 | body length u64 | raw length u64 | crc32 u32 | body

All little-endian (so are the bodies: every supported host is). `codec` is the codec's wire id,
`dtype` what its values are, and `param_a`/`param_b` the codec parameters a receiver needs (block
size; top-k chunk and k; 0 where unused): each codec's are in its spec (codecs.py). The body is the raw
codec output, or its zstd frame when flag ZSTD is set; the checksum covers every header field
before it and the body as sent, so a flipped header bit (an unused parameter included) cannot
decode into something else.

Version 2 adds codecs, flags and codec parameters to version 1 (fp32 only); version 1 payloads are
refused. Decoding checks every header field against what the receiver expects (the model's
parameter count, its own codec and the codec parameters of the run's config) and against the raw
length that numel and the parameters imply, so a truncated, oversized, mismatched, corrupt or
inflated payload raises CodecError after at most a header's worth of work; memory is only ever
allocated up to the expected raw size.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diloco_node.errors import NodeError

if TYPE_CHECKING:
    pass

MAGIC = b"DLCP"
VERSION = 2
HEADER = struct.Struct("<4sBBBBQIIQQI")

DTYPE_FP32, DTYPE_FP16, DTYPE_BF16, DTYPE_INT8, DTYPE_INT4, DTYPE_INT2, DTYPE_INT1 = 0, 1, 2, 3, 4, 5, 6
DTYPE_BITS = {8: DTYPE_INT8, 4: DTYPE_INT4, 2: DTYPE_INT2, 1: DTYPE_INT1}  # values whose bits a parameter sets (top-k)
FLAG_ZSTD = 1
KNOWN_FLAGS = FLAG_ZSTD
MAX_CHUNK = 1 << 16  # top-k offsets are at most uint16

# Raw length given (numel, param_a, param_b); raises CodecError when the parameters are out of range.
RawLength = Callable[[int, int, int], int]


class CodecError(NodeError, ValueError):
    """A payload that cannot be decoded (or a vector that cannot be encoded); the round drops it."""


@dataclass(frozen=True)
class Header:
    codec: int
    dtype: int
    flags: int
    numel: int
    param_a: int
    param_b: int
    body_length: int
    raw_length: int
    checksum: int


def max_raw_bytes(numel: int) -> int:
    """Worst raw body over all codecs and valid parameters: fp32 is 4n; top-k with k = C = 1 is
    5n (2 B scale + 2 B offset + 1 B value per kept entry) plus one partly padded chunk."""
    return 5 * numel + 3 * MAX_CHUNK + 2


def max_payload_bytes(numel: int) -> int:
    """No valid payload of any codec is larger: zstd is only kept when it shrinks the body."""
    return HEADER.size + max_raw_bytes(numel)


def _checksum(header: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview) -> int:
    """crc32 over the header (its own checksum field zeroed) and the body."""
    zeroed = bytes(header[: HEADER.size - 4]) + b"\0\0\0\0"
    return zlib.crc32(body, zlib.crc32(zeroed))


def seal(fields: tuple[Any, ...], body: bytes) -> bytes:
    """Header from its fields (all but the checksum) + the checksum + the body."""
    return HEADER.pack(*fields, _checksum(HEADER.pack(*fields, 0), body)) + body


def pack(codec: int, dtype: int, numel: int, params: tuple[int, int], raw: bytes, zstd_level: int | None) -> bytes:
    """Header + body; the body is zstd-compressed when a level is given and that makes it smaller."""
    from diloco_node.codec import entropy  # entropy imports CodecError from here

    flags, body = 0, raw
    if zstd_level is not None:
        packed = entropy.compress(raw, zstd_level)
        if len(packed) < len(raw):  # incompressible bodies travel raw: zstd only where it pays
            flags, body = FLAG_ZSTD, packed
    return seal((MAGIC, VERSION, codec, dtype, flags, numel, *params, len(body), len(raw)), body)


def read_header(payload: bytes | bytearray | memoryview) -> Header:
    if len(payload) < HEADER.size:
        raise CodecError(f"payload of {len(payload)} bytes is shorter than its header ({HEADER.size})")
    magic, version, *fields = HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise CodecError(f"not a pseudo-gradient payload (magic={magic!r})")
    if version != VERSION:
        raise CodecError(f"payload format version {version}, this node speaks {VERSION}")
    return Header(*fields)


def split_first(payload: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
    """Split payloads sent back to back (NoLoCo sends Δ then φ) into the first and the rest.

    Only the first header's body length is trusted here; each part is fully validated when decoded.
    """
    header = read_header(payload)
    end = HEADER.size + header.body_length
    if end >= len(payload):
        raise CodecError(f"payload of {len(payload)} bytes lacks the part after its first {end}")
    return bytes(payload[:end]), bytes(payload[end:])


def unpack(
    payload: bytes | bytearray | memoryview, expected_numel: int, codec: int, dtype: int, raw_length: RawLength,
    params: tuple[int, int] | None = None,
) -> tuple[Header, bytearray]:
    """Validate every header field, the checksum and the zstd frame; return the raw body.
    `params`: the codec parameters the run's config fixes (fingerprinted, so every node of a run
    has the same); a header naming others is refused before they are used (a sender's block size
    of 2^24 in a 1 KB payload)."""
    from diloco_node.codec import entropy

    header = read_header(payload)
    if header.codec != codec or header.dtype != dtype:
        raise CodecError(f"payload codec {header.codec}/dtype {header.dtype}, expected {codec}/{dtype}")
    if header.flags & ~KNOWN_FLAGS:
        raise CodecError(f"unknown flags {header.flags:#x}")
    if header.numel != expected_numel:
        raise CodecError(f"payload holds {header.numel} values, the model has {expected_numel}")
    if params is not None and (header.param_a, header.param_b) != params:
        raise CodecError(f"payload codec parameters {header.param_a}/{header.param_b}, the run's are "
                         f"{params[0]}/{params[1]}")
    expected_raw = raw_length(header.numel, header.param_a, header.param_b)  # checks the parameters
    if header.raw_length != expected_raw:
        raise CodecError(f"raw length {header.raw_length} does not match numel and codec ({expected_raw})")
    zstd = bool(header.flags & FLAG_ZSTD)
    if header.body_length > header.raw_length or (not zstd and header.body_length != header.raw_length):
        raise CodecError(f"body length {header.body_length} is inconsistent with raw length {header.raw_length}")
    if len(payload) != HEADER.size + header.body_length:
        raise CodecError(f"payload body is {len(payload) - HEADER.size} bytes, its header says {header.body_length}")
    body = memoryview(payload)[HEADER.size:]
    if _checksum(payload[: HEADER.size], body) != header.checksum:
        raise CodecError("payload checksum mismatch")
    # bytearray: torch.frombuffer wants a writable buffer, and the result must not alias `payload`
    raw = bytearray(entropy.decompress(body, header.raw_length) if zstd else body)
    return header, raw
