"""The codec seam: a config, a Protocol, and make_codec, which builds payload.PayloadCodec.

Every codec is the same pipeline (docs/architecture.md §2): [error feedback] → quantize / sparsify → zstd →
versioned header, built by payload.py. This module holds what a config needs to know of the codecs
(their names, parameters and defaults, declared into registry.py) and imports no torch: the CLI
reads these defaults to build its options and to refuse bad input, and must not pay torch's
import for that (tests/unit/test_cli_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from diloco_node import registry
from diloco_node.codec.wire import CodecError

if TYPE_CHECKING:
    import torch

    from diloco_node.config import NodeConfig

CODECS: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "int4", "topk", "sign")
FEEDBACK: tuple[str, ...] = ("topk", "sign")  # the codecs that drop values, and so keep a residual


@dataclass(frozen=True)
class CodecConfig:
    name: str = "none"
    # Defaults measured on the same real Δ (tests/unit/test_codecs.py checks the bytes):
    # block 64 vs 128: int8 rel. error 0.0038 vs 0.0039, int4 0.068 vs 0.071, for +0.016 B/param;
    # 64 keeps int4 ≤ 0.49 B/param after zstd while holding more outliers to a small block.
    block_size: int = 64  # int8 / int4: values per bf16 scale
    # top-k: C = 256 keeps offsets at 1 byte, and captures the most energy per byte sent (1.33 vs
    # 1.14–1.24 for C = 128, 512, 1024, 4096 at equal budget); k = 8 lands at 0.055 B/param on the
    # wire ((2 + 8·2) / 256 = 0.070 before zstd, which codes the offset gaps in ≈ 5 bits).
    topk_chunk: int = 256
    topk_k: int = 8
    topk_bits: int = 8  # bits per kept value: 8, 4, 2 or 1 (sparse.py)
    # sign: 256 values per scale keeps 85 % of the energy on a real Δ (64: 86 %) for 1/4 of the scale
    # bytes; 0.7 of the blocks lands at (2 + 32)/256 · 0.7 = 0.093 B/param
    sign_block: int = 256
    sign_keep: float = 0.7  # share of blocks sent per round, the largest by norm
    ef_decay: float = 1.0  # error feedback β: 1 = nothing unsent is ever forgotten
    zstd_level: int = 3
    zstd: bool | None = None  # None = payload.ZSTD_PAYS[name]


class Codec(Protocol):
    name: str

    def encode(self, flat: torch.Tensor) -> bytes: ...
    def decode(self, payload: bytes, expected_numel: int) -> torch.Tensor: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, d: dict[str, Any]) -> None: ...


def make_codec(cfg: CodecConfig) -> Codec:
    if cfg.name not in CODECS:
        raise ValueError(f"unknown codec '{cfg.name}' (known codecs: {', '.join(CODECS)})")
    if not -7 <= cfg.zstd_level <= 22:  # zstd's fast (negative) and normal levels
        raise ValueError(f"zstd_level must be in [-7, 22], got {cfg.zstd_level}")
    if not 0.0 <= cfg.ef_decay <= 1.0:
        raise ValueError(f"ef_decay must be in [0, 1], got {cfg.ef_decay}")
    from diloco_node.codec.payload import PayloadCodec  # torch: only once a codec is built

    try:
        return PayloadCodec(cfg)
    except CodecError as exc:  # parameter ranges are checked by the same code that checks headers
        raise ValueError(f"codec '{cfg.name}': {exc}") from None


def codec_config_of(cfg: NodeConfig) -> CodecConfig:
    """The codec a node's config asks for."""
    return CodecConfig(name=cfg.compression, block_size=cfg.block_size, topk_chunk=cfg.topk_chunk,
                       topk_k=cfg.topk_k, topk_bits=cfg.topk_bits, sign_block=cfg.sign_block,
                       sign_keep=cfg.sign_keep, ef_decay=cfg.ef_decay, zstd_level=cfg.zstd_level,
                       zstd={"auto": None, "on": True, "off": False}[cfg.zstd])


def _check(cfg: NodeConfig) -> None:
    make_codec(codec_config_of(cfg))  # its own range checks, phrased for the user


# What config.py checks --compression and the codec parameters against (registry.py).
_DECODE_PARAMS: dict[str, tuple[str, ...]] = {"int8": ("block_size",), "int4": ("block_size",),
                                              "topk": ("topk_chunk", "topk_k", "topk_bits"),
                                              "sign": ("sign_block", "sign_keep")}
registry.CODECS.declare({name: registry.CodecTraits(
    feedback=name in FEEDBACK, params=_DECODE_PARAMS.get(name, ()),
    blocks="block_size" if name in ("int8", "int4") else None) for name in CODECS})
registry.CODEC_DEFAULTS.declare({field.name: field.default for field in fields(CodecConfig)
                                 if field.name not in ("name", "zstd")})
registry.CODEC_CHECK.declare(_check)
