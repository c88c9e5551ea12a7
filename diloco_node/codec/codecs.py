"""The codec seam: one `CodecSpec` per codec, a config, a Protocol, and make_codec, which builds payload.PayloadCodec.

Every codec is the same pipeline (docs/architecture.md §3): [error feedback] → quantize / sparsify → zstd →
versioned header, built by payload.py. What a codec *is* lives in its spec below, and nowhere else:
its name, its wire ids, its traits (error feedback or not, block size, bits per value), the
parameters it writes into the header and a receiver needs to decode with their defaults, whether
zstd pays on it, and the line docs/configuration.md describes it with. config/ reads the specs
through registry.py (its checks, the fingerprint, the butterfly's part alignment, --help), payload.py
reads them to build the pipeline; only the transform itself (torch) is payload.py's. This module
imports no torch: the CLI reads these defaults to build its options and to refuse bad input, and must
not pay torch's import for that (tests/unit/test_cli_imports.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from diloco_node import registry
from diloco_node.codec import wire
from diloco_node.codec.wire import CodecError

if TYPE_CHECKING:
    import torch

    from diloco_node.config import NodeConfig


@dataclass(frozen=True)
class CodecSpec:
    """One codec, whole. A new codec is one spec here and its kernel in payload.KERNELS (and a new
    parameter a field of CodecConfig and of config.NodeConfig, and a row in docs/configuration.md)."""

    name: str  # --compression's value
    wire_id: int  # the header's codec byte (wire.py): fixed for good, a payload names its codec by it
    dtype: int  # the header's dtype byte: what the body's values are (wire.DTYPE_*)
    # bits per value in the body; a str names the parameter that sets them, and the dtype follows
    # (wire.DTYPE_BITS; `dtype` stands when the parameter is out of range, which the length check refuses)
    bits: int | str
    summary: str  # what it sends, one line, {param} standing for a parameter's default: see `description`
    # the parameters a receiver needs to decode, with their defaults: fingerprinted (config.Codec.codec_fingerprint),
    # and a header naming other values is refused (wire.unpack)
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    header: tuple[str, ...] = ()  # the CodecConfig attributes the header carries as param_a, param_b (else 0)
    blocks: str | None = None  # the parameter holding its block size: butterfly parts are cut on its blocks
    feedback: bool = False  # sparse: drops values, so keeps an error-feedback residual (ef_decay)
    zstd: bool = True  # whether zstd pays on its body, what `--zstd auto` does

    @property
    def description(self) -> str:
        """What it sends at its defaults: its row of docs/configuration.md's compression table
        (tests/unit/test_readme.py)."""
        return self.summary.format(**self.params)

    @property
    def dense(self) -> bool:
        """Sends every value (the butterfly can average its parts and encode the mean again)."""
        return not self.feedback

    @property
    def knobs(self) -> tuple[str, ...]:
        """The config keys that tune it: its parameters, and the residual's decay when it keeps one."""
        return (*self.params, *(("ef_decay",) if self.feedback else ()))

    def wire_dtype(self, cfg: CodecConfig) -> int:
        """The header's dtype byte under `cfg`."""
        return wire.DTYPE_BITS.get(getattr(cfg, self.bits), self.dtype) if isinstance(self.bits, str) else self.dtype

    def header_params(self, cfg: CodecConfig) -> tuple[int, int]:
        """The header's param_a, param_b under `cfg`: the run's values, which a received header must repeat."""
        a, b = (*(getattr(cfg, key) for key in self.header), 0, 0)[:2]
        return a, b


def _params(**defaults: Any) -> Mapping[str, Any]:
    return MappingProxyType(defaults)


# Defaults measured on the same real Δ (tests/unit/test_codecs.py checks the bytes).
# block 64 vs 128: int8 rel. error 0.0038 vs 0.0039, int4 0.068 vs 0.071, for +0.016 B/param;
# 64 keeps int4 ≤ 0.49 B/param after zstd while holding more outliers to a small block.
_BLOCKWISE = _params(block_size=64)  # int8 / int4: values per bf16 scale
# zstd where it pays, measured on a real pseudo-gradient (tiny model, 20 AdamW steps, level 3), in the
# comment of each spec. zstd level 3 runs at ≥ 300 MB/s of fp32 input per core, faster than any link it
# saves bytes on, so it is on wherever it saves a few percent; int8 codes are near-uniform after absmax
# scaling and gain ≈ 1 %, not worth ~20 % of the encode time. pack() also sends a body raw when zstd
# would make it bigger, so `--zstd on` never costs bytes.
SPECS: Mapping[str, CodecSpec] = MappingProxyType({spec.name: spec for spec in (
    # zstd: 4.00 → 3.57 B/param (−11 %)
    CodecSpec("none", 0, wire.DTYPE_FP32, 32, "fp32"),
    # zstd: 2.00 → 1.79 (−11 %)
    CodecSpec("fp16", 1, wire.DTYPE_FP16, 16, "IEEE half floats, saturating at ±65504"),
    # zstd: 2.00 → 1.51 (−24 %)
    CodecSpec("bf16", 2, wire.DTYPE_BF16, 16, "bfloat16: 16-bit floats with fp32's range"),
    # zstd: 1.031 → 1.022 (−1 %): not worth its time
    CodecSpec("int8", 3, wire.DTYPE_INT8, 8, "blockwise absmax: int8 codes, one bf16 scale per {block_size} values",
              params=_BLOCKWISE, header=("block_size",), blocks="block_size", zstd=False),
    # zstd: 0.531 → 0.486 (−8.5 %)
    CodecSpec("int4", 4, wire.DTYPE_INT4, 4, "the same with 4-bit codes, two per byte",
              params=_BLOCKWISE, header=("block_size",), blocks="block_size"),
    # C = 256 keeps offsets at 1 byte, and captures the most energy per byte sent (1.33 vs 1.14–1.24
    # for C = 128, 512, 1024, 4096 at equal budget); k = 8 lands at 0.055 B/param on the wire
    # ((2 + 8·2) / 256 = 0.070 before zstd, which codes the offset gaps in ≈ 5 bits: −22 %).
    # topk_bits: bits per kept value, 8, 4, 2 or 1 (sparse.py).
    CodecSpec("topk", 5, wire.DTYPE_INT8, "topk_bits",
              "per chunk of {topk_chunk} the {topk_k} largest (int8, or `--topk-bits` 4/2/1), offsets as "
              "ascending gaps; with error feedback",
              params=_params(topk_chunk=256, topk_k=8, topk_bits=8), header=("topk_chunk", "topk_k"), feedback=True),
    # 256 values per scale keeps 85 % of the energy on a real Δ (64: 86 %) for 1/4 of the scale bytes;
    # 0.7 of the blocks (sign_keep: the share sent per round, the largest by norm; per mille in the
    # header) lands at (2 + 32)/256 · 0.7 = 0.093 B/param. zstd: no gain, sign bits are random.
    CodecSpec("sign", 6, wire.DTYPE_INT1, 1,
              "the largest blocks of {sign_block} values by norm, {sign_keep:g} of them per round: sign bits + "
              "the block's mean |x|, a bitmap naming them; with error feedback",
              params=_params(sign_block=256, sign_keep=0.7), header=("sign_block", "sign_per_mille"),
              feedback=True, zstd=False),
)})

CODECS: tuple[str, ...] = tuple(SPECS)
FEEDBACK: tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.feedback)


def _param_defaults() -> dict[str, Any]:
    """Every codec parameter's default; a parameter two codecs share (block_size) has one."""
    defaults: dict[str, Any] = {}
    for spec in SPECS.values():
        for key, value in spec.params.items():
            if defaults.setdefault(key, value) != value:
                raise RuntimeError(f"codec parameter {key} has two defaults: {defaults[key]} and {value}")
    return defaults


PARAM_DEFAULTS = _param_defaults()


@dataclass(frozen=True)
class CodecConfig:
    name: str = "none"
    block_size: int = PARAM_DEFAULTS["block_size"]
    topk_chunk: int = PARAM_DEFAULTS["topk_chunk"]
    topk_k: int = PARAM_DEFAULTS["topk_k"]
    topk_bits: int = PARAM_DEFAULTS["topk_bits"]
    sign_block: int = PARAM_DEFAULTS["sign_block"]
    sign_keep: float = PARAM_DEFAULTS["sign_keep"]
    # the pipeline's own stages, whatever the codec
    ef_decay: float = 1.0  # error feedback β: 1 = nothing unsent is ever forgotten
    zstd_level: int = 3
    zstd: bool | None = None  # None = the spec's `zstd`

    @property
    def spec(self) -> CodecSpec:
        return SPECS[self.name]

    @property
    def sign_per_mille(self) -> int:
        """sign_keep as the header carries it."""
        return round(1000 * self.sign_keep)


# every CodecConfig field a NodeConfig field of the same name sets, with its default
_DEFAULTS = {slot.name: slot.default for slot in fields(CodecConfig) if slot.name not in ("name", "zstd")}


class Codec(Protocol):
    name: str

    def encode(self, flat: torch.Tensor) -> bytes: ...
    def decode(self, payload: bytes, expected_numel: int) -> torch.Tensor: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, d: dict[str, Any]) -> None: ...


def make_codec(cfg: CodecConfig) -> Codec:
    if cfg.name not in SPECS:
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
    codec = cfg.codec
    return CodecConfig(name=codec.compression, zstd={"auto": None, "on": True, "off": False}[codec.zstd],
                       **{key: getattr(codec, key) for key in _DEFAULTS})


def _check(cfg: NodeConfig) -> None:
    make_codec(codec_config_of(cfg))  # its own range checks, phrased for the user


# What config/ checks --compression and the codec parameters against (registry.py).
registry.CODECS.declare(SPECS)
registry.CODEC_DEFAULTS.declare(_DEFAULTS)
registry.CODEC_CHECK.declare(_check)
