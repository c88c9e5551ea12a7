"""Top-k per chunk with error feedback: the ≈ 0.05–0.1 B/param codec.

The vector is cut into chunks of C values (the last one zero-padded) and each chunk keeps its k
largest |x|. Per-chunk selection, rather than one global top-k, keeps the kept entries spread over
all layers and lets an offset within the chunk stand for an index. Offsets go in ascending order
as gaps, o₀ then o_i − o_{i−1} − 1 (uint8 when C ≤ 256, else uint16): small numbers that zstd
codes in ≈ 5 bits instead of 8 (k = 24 of 256: 0.054 B/param instead of 0.094), and a body cannot
name an offset twice. Kept values are absmax-quantized with one bf16 scale per chunk (bf16 for the
reason given in quantize.py). Body, little-endian, with m = ⌈n/C⌉ chunks:

    m bf16 scales | m·k offset gaps (uint8 or uint16), chunk by chunk | m·k values, same order

Values are int8 in [-127, 127] (`bits` = 8), or b-bit codes c (b = 4, 2, 1) packed low bits first,
⌈m·k·b/8⌉ bytes, standing for (c − (2^b − 1)/2)·scale: a quantizer without a zero level, since a
kept value is never the smallest of its chunk (b = 1 sends sign × absmax). Fewer bits per value
buy more values per byte: at 2 bits, k = 18 of 256 costs what k = 10 costs at 8.

`sign` is the same idea at block granularity, for AdamW's pseudo-gradient, whose values are near
±constant within a tensor (Adam normalizes each step): a block of B values goes as B sign bits and
one bf16 scale, its mean |x| (the L2-best scale for signs), which keeps ≈ 85 % of its energy where
top-k at the same bytes keeps ≈ 20 %. Only the blocks of largest norm are sent, a fixed share per
mille p of the m = ⌈n/B⌉ blocks (q = max(1, ⌊m·p/1000⌋) of them), named by a bitmap. Body:

    q bf16 scales | ⌈m/8⌉ bytes of bitmap (block i at bit i % 8 of byte i // 8) | q·B/8 bytes of signs (1 = negative)

What is not sent is not lost: ErrorFeedback keeps it in a residual that joins the next round's
pseudo-gradient (docs/architecture.md §3: e ← β·e + Δ; send C(e); e ← e − D(C(e))).
"""

from __future__ import annotations

import logging

import torch

from diloco_node.codec.quantize import check_finite, from_bytes, read_scales, scales_up, to_bytes
from diloco_node.codec.wire import MAX_CHUNK, CodecError

logger = logging.getLogger(__name__)

VALUE_BITS = (8, 4, 2, 1)  # bits per kept value


def offset_dtype(chunk: int) -> torch.dtype:
    return torch.uint8 if chunk <= 256 else torch.uint16


def topk_length(numel: int, chunk: int, k: int, bits: int = 8) -> int:
    if not 1 <= k <= chunk <= MAX_CHUNK:
        raise CodecError(f"top-k parameters chunk={chunk}, k={k} are out of range (1 ≤ k ≤ chunk ≤ {MAX_CHUNK})")
    if bits not in VALUE_BITS:
        raise CodecError(f"top-k value bits must be one of {', '.join(map(str, VALUE_BITS))}, got {bits}")
    chunks = -(-numel // chunk)
    offset_bytes = 1 if offset_dtype(chunk) == torch.uint8 else 2
    return chunks * (2 + k * offset_bytes) + -(-chunks * k * bits // 8)


def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """uint8 codes < 2^bits, 8/bits to a byte, the first in the lowest bits; the last byte zero-padded."""
    per = 8 // bits
    codes = torch.nn.functional.pad(codes, (0, -codes.numel() % per)).view(-1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return to_bytes((codes << shifts).sum(dim=1, dtype=torch.uint8))


def unpack_codes(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:count]


def encode_topk(flat: torch.Tensor, chunk: int, k: int, bits: int = 8) -> bytes:
    n = flat.numel()
    chunks = -(-n // chunk)
    rows = torch.nn.functional.pad(flat, (0, chunks * chunk - n)).view(chunks, chunk)
    # sorted=False: sorting the k indices afterwards is cheaper than sorting by value
    offsets = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    kept = rows.gather(1, offsets)
    gaps = torch.cat([offsets[:, :1], offsets.diff(dim=1) - 1], dim=1)
    half = 127 if bits == 8 else ((1 << bits) - 1) / 2  # largest |code|, in units of the scale
    scales = scales_up(kept.abs().amax(dim=1), half)
    divisor = scales.float().masked_fill(scales == 0, 1.0)
    scaled = kept / divisor[:, None]
    if bits == 8:
        values = to_bytes(torch.round(scaled).clamp_(-127, 127).to(torch.int8))
    else:
        values = pack_codes(torch.round(scaled + half).clamp_(0, 2 * half).to(torch.uint8).view(-1), bits)
    return to_bytes(scales) + to_bytes(gaps.to(offset_dtype(chunk))) + values


def decode_topk(raw: bytearray, numel: int, chunk: int, k: int, bits: int = 8) -> torch.Tensor:
    chunks = -(-numel // chunk)
    dtype = offset_dtype(chunk)
    scales = read_scales(raw, chunks)
    gaps = from_bytes(raw, 2 * chunks, chunks * k, dtype).view(chunks, k)
    offsets = (gaps.to(torch.int64) + 1).cumsum(dim=1) - 1  # strictly ascending
    if bool((offsets[:, -1] >= chunk).any()):
        raise CodecError(f"top-k offset outside its chunk of {chunk}")
    start = 2 * chunks + chunks * k * gaps.element_size()
    if bits == 8:
        codes = from_bytes(raw, start, chunks * k, torch.int8).float()
        if bool((codes == -128).any()):
            raise CodecError("int8 code -128 is outside the codec's range")
    else:  # every b-bit code is a valid value
        packed = from_bytes(raw, start, -(-chunks * k * bits // 8), torch.uint8)
        codes = unpack_codes(packed, chunks * k, bits).float().sub_(((1 << bits) - 1) / 2)
    values = codes.view(chunks, k).mul_(scales[:, None])
    rows = torch.zeros(chunks, chunk)
    rows.scatter_(1, offsets, values)
    return rows.view(-1)[:numel]


def sign_blocks(numel: int, block: int, per_mille: int) -> tuple[int, int]:
    """(m blocks, q of them sent)."""
    if not (8 <= block <= MAX_CHUNK and block % 8 == 0 and 1 <= per_mille <= 1000):
        raise CodecError(f"sign parameters block={block}, per mille={per_mille} are out of range (block a multiple "
                         f"of 8 in [8, {MAX_CHUNK}], 1 ≤ per mille ≤ 1000)")
    blocks = -(-numel // block)
    return blocks, max(1, blocks * per_mille // 1000)


def sign_length(numel: int, block: int, per_mille: int) -> int:
    blocks, sent = sign_blocks(numel, block, per_mille)
    return sent * (2 + block // 8) + -(-blocks // 8)


def encode_sign(flat: torch.Tensor, block: int, per_mille: int) -> bytes:
    blocks, sent = sign_blocks(flat.numel(), block, per_mille)
    rows = torch.nn.functional.pad(flat, (0, blocks * block - flat.numel())).view(blocks, block)
    chosen = rows.square().sum(dim=1).topk(sent, sorted=False).indices.sort().values
    bitmap = torch.zeros(blocks, dtype=torch.uint8).index_fill_(0, chosen, 1)
    kept = rows[chosen]
    scales = kept.abs().mean(dim=1).to(torch.bfloat16)
    return to_bytes(scales) + pack_codes(bitmap, 1) + pack_codes((kept < 0).to(torch.uint8).view(-1), 1)


def decode_sign(raw: bytearray, numel: int, block: int, per_mille: int) -> torch.Tensor:
    blocks, sent = sign_blocks(numel, block, per_mille)
    scales = read_scales(raw, sent)
    chosen = unpack_codes(from_bytes(raw, 2 * sent, -(-blocks // 8), torch.uint8), blocks, 1).bool()
    if int(chosen.sum()) != sent:
        raise CodecError(f"sign bitmap names {int(chosen.sum())} blocks, the header {sent}")
    negative = unpack_codes(from_bytes(raw, 2 * sent + -(-blocks // 8), sent * block // 8, torch.uint8),
                            sent * block, 1).view(sent, block)
    rows = torch.zeros(blocks, block)
    rows[chosen] = (1.0 - 2.0 * negative.float()).mul_(scales[:, None])
    return rows.view(-1)[:numel]


class ErrorFeedback:
    """The part of past pseudo-gradients not yet sent. With decay β = 1 nothing is ever lost:
    Σ inputs = Σ decoded sends + residual (up to fp32 rounding). β < 1 forgets old residue."""

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = decay
        self.residual: torch.Tensor | None = None

    def accumulate(self, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """e ← β·e + Δ, returned (the vector to compress); not yet committed, see `commit`."""
        check_finite(pseudo_gradient, "pseudo-gradient to encode")  # NaN would poison e for good
        if self.residual is not None and self.residual.numel() != pseudo_gradient.numel():
            logger.warning("error-feedback residual of %d values dropped: pseudo-gradient has %d",
                           self.residual.numel(), pseudo_gradient.numel())
            self.residual = None
        if self.residual is None:
            return pseudo_gradient.detach().float().clone()
        return self.residual.mul(self.decay).add_(pseudo_gradient.detach().float())

    def commit(self, accumulated: torch.Tensor, sent: torch.Tensor) -> None:
        """e ← accumulated − D(C(accumulated)): only once the payload exists, so a failed encode
        leaves the residual as it was."""
        self.residual = accumulated.sub_(sent)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.residual is None else {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        residual = state.get("residual")
        if residual is not None:
            residual = residual.detach().float().reshape(-1).clone()
            check_finite(residual, "error-feedback residual")
        self.residual = residual
