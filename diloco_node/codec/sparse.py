"""Top-k per chunk with error feedback: the ≈ 0.05 B/param codec.

The vector is cut into chunks of C values (the last one zero-padded) and each chunk keeps its k
largest |x|. Per-chunk selection, rather than one global top-k, keeps the kept entries spread over
all layers and lets an offset within the chunk stand for an index: uint8 when C ≤ 256, else
uint16. Kept values are int8 absmax-quantized with one bf16 scale per chunk (bf16 for the reason
given in quantize.py). Body, little-endian, with m = ⌈n/C⌉ chunks:

    m bf16 scales | m·k offsets (uint8 or uint16), chunk by chunk | m·k int8 values

What is not sent is not lost: ErrorFeedback keeps it in a residual that joins the next round's
pseudo-gradient (DESIGN §3: e ← β·e + Δ; send C(e); e ← e − D(C(e))).
"""

from __future__ import annotations

import logging

import torch

from diloco_node.codec.quantize import check_finite, from_bytes, read_scales, scales_up, to_bytes
from diloco_node.codec.wire import MAX_CHUNK, CodecError

logger = logging.getLogger(__name__)


def offset_dtype(chunk: int) -> torch.dtype:
    return torch.uint8 if chunk <= 256 else torch.uint16


def topk_length(numel: int, chunk: int, k: int) -> int:
    if not 1 <= k <= chunk <= MAX_CHUNK:
        raise CodecError(f"top-k parameters chunk={chunk}, k={k} are out of range (1 ≤ k ≤ chunk ≤ {MAX_CHUNK})")
    chunks = -(-numel // chunk)
    offset_bytes = 1 if offset_dtype(chunk) == torch.uint8 else 2
    return chunks * (2 + k * (offset_bytes + 1))


def encode_topk(flat: torch.Tensor, chunk: int, k: int) -> bytes:
    n = flat.numel()
    chunks = -(-n // chunk)
    rows = torch.nn.functional.pad(flat, (0, chunks * chunk - n)).view(chunks, chunk)
    # sorted=False: order does not matter to the decoder and sorting costs time
    offsets = rows.abs().topk(k, dim=1, sorted=False).indices
    kept = rows.gather(1, offsets)
    scales = scales_up(kept.abs().amax(dim=1), 127)
    divisor = scales.float().masked_fill(scales == 0, 1.0)
    codes = torch.round(kept / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    return to_bytes(scales) + to_bytes(offsets.to(offset_dtype(chunk))) + to_bytes(codes)


def decode_topk(raw: bytearray, numel: int, chunk: int, k: int) -> torch.Tensor:
    chunks = -(-numel // chunk)
    dtype = offset_dtype(chunk)
    scales = read_scales(raw, chunks)
    offsets = from_bytes(raw, 2 * chunks, chunks * k, dtype)
    if chunk < 1 << (8 * offsets.element_size()) and bool((offsets.to(torch.int32) >= chunk).any()):
        raise CodecError(f"top-k offset outside its chunk of {chunk}")
    codes = from_bytes(raw, 2 * chunks + chunks * k * offsets.element_size(), chunks * k, torch.int8)
    if bool((codes == -128).any()):
        raise CodecError("int8 code -128 is outside the codec's range")
    values = codes.float().view(chunks, k).mul_(scales[:, None])
    rows = torch.zeros(chunks, chunk)
    # Duplicate offsets can only come from a forged body; one of them wins, the result stays bounded.
    rows.scatter_(1, offsets.view(chunks, k).long(), values)
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
