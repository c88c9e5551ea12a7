"""Property tests: nothing a peer sends makes decode raise anything but CodecError, and a damaged
payload either fails with CodecError or decodes to exactly what the intact one decodes to."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_node.codec import CODECS, CodecConfig, CodecError, make_codec, wire

NUMEL = 300
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Small parameters so that valid-looking headers are reachable, and both offset widths get exercised.
CONFIGS = {name: CodecConfig(name=name, block_size=32, topk_chunk=64, topk_k=4) for name in CODECS}
CONFIGS["topk16"] = CodecConfig(name="topk", topk_chunk=300, topk_k=8)
CONFIGS["topk2bit"] = CodecConfig(name="topk", topk_chunk=64, topk_k=12, topk_bits=2)
CONFIGS["topk1bit"] = CodecConfig(name="topk", topk_chunk=300, topk_k=5, topk_bits=1)
CONFIGS["sign64"] = CodecConfig(name="sign", sign_block=64, sign_keep=0.5)

VECTOR = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 1, NUMEL)
VALID = {key: make_codec(cfg).encode(VECTOR) for key, cfg in CONFIGS.items()}
INTACT = {key: make_codec(CONFIGS[key]).decode(payload, NUMEL) for key, payload in VALID.items()}


def decode_or_codec_error(key: str, payload: bytes) -> torch.Tensor | None:
    try:
        out = make_codec(CONFIGS[key]).decode(payload, NUMEL)
    except CodecError:
        return None
    assert out.shape == (NUMEL,) and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    return out


@FUZZ
@given(key=st.sampled_from(sorted(CONFIGS)), data=st.binary(max_size=2048))
def test_arbitrary_bytes_only_ever_raise_codec_error(key: str, data: bytes) -> None:
    decode_or_codec_error(key, data)


@st.composite
def header_then_junk(draw: st.DrawFn) -> tuple[str, bytes]:
    """A plausible header (right magic and version, fuzzed fields) followed by arbitrary bytes."""
    key = draw(st.sampled_from(sorted(CONFIGS)))
    small = st.integers(0, 2**8 - 1)
    u32 = st.integers(0, 2**32 - 1)
    numel = draw(st.sampled_from([NUMEL, 0, 2**64 - 1]))
    fields = (wire.MAGIC, wire.VERSION, draw(small), draw(small), draw(small), numel, draw(u32), draw(u32),
              draw(st.integers(0, 4096)), draw(st.integers(0, 4096)), draw(u32))
    return key, wire.HEADER.pack(*fields) + draw(st.binary(max_size=2048))


@FUZZ
@given(data=st.one_of(st.binary(max_size=2048), header_then_junk().map(lambda case: case[1])))
def test_splitting_arbitrary_bytes_only_ever_raises_codec_error(data: bytes) -> None:
    """NoLoCo's two-part payload (Δ, then φ) is split before either part is decoded. Plausible
    headers get past the magic check, so the split's own length checks are fuzzed too."""
    try:
        first, rest = wire.split_first(data)
    except CodecError:
        return
    assert first + rest == data and rest


@FUZZ
@given(case=header_then_junk())
def test_plausible_headers_with_junk_only_ever_raise_codec_error(case: tuple[str, bytes]) -> None:
    decode_or_codec_error(*case)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    key = draw(st.sampled_from(sorted(CONFIGS)))
    payload = bytearray(VALID[key])
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            payload[draw(st.integers(0, len(payload) - 1))] ^= draw(st.integers(1, 255))
    elif kind == "truncate":
        del payload[draw(st.integers(0, len(payload) - 1)):]
    elif kind == "extend":
        payload += draw(st.binary(min_size=1, max_size=64))
    else:  # another codec's body under this header, or this body under another's header
        other = VALID[draw(st.sampled_from(sorted(CONFIGS)))]
        payload = payload[: wire.HEADER.size] + other[wire.HEADER.size:]
    return key, bytes(payload)


@FUZZ
@given(case=mutated())
def test_mutated_payloads_fail_cleanly_or_decode_correctly(case: tuple[str, bytes]) -> None:
    key, payload = case
    out = decode_or_codec_error(key, payload)
    assert out is None or torch.equal(out, INTACT[key])


@FUZZ
@given(key=st.sampled_from(sorted(CONFIGS)), data=st.data())
def test_forged_bodies_with_valid_headers_decode_finite_or_raise(key: str, data: st.DataObject) -> None:
    """A peer that speaks the format but sends arbitrary codes, scales and offsets (checksum right)."""
    fields = list(wire.HEADER.unpack_from(VALID[key]))
    raw_length = fields[9]
    body = data.draw(st.binary(min_size=raw_length, max_size=raw_length))
    fields[4], fields[8] = 0, raw_length  # no zstd, body as raw
    decode_or_codec_error(key, wire.seal(tuple(fields[:-1]), body))
