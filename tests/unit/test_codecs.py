"""Codec round-trip error bounds, bytes on the wire, error feedback, and header validation."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch
import zstandard

from diloco_node.codec import CODECS, FEEDBACK, SPECS, CodecConfig, CodecError, make_codec, max_payload_bytes, wire
from diloco_node.train.bytedata import ByteDataset
from diloco_node.train.inner import InnerConfig, InnerTrainer
from diloco_node.train.model import build_model
from diloco_node.train.sources import embedded_corpus


@pytest.fixture(scope="module")
def pseudo_gradient() -> torch.Tensor:
    """A real Δ = φ − θ: the tiny model after 20 AdamW steps on the embedded corpus (≈ 0.5 s)."""
    model = build_model("tiny", seed=0)
    phi = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    trainer = InnerTrainer(model, InnerConfig(warmup_steps=5))
    data = ByteDataset(embedded_corpus(200_000), seq_len=64)
    for step in range(20):
        trainer.train_step(*data.train_batch(4, stream_seed=0, position=step))
    return phi - torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def heavy_tailed(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen)
    return normal * torch.rand(n, generator=gen).pow(-0.5) * 1e-3  # Student-t-like tails


def roundtrip(name: str, x: torch.Tensor, **kw: object) -> torch.Tensor:
    codec = make_codec(CodecConfig(name=name, **kw))  # type: ignore[arg-type]
    return codec.decode(codec.encode(x), x.numel())


# --- round-trip error bounds -----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
def test_none_is_exact(n: int) -> None:
    x = heavy_tailed(n)
    assert torch.equal(roundtrip("none", x), x)


@pytest.mark.parametrize(("name", "eps"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_half_relative_error(name: str, eps: float) -> None:
    x = heavy_tailed(10_000)
    x = x[x.abs() > 1e-4]  # stay clear of fp16 subnormals, where the error is absolute
    assert ((roundtrip(name, x) - x).abs() <= eps * x.abs()).all()


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 1.0])
    assert roundtrip("fp16", x).tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize(("name", "levels"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize(("n", "block"), [(1000, 64), (1001, 128), (5, 64), (333, 1)])
def test_blockwise_error_is_at_most_half_a_step(name: str, levels: int, n: int, block: int) -> None:
    x = heavy_tailed(n)
    x[: min(n, block)] = 0.0  # an all-zero block must stay zero
    error = (roundtrip(name, x, block_size=block) - x).abs()
    pad = -n % block
    absmax = torch.nn.functional.pad(x, (0, pad)).view(-1, block).abs().amax(dim=1)
    scale = absmax / levels * (1 + 2**-7)  # the bf16 scale is rounded up, by at most one ulp
    bound = scale.repeat_interleave(block)[:n] / 2
    assert (error <= bound * (1 + 1e-6) + 1e-12).all()
    assert (error[: min(n, block)] == 0).all()


def test_topk_keeps_the_largest_per_chunk_quantized_and_zeroes_the_rest() -> None:
    chunk, k = 256, 8
    x = heavy_tailed(1000)
    y = make_codec(CodecConfig(name="topk", topk_chunk=chunk, topk_k=k, ef_decay=1.0))
    decoded = y.decode(y.encode(x), x.numel())
    for start in range(0, 1000, chunk):
        row, out = x[start:start + chunk], decoded[start:start + chunk]
        kept = row.abs().topk(min(k, row.numel())).indices
        dropped = torch.ones_like(row, dtype=torch.bool)
        dropped[kept] = False
        assert (out[dropped] == 0).all()
        scale = row.abs().max() / 127 * (1 + 2**-7)
        assert ((out[kept] - row[kept]).abs() <= scale / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("bits", [4, 2, 1])
def test_topk_low_bit_values_keep_the_same_entries_within_half_a_step(bits: int) -> None:
    chunk, k, half = 64, 12, ((1 << bits) - 1) / 2
    x = heavy_tailed(1000, seed=bits)
    decoded = roundtrip("topk", x, topk_chunk=chunk, topk_k=k, topk_bits=bits)
    eight = roundtrip("topk", x, topk_chunk=chunk, topk_k=k)
    assert torch.equal(decoded != 0, eight != 0)  # the same k entries per chunk as with int8 values
    for start in range(0, 1000, chunk):
        row, out = x[start:start + chunk], decoded[start:start + chunk]
        kept = out != 0
        scale = float(row.abs().max()) / half * (1 + 2**-7)
        assert ((out[kept] - row[kept]).abs() <= scale / 2 * (1 + 1e-6)).all()
        assert torch.equal(out[kept].sign(), row[kept].sign())  # no zero level: signs always survive
        # codes are (c − half)·scale for integer c: a handful of levels per chunk
        assert out[kept].unique().numel() <= 1 << bits


def test_sign_sends_the_largest_blocks_as_sign_times_their_mean_magnitude() -> None:
    block, n = 64, 1000  # 16 blocks, the last one partly padded; keep 0.5 → the 8 of largest norm
    x = heavy_tailed(n, seed=3)
    decoded = roundtrip("sign", x, sign_block=block, sign_keep=0.5)
    rows = torch.nn.functional.pad(x, (0, 16 * block - n)).view(16, block)
    out = torch.nn.functional.pad(decoded, (0, 16 * block - n)).view(16, block)
    chosen = set(rows.square().sum(dim=1).topk(8).indices.tolist())
    for i in range(16):
        if i not in chosen:
            assert (out[i] == 0).all()
            continue
        scale = float(rows[i].abs().mean())
        assert torch.allclose(out[i].abs(), torch.full((block,), scale), rtol=2**-8, atol=0)
        assert torch.equal(out[i] < 0, rows[i] < 0)


def test_topk_with_uint16_offsets() -> None:
    x = heavy_tailed(5000)
    decoded = roundtrip("topk", x, topk_chunk=1024, topk_k=16)
    assert int((decoded != 0).sum()) <= 5 * 16
    assert torch.equal(decoded != 0, decoded.abs() > 0)


# --- bytes per parameter on a real pseudo-gradient ----------------------------------------------

BYTES_PER_PARAM = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.05, "int4": 0.55, "topk": 0.1, "sign": 0.1}


@pytest.mark.parametrize("name", CODECS)
def test_bytes_per_parameter(name: str, pseudo_gradient: torch.Tensor) -> None:
    n = pseudo_gradient.numel()
    payload = make_codec(CodecConfig(name=name)).encode(pseudo_gradient)
    assert len(payload) / n <= BYTES_PER_PARAM[name]
    assert len(payload) <= max_payload_bytes(n)


@pytest.mark.parametrize(("k", "bits", "limit"), [(24, 2, 0.09), (32, 1, 0.1), (11, 8, 0.085)])
def test_topk_gap_coded_offsets_buy_more_entries_per_byte(pseudo_gradient: torch.Tensor, k: int, bits: int,
                                                          limit: float) -> None:
    """Sorted offsets as gaps shrink under zstd (≈ 5 of 8 bits): 24 2-bit values per 256 fit in
    0.1 B/param with room to spare, where raw offsets alone would take 0.094."""
    n = pseudo_gradient.numel()
    payload = make_codec(CodecConfig(name="topk", topk_k=k, topk_bits=bits)).encode(pseudo_gradient)
    chunks = -(-n // 256)
    raw = chunks * (2 + k) + -(-chunks * k * bits // 8)
    assert len(payload) / n <= limit and len(payload) < 0.9 * raw


def test_topk_default_sits_in_the_target_band(pseudo_gradient: torch.Tensor) -> None:
    payload = make_codec(CodecConfig(name="topk")).encode(pseudo_gradient)
    assert 0.03 <= len(payload) / pseudo_gradient.numel() <= 0.1


# --- the specs (codecs.py) ------------------------------------------------------------------------

# Wire format version 2 as shipped: a codec's ids and header parameters never change with its spec
# (a renumbered codec would read as another codec's payload to a peer of the same protocol).
WIRE_V2 = {"none": (0, 0, 0, 0), "fp16": (1, 1, 0, 0), "bf16": (2, 2, 0, 0), "int8": (3, 3, 32, 0),
           "int4": (4, 4, 32, 0), "topk": (5, 5, 64, 4), "sign": (6, 6, 64, 500)}


def test_every_codec_keeps_its_wire_ids_and_header_parameters() -> None:
    assert tuple(WIRE_V2) == CODECS
    for name, fields in WIRE_V2.items():
        cfg = CodecConfig(name=name, block_size=32, topk_chunk=64, topk_k=4, topk_bits=2, sign_block=64, sign_keep=0.5)
        header = wire.read_header(make_codec(cfg).encode(heavy_tailed(1000)))
        assert (header.codec, header.dtype, header.param_a, header.param_b) == fields, name


def test_each_specs_parameters_and_defaults_are_the_configs() -> None:
    from diloco_node.config import FIELDS

    for spec in SPECS.values():
        assert spec.feedback == (spec.name in FEEDBACK) != spec.dense
        for key in spec.knobs:
            field = FIELDS[key]
            assert key not in spec.params or field.get_default(call_default_factory=True) == spec.params[key], key
        assert spec.blocks is None or spec.blocks in spec.params


# --- error feedback ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FEEDBACK)
def test_error_feedback_conserves_the_sum_of_inputs(pseudo_gradient: torch.Tensor, name: str) -> None:
    codec = make_codec(CodecConfig(name=name))
    n = pseudo_gradient.numel()
    inputs, sent = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for step in range(6):
        delta = pseudo_gradient * (0.5 + step / 4)
        inputs += delta.double()
        sent += codec.decode(codec.encode(delta), n).double()
    residual = codec.state_dict()["residual"].double()
    assert torch.allclose(sent + residual, inputs, rtol=0, atol=1e-6 * float(inputs.abs().max()))
    # and error feedback does its job: over rounds, more of the total gets through than one round's k
    assert float((inputs - sent).norm() / inputs.norm()) < 0.95


def test_error_feedback_state_dict_round_trip() -> None:
    x = heavy_tailed(3000)
    a = make_codec(CodecConfig(name="topk"))
    a.encode(x)
    state = a.state_dict()
    assert set(state) == {"residual"} and state["residual"].dtype == torch.float32
    b = make_codec(CodecConfig(name="topk"))
    b.load_state_dict(state)
    assert a.encode(x) == b.encode(x)  # same residual → same payload
    assert torch.equal(a.state_dict()["residual"], b.state_dict()["residual"])


def test_stateless_codecs_have_empty_state() -> None:
    for name in set(CODECS) - set(FEEDBACK):
        assert make_codec(CodecConfig(name=name)).state_dict() == {}


def test_non_finite_input_is_refused_and_leaves_the_residual_alone() -> None:
    codec = make_codec(CodecConfig(name="topk"))
    codec.encode(heavy_tailed(100))
    before = codec.state_dict()["residual"].clone()
    with pytest.raises(CodecError):
        codec.encode(torch.full((100,), float("nan")))
    assert torch.equal(codec.state_dict()["residual"], before)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [CodecConfig(name="zip"), CodecConfig(name="int8", block_size=0), CodecConfig(name="topk", topk_k=300),
     CodecConfig(name="topk", topk_chunk=1 << 17, topk_k=4), CodecConfig(name="topk", ef_decay=1.5),
     CodecConfig(name="topk", topk_bits=3), CodecConfig(name="topk", topk_bits=0),
     CodecConfig(name="sign", sign_block=12), CodecConfig(name="sign", sign_keep=0.0001),
     CodecConfig(name="sign", sign_keep=1.5)],
)
def test_bad_config_fails_at_construction(cfg: CodecConfig) -> None:
    with pytest.raises(ValueError):
        make_codec(cfg)


# --- header validation: every field ------------------------------------------------------------

FIELDS = ("magic", "version", "codec", "dtype", "flags", "numel", "param_a", "param_b", "body_len", "raw_len", "crc")


def forge(payload: bytes, body: bytes | None = None, reseal: bool = False, **changes: Any) -> bytes:
    """Re-pack `payload` with some header fields (and optionally the body) replaced.

    reseal=True gives the forgery a valid checksum, to reach the checks behind it.
    """
    fields = dict(zip(FIELDS, wire.HEADER.unpack_from(payload), strict=True))
    body = payload[wire.HEADER.size:] if body is None else body
    fields.update(changes)
    if reseal:
        return wire.seal(tuple(fields.values())[:-1], body)
    return wire.HEADER.pack(*fields.values()) + body


@pytest.fixture()
def int8_payload() -> bytes:
    return make_codec(CodecConfig(name="int8", block_size=64)).encode(heavy_tailed(1000))


@pytest.mark.parametrize(
    "changes",
    [{"magic": b"XXXX"}, {"version": 1}, {"version": 3}, {"codec": 4}, {"codec": 99}, {"dtype": 0},
     {"flags": 2}, {"flags": 1}, {"numel": 999}, {"numel": 2**63}, {"param_a": 0}, {"param_a": 128},
     {"param_a": 2**32 - 1}, {"param_b": 1}, {"raw_len": 1}, {"raw_len": 2**64 - 1}, {"body_len": 10},
     {"body_len": 2**64 - 1}, {"crc": 0}],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_every_header_field_is_validated(int8_payload: bytes, changes: dict[str, Any]) -> None:
    codec = make_codec(CodecConfig(name="int8", block_size=64))
    with pytest.raises(CodecError):
        codec.decode(forge(int8_payload, **changes), 1000)


def test_truncated_and_extended_payloads(int8_payload: bytes) -> None:
    codec = make_codec(CodecConfig(name="int8", block_size=64))
    for bad in (b"", int8_payload[:10], int8_payload[:-1], int8_payload + b"\0"):
        with pytest.raises(CodecError):
            codec.decode(bad, 1000)


def test_payload_of_another_codec_or_model_is_refused() -> None:
    x = heavy_tailed(1000)
    payload = make_codec(CodecConfig(name="int4")).encode(x)
    with pytest.raises(CodecError):
        make_codec(CodecConfig(name="int8")).decode(payload, 1000)
    with pytest.raises(CodecError):
        make_codec(CodecConfig(name="int4")).decode(payload, 1001)


def test_codec_parameters_other_than_the_runs_are_refused() -> None:
    # the run's config fixes them (they are fingerprinted): a sender's header may not choose them
    x = heavy_tailed(1000)
    payload = make_codec(CodecConfig(name="int8", block_size=128)).encode(x)
    with pytest.raises(CodecError, match="codec parameters 128/0, the run's are 64/0"):
        make_codec(CodecConfig(name="int8", block_size=64)).decode(payload, 1000)
    huge = make_codec(CodecConfig(name="topk", topk_chunk=256, topk_k=8)).encode(x)
    fields = wire.HEADER.unpack_from(huge)[:-1]
    forged = wire.seal((*fields[:6], 1 << 24, fields[7], *fields[8:]), huge[wire.HEADER.size:])
    with pytest.raises(CodecError, match="codec parameters"):
        make_codec(CodecConfig(name="topk", topk_chunk=256, topk_k=8)).decode(forged, 1000)


def _zstd_payload(raw: bytes, declared_raw: int, frame: bytes | None = None) -> bytes:
    body = frame if frame is not None else zstandard.ZstdCompressor().compress(raw)
    return wire.seal((wire.MAGIC, wire.VERSION, 0, wire.DTYPE_FP32, wire.FLAG_ZSTD, declared_raw // 4, 0, 0,
                      len(body), declared_raw), body)


def test_zstd_bomb_is_refused_before_it_expands() -> None:
    codec = make_codec(CodecConfig(name="none"))
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB in a few KiB
    with pytest.raises(CodecError, match="declares"):
        codec.decode(_zstd_payload(b"", 4000, frame=bomb), 1000)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 4000)
    with pytest.raises(CodecError):
        codec.decode(_zstd_payload(b"", 4000, frame=unsized), 1000)
    two_frames = zstandard.ZstdCompressor().compress(b"\0" * 4000) * 2
    with pytest.raises(CodecError):
        codec.decode(_zstd_payload(b"", 4000, frame=two_frames), 1000)


def test_zstd_body_larger_than_raw_is_refused() -> None:
    raw = struct.pack("<1000f", *range(1000))
    payload = _zstd_payload(raw, 4000, frame=b"\x28\xb5\x2f\xfd" + b"\0" * 4000)
    with pytest.raises(CodecError, match="body length"):
        make_codec(CodecConfig(name="none")).decode(payload, 1000)


@pytest.mark.parametrize("name", CODECS)
def test_non_finite_payloads_are_refused(name: str) -> None:
    codec = make_codec(CodecConfig(name=name, zstd=False))
    x = heavy_tailed(512)
    payload = codec.encode(x)
    body = bytearray(payload[wire.HEADER.size:])
    if name in ("none",):
        body[0:4] = struct.pack("<f", float("nan"))
    elif name in ("fp16",):
        body[0:2] = b"\x00\x7c"  # +inf in fp16
    else:  # bf16 value, or the first bf16 scale of int8 / int4 / top-k
        body[0:2] = b"\x80\x7f"  # +inf in bf16
    forged = forge(payload, body=bytes(body), reseal=True)
    with pytest.raises(CodecError, match="non-finite"):
        codec.decode(forged, 512)


def test_out_of_range_codes_are_refused() -> None:
    x = heavy_tailed(256)
    for name, patch in (("int8", b"\x80"), ("int4", b"\x00")):
        payload = make_codec(CodecConfig(name=name, zstd=False)).encode(x)
        body = bytearray(payload[wire.HEADER.size:])
        body[8] = patch[0]  # first code byte after 4 bf16 scales (block 64, 256 values)
        with pytest.raises(CodecError, match="outside"):
            make_codec(CodecConfig(name=name)).decode(forge(payload, body=bytes(body), reseal=True), 256)
    topk = CodecConfig(name="topk", topk_chunk=200, topk_k=4, zstd=False)
    payload = make_codec(topk).encode(x)
    body = bytearray(payload[wire.HEADER.size:])
    body[4] = 250  # an offset past the chunk of 200 (2 chunks → 4 bytes of scales first)
    with pytest.raises(CodecError, match="offset"):
        make_codec(topk).decode(forge(payload, body=bytes(body), reseal=True), 256)


@pytest.mark.parametrize("bits", [8, 2])
def test_topk_gaps_that_sum_past_the_chunk_are_refused(bits: int) -> None:
    """Each gap is in range, but together they walk off the chunk's end."""
    x = heavy_tailed(256)
    cfg = CodecConfig(name="topk", topk_chunk=200, topk_k=4, topk_bits=bits, zstd=False)
    payload = make_codec(cfg).encode(x)
    body = bytearray(payload[wire.HEADER.size:])
    body[4:8] = bytes([60, 60, 60, 60])  # offsets 60, 121, 182, 243 in the first chunk
    with pytest.raises(CodecError, match="offset"):
        make_codec(cfg).decode(forge(payload, body=bytes(body), reseal=True), 256)
    body[4:8] = bytes([60, 60, 60, 16])  # offsets 60, 121, 182, 199: the last one in the chunk
    assert make_codec(cfg).decode(forge(payload, body=bytes(body), reseal=True), 256)[199] != 0


def test_sign_bitmap_that_disagrees_with_its_header_is_refused() -> None:
    x = heavy_tailed(1000)
    cfg = CodecConfig(name="sign", sign_block=64, sign_keep=0.5)  # 16 blocks, 8 sent: 16 B of scales, 2 of bitmap
    payload = make_codec(cfg).encode(x)
    assert len(payload) == wire.HEADER.size + 8 * (2 + 8) + 2
    for bitmap in (b"\xff\xff", b"\x00\x00", b"\x0f\x00"):  # 16, 0 and 4 blocks named
        body = bytearray(payload[wire.HEADER.size:])
        body[16:18] = bitmap
        with pytest.raises(CodecError, match="bitmap"):
            make_codec(cfg).decode(forge(payload, body=bytes(body), reseal=True), 1000)
    body = bytearray(payload[wire.HEADER.size:])
    body[16:18] = b"\xff\x00"  # 8 blocks, other ones than the encoder chose: a valid vector all the same
    assert int((make_codec(cfg).decode(forge(payload, body=bytes(body), reseal=True), 1000)[:512] != 0).sum()) == 512
    with pytest.raises(CodecError, match="codec parameters"):  # another share of blocks than the run's
        make_codec(cfg).decode(forge(payload, param_b=400, reseal=True), 1000)


def test_topk_value_bits_must_match() -> None:
    x = heavy_tailed(256)
    payload = make_codec(CodecConfig(name="topk", topk_bits=2)).encode(x)
    for bits in (8, 4, 1):
        with pytest.raises(CodecError, match="dtype"):
            make_codec(CodecConfig(name="topk", topk_bits=bits)).decode(payload, 256)
