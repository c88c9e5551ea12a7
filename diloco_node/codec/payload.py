"""One class that chains transform → zstd → header for every codec (docs/architecture.md §2).

Only the transform differs between codecs, so one `PayloadCodec` composes a `Transform` (a few
plain functions from quantize.py / sparse.py) rather than six subclasses. codecs.make_codec builds
it; the config side of the codecs (codecs.py) stays free of torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from diloco_node.codec import quantize, sparse, wire
from diloco_node.codec.codecs import FEEDBACK, CodecConfig

# zstd where it pays, measured on a real pseudo-gradient (tiny model, 20 AdamW steps, level 3):
#   none 4.00 → 3.57 B/param (−11 %)   fp16 2.00 → 1.79 (−11 %)   bf16 2.00 → 1.51 (−24 %)
#   int8 1.031 → 1.022 (−1 %)          int4 0.531 → 0.486 (−8.5 %) topk 0.070 → 0.055 (−22 %, gap-coded
#   offsets)                           sign 0.0935 → no gain (sign bits are random)
# zstd level 3 runs at ≥ 300 MB/s of fp32 input per core, faster than any link it saves bytes on,
# so it is on wherever it saves a few percent; int8 codes are near-uniform after absmax scaling
# and gain ≈ 1 %, not worth ~20 % of the encode time. pack() also sends a body raw when zstd
# would make it bigger, so `zstd=True` never costs bytes.
ZSTD_PAYS: dict[str, bool] = {"none": True, "fp16": True, "bf16": True, "int8": False, "int4": True, "topk": True,
                             "sign": False}  # sign bits are incompressible



@dataclass(frozen=True)
class Transform:
    codec: int  # wire codec id
    dtype: int  # wire dtype id of the body's values
    params: tuple[int, int]  # what goes in the header's param_a / param_b
    raw_length: Callable[[int, int, int], int]  # (numel, a, b) → body bytes, validating a and b
    encode: Callable[[torch.Tensor], bytes]
    decode: Callable[[bytearray, int, int, int], torch.Tensor]  # (raw, numel, a, b)


def _transform(cfg: CodecConfig) -> Transform:
    codec_id, bs, chunk, k = wire.CODEC_IDS[cfg.name], cfg.block_size, cfg.topk_chunk, cfg.topk_k
    if cfg.name == "none":
        t = Transform(codec_id, wire.DTYPE_FP32, (0, 0), lambda n, a, b: 2 * quantize.half_length(n, a, b),
                      quantize.to_bytes, lambda raw, n, a, b: quantize.from_bytes(raw, 0, n, torch.float32))
    elif cfg.name in ("fp16", "bf16"):
        dtype = torch.float16 if cfg.name == "fp16" else torch.bfloat16
        t = Transform(codec_id, wire.DTYPE_FP16 if cfg.name == "fp16" else wire.DTYPE_BF16, (0, 0),
                      quantize.half_length, partial(quantize.encode_half, dtype=dtype),
                      lambda raw, n, a, b: quantize.decode_half(raw, n, dtype))
    elif cfg.name == "int8":
        t = Transform(codec_id, wire.DTYPE_INT8, (bs, 0), quantize.int8_length,
                      partial(quantize.encode_int8, block=bs), lambda raw, n, a, b: quantize.decode_int8(raw, n, a))
    elif cfg.name == "int4":
        t = Transform(codec_id, wire.DTYPE_INT4, (bs, 0), quantize.int4_length,
                      partial(quantize.encode_int4, block=bs), lambda raw, n, a, b: quantize.decode_int4(raw, n, a))
    elif cfg.name == "sign":
        per_mille = round(1000 * cfg.sign_keep)
        t = Transform(codec_id, wire.DTYPE_INT1, (cfg.sign_block, per_mille), sparse.sign_length,
                      partial(sparse.encode_sign, block=cfg.sign_block, per_mille=per_mille), sparse.decode_sign)
    else:
        bits = cfg.topk_bits
        t = Transform(codec_id, wire.DTYPE_BITS.get(bits, wire.DTYPE_INT8), (chunk, k),
                      partial(sparse.topk_length, bits=bits), partial(sparse.encode_topk, chunk=chunk, k=k, bits=bits),
                      partial(sparse.decode_topk, bits=bits))
    t.raw_length(1, *t.params)  # a bad config fails here, at start-up, not in the first round
    return t


class PayloadCodec:
    """flat fp32 ⇄ wire payload for one codec. Stateless except the error feedback of top-k and sign."""

    def __init__(self, cfg: CodecConfig) -> None:
        self.name = cfg.name
        self._transform = _transform(cfg)
        use_zstd = ZSTD_PAYS[cfg.name] if cfg.zstd is None else cfg.zstd
        self._zstd_level = cfg.zstd_level if use_zstd else None
        self._feedback = sparse.ErrorFeedback(cfg.ef_decay) if cfg.name in FEEDBACK else None

    def encode(self, flat: torch.Tensor) -> bytes:
        flat = flat.detach().reshape(-1).float()
        t = self._transform
        if self._feedback is None:
            quantize.check_finite(flat, "pseudo-gradient to encode")  # peers would drop it anyway
            return wire.pack(t.codec, t.dtype, flat.numel(), t.params, t.encode(flat.contiguous()), self._zstd_level)
        accumulated = self._feedback.accumulate(flat)
        raw = t.encode(accumulated)
        # What peers will decode, from the raw body itself, so the residual matches the wire exactly.
        sent = t.decode(bytearray(raw), flat.numel(), *t.params)
        self._feedback.commit(accumulated, sent)
        return wire.pack(t.codec, t.dtype, flat.numel(), t.params, raw, self._zstd_level)

    def decode(self, payload: bytes, expected_numel: int) -> torch.Tensor:
        t = self._transform
        header, raw = wire.unpack(payload, expected_numel, t.codec, t.dtype, t.raw_length, t.params)
        flat = t.decode(raw, header.numel, header.param_a, header.param_b)
        quantize.check_finite(flat, "payload")
        return flat

    def state_dict(self) -> dict[str, Any]:
        return {} if self._feedback is None else self._feedback.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if self._feedback is not None:
            self._feedback.load_state_dict(d)
