"""The wire format of one pseudo-gradient payload, validated before anything is allocated.

    magic "DLCP" | version u8 | codec u8 | dtype u8 | reserved u8 | numel u64 | body length u64 |
    crc32 of body u32 | body

Version 1 knows one codec, `none` (fp32, little-endian). Decoding checks the header against what
the receiver expects (the model's parameter count), so a truncated, oversized, mismatched or
corrupt payload raises CodecError and costs at most one header's worth of work.
"""

from __future__ import annotations

import struct
import zlib

import torch

MAGIC = b"DLCP"
VERSION = 1
HEADER = struct.Struct("<4sBBBBQQI")
CODEC_NONE = 0
DTYPE_FP32 = 0


class CodecError(ValueError):
    """A payload that cannot be decoded; the round drops it and goes on."""


def max_payload_bytes(numel: int) -> int:
    return HEADER.size + 4 * numel


def encode(flat: torch.Tensor) -> bytes:
    """fp32 vector → payload bytes."""
    body = flat.detach().to(torch.float32).contiguous().numpy().tobytes()
    header = HEADER.pack(MAGIC, VERSION, CODEC_NONE, DTYPE_FP32, 0, flat.numel(), len(body), zlib.crc32(body))
    return header + body


def decode(payload: bytes, expected_numel: int) -> torch.Tensor:
    """payload bytes → fp32 vector of `expected_numel` finite values, or CodecError."""
    if len(payload) < HEADER.size:
        raise CodecError(f"payload of {len(payload)} bytes is shorter than its header")
    magic, version, codec, dtype, _, numel, length, checksum = HEADER.unpack_from(payload)
    if magic != MAGIC or version != VERSION:
        raise CodecError(f"unknown payload format (magic={magic!r}, version={version})")
    if codec != CODEC_NONE or dtype != DTYPE_FP32:
        raise CodecError(f"unsupported codec {codec} / dtype {dtype}")
    if numel != expected_numel:
        raise CodecError(f"payload holds {numel} values, the model has {expected_numel}")
    if length != 4 * numel or len(payload) != HEADER.size + length:
        raise CodecError(f"payload length {len(payload) - HEADER.size} does not match its header ({length})")
    body = memoryview(payload)[HEADER.size:]
    if zlib.crc32(body) != checksum:
        raise CodecError("payload checksum mismatch")
    flat = torch.frombuffer(bytearray(body), dtype=torch.float32)
    if not torch.isfinite(flat).all():
        raise CodecError("payload holds non-finite values")
    return flat
