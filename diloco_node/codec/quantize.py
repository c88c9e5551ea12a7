"""Dense lossy codecs: fp16, bf16, and blockwise absmax int8 / int4.

Each codec turns a flat fp32 vector into a raw body (bytes) and back; headers and zstd are the
wire layer's business. Bodies (little-endian):

    fp16 / bf16   n × 2 B
    int8          ⌈n/B⌉ bf16 scales | n int8 values in [-127, 127]
    int4          ⌈n/B⌉ bf16 scales | ⌈n/2⌉ bytes, two values in [-7, 7] per byte (+8, low nibble first)

Why bf16 scales and not fp16: a block's scale is max|x|/127, and pseudo-gradients are small
(measured max |Δ| ≈ 7e-3 on the tiny model after 20 steps), so scales sit around 5e-5 — below
fp16's smallest normal (6.1e-5), where fp16 loses precision and flushes to 0 under 6e-8. bf16 has
fp32's range at the same 2 bytes. Scales are rounded *up* to the next bf16 so that no value
exceeds ±127 · scale: the round-trip error stays ≤ scale/2 per value with the scale as sent.
"""

from __future__ import annotations

import torch

from diloco_node.codec.wire import CodecError

FP16_MAX = 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
MAX_BLOCK = 1 << 24


def to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def from_bytes(raw: bytearray, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` elements of `dtype` at byte `offset` of `raw`; lengths were validated by the header."""
    return torch.frombuffer(raw, dtype=dtype, count=count, offset=offset)


def check_finite(values: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(values).all()):
        raise CodecError(f"{what} holds non-finite values")


def scales_up(absmax: torch.Tensor, levels: float) -> torch.Tensor:
    """bf16 scales ≥ absmax / levels: round to nearest, then step one ulp up where that fell short.
    Positive bf16 values order like their bit patterns, so +1 on the int16 view is the next one up."""
    exact = absmax / levels
    scale = exact.to(torch.bfloat16)
    short = scale.float() < exact
    bits = scale.view(torch.int16) + short.to(torch.int16)
    return bits.view(torch.bfloat16)


def read_scales(raw: bytearray, count: int) -> torch.Tensor:
    scales = from_bytes(raw, 0, count, torch.bfloat16).float()
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise CodecError("payload holds negative or non-finite scales")
    return scales


# --- fp16 / bf16: plain casts; clamp so an outlier saturates instead of becoming inf -------------


def half_length(numel: int, a: int, b: int) -> int:
    if a or b:
        raise CodecError(f"fp16/bf16 take no parameters, got ({a}, {b})")
    return 2 * numel


def encode_half(flat: torch.Tensor, dtype: torch.dtype) -> bytes:
    limit = FP16_MAX if dtype == torch.float16 else BF16_MAX
    return to_bytes(flat.clamp(-limit, limit).to(dtype))


def decode_half(raw: bytearray, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return from_bytes(raw, 0, numel, dtype).float()


# --- blockwise absmax int8 / int4 ----------------------------------------------------------------


def block_count(numel: int, block: int) -> int:
    if not 1 <= block <= MAX_BLOCK:
        raise CodecError(f"block size {block} is out of range [1, {MAX_BLOCK}]")
    return -(-numel // block)


def int8_length(numel: int, block: int, b: int) -> int:
    if b:
        raise CodecError(f"int8 takes one parameter, got a second ({b})")
    return 2 * block_count(numel, block) + numel


def int4_length(numel: int, block: int, b: int) -> int:
    if b:
        raise CodecError(f"int4 takes one parameter, got a second ({b})")
    return 2 * block_count(numel, block) + (numel + 1) // 2


def quantize_blocks(flat: torch.Tensor, block: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 scales per block, int8 codes in [-levels, levels] for the n values)."""
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, block_count(n, block) * block - n)).view(-1, block)
    scales = scales_up(blocks.abs().amax(dim=1), levels)
    divisor = scales.float().masked_fill(scales == 0, 1.0)  # an all-zero block stays zero
    codes = torch.round(blocks / divisor[:, None]).clamp_(-levels, levels).to(torch.int8)
    return scales, codes.view(-1)[:n]


def dequantize_blocks(scales: torch.Tensor, codes: torch.Tensor, block: int) -> torch.Tensor:
    n = codes.numel()
    expanded = scales.repeat_interleave(block)[:n]
    return codes.float().mul_(expanded)


def encode_int8(flat: torch.Tensor, block: int) -> bytes:
    scales, codes = quantize_blocks(flat, block, 127)
    return to_bytes(scales) + to_bytes(codes)


def decode_int8(raw: bytearray, numel: int, block: int) -> torch.Tensor:
    nb = block_count(numel, block)
    scales = read_scales(raw, nb)
    codes = from_bytes(raw, 2 * nb, numel, torch.int8)
    if bool((codes == -128).any()):  # the encoder's range is symmetric; -128 means a forged body
        raise CodecError("int8 code -128 is outside the codec's range")
    return dequantize_blocks(scales, codes, block)


def encode_int4(flat: torch.Tensor, block: int) -> bytes:
    scales, codes = quantize_blocks(flat, block, 7)
    nibbles = (codes + 8).to(torch.uint8)  # [1, 15]; nibble 0 never occurs
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])  # pad with a zero value
    pairs = nibbles.view(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    return to_bytes(scales) + to_bytes(packed)


def decode_int4(raw: bytearray, numel: int, block: int) -> torch.Tensor:
    nb = block_count(numel, block)
    scales = read_scales(raw, nb)
    packed = from_bytes(raw, 2 * nb, (numel + 1) // 2, torch.uint8)
    nibbles = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:numel]
    if bool((nibbles == 0).any()):  # would be -8: outside [-7, 7], so not from our encoder
        raise CodecError("int4 code -8 is outside the codec's range")
    codes = nibbles.to(torch.int8) - 8
    return dequantize_blocks(scales, codes, block)
