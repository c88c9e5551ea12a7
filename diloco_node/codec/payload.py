"""One class that chains transform → zstd → header for every codec (docs/architecture.md §3).

Only the transform differs between codecs, so one `PayloadCodec` composes a `Transform` rather than
seven subclasses: the codec's spec (codecs.py: wire ids, header parameters, error feedback, zstd)
and its kernel here, a few plain functions from quantize.py / sparse.py, the one per-codec fact
that needs torch. codecs.make_codec builds it; the config side of the codecs (codecs.py) stays free
of torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from diloco_node.codec import quantize, sparse, wire
from diloco_node.codec.codecs import SPECS, CodecConfig

Encode = Callable[[torch.Tensor], bytes]
Decode = Callable[[bytearray, int, int, int], torch.Tensor]  # (raw, numel, a, b)
Kernel = tuple[wire.RawLength, Encode, Decode]


@dataclass(frozen=True)
class Transform:
    codec: int  # wire codec id
    dtype: int  # wire dtype id of the body's values
    params: tuple[int, int]  # what goes in the header's param_a / param_b
    raw_length: wire.RawLength  # (numel, a, b) → body bytes, validating a and b
    encode: Encode
    decode: Decode


def _half(dtype: torch.dtype) -> Kernel:
    return (quantize.half_length, partial(quantize.encode_half, dtype=dtype),
            lambda raw, n, a, b: quantize.decode_half(raw, n, dtype))


# Each codec's kernel under a config: (raw length, encode, decode), keyed like codecs.SPECS.
KERNELS: dict[str, Callable[[CodecConfig], Kernel]] = {
    "none": lambda cfg: (lambda n, a, b: 2 * quantize.half_length(n, a, b), quantize.to_bytes,
                         lambda raw, n, a, b: quantize.from_bytes(raw, 0, n, torch.float32)),
    "fp16": lambda cfg: _half(torch.float16),
    "bf16": lambda cfg: _half(torch.bfloat16),
    "int8": lambda cfg: (quantize.int8_length, partial(quantize.encode_int8, block=cfg.block_size),
                         lambda raw, n, a, b: quantize.decode_int8(raw, n, a)),
    "int4": lambda cfg: (quantize.int4_length, partial(quantize.encode_int4, block=cfg.block_size),
                         lambda raw, n, a, b: quantize.decode_int4(raw, n, a)),
    "topk": lambda cfg: (partial(sparse.topk_length, bits=cfg.topk_bits),
                         partial(sparse.encode_topk, chunk=cfg.topk_chunk, k=cfg.topk_k, bits=cfg.topk_bits),
                         partial(sparse.decode_topk, bits=cfg.topk_bits)),
    "sign": lambda cfg: (sparse.sign_length,
                         partial(sparse.encode_sign, block=cfg.sign_block, per_mille=cfg.sign_per_mille),
                         sparse.decode_sign),
}
if KERNELS.keys() != SPECS.keys():
    raise RuntimeError(f"codecs without a kernel or kernels without a codec: {KERNELS.keys() ^ SPECS.keys()}")


def _transform(cfg: CodecConfig) -> Transform:
    spec = cfg.spec
    t = Transform(spec.wire_id, spec.wire_dtype(cfg), spec.header_params(cfg), *KERNELS[cfg.name](cfg))
    t.raw_length(1, *t.params)  # a bad config fails here, at start-up, not in the first round
    return t


class PayloadCodec:
    """flat fp32 ⇄ wire payload for one codec. Stateless except the error feedback of top-k and sign."""

    def __init__(self, cfg: CodecConfig) -> None:
        self.name = cfg.name
        self._transform = _transform(cfg)
        use_zstd = cfg.spec.zstd if cfg.zstd is None else cfg.zstd
        self._zstd_level = cfg.zstd_level if use_zstd else None
        self._feedback = sparse.ErrorFeedback(cfg.ef_decay) if cfg.spec.feedback else None

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
