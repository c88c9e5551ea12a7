"""zstd, the last stage of every codec: lossless, so it only changes bytes on the wire, never values.

Decompression is where a hostile peer could hurt us (a "zstd bomb": a few bytes that expand to
gigabytes), so `decompress` is told the exact raw size the header promised — already checked
against the model size — and refuses any frame that claims or produces anything else. zstd
allocates the output from the frame's declared content size, *not* from max_output_size, so the
declared size is compared first, before any allocation.
"""

from __future__ import annotations

import zstandard

from diloco_node.codec.wire import CodecError


def compress(raw: bytes, level: int) -> bytes:
    # write_content_size (the default) puts the raw size in the frame header; decompress relies on it.
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)


def decompress(body: bytes | memoryview, raw_length: int) -> bytes:
    """One zstd frame of exactly `raw_length` bytes, nothing before or after it, or CodecError."""
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd body has no readable frame header: {exc}") from None
    if declared != raw_length:  # -1 (unknown size) lands here too: we always write it
        raise CodecError(f"zstd frame declares {declared} bytes, the header promised {raw_length}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=raw_length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd body: {exc}") from None
    if len(raw) != raw_length:
        raise CodecError(f"zstd body expanded to {len(raw)} bytes, the header promised {raw_length}")
    return raw
