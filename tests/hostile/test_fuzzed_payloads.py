"""10^5 damaged payloads through the path a gathered payload takes (decode, then the bounded mean):
none raises, none makes the mean non-finite or moves it beyond the clip bound, and memory stays
flat. The over-the-wire counterpart, a hostile peer averaging damaged payloads in real rounds, is
test_trust.py's `fuzz` case; this one is the volume."""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from diloco_node.codec import CODECS, CodecConfig, make_codec
from diloco_node.outer.aggregate import NORM_CLIP_MULTIPLE
from diloco_node.outer.averaging import Averaging
from diloco_node.round import Gathered, Outcome

pytestmark = pytest.mark.integration

NUMEL = 256
PAYLOADS = 100_000
CODEC_CONFIG = {name: CodecConfig(name=name, block_size=32, topk_chunk=64, topk_k=8) for name in CODECS}
CODEC_CONFIG["topk-2bit"] = CodecConfig(name="topk", topk_chunk=64, topk_k=12, topk_bits=2)
CODEC_CONFIG["sign"] = CodecConfig(name="sign", sign_block=32, sign_keep=0.5)


def damaged(valid: bytes, rng: np.random.Generator) -> bytes:
    data = bytearray(valid)
    kind = rng.integers(4)
    if kind == 0:  # bytes flipped
        for index in rng.integers(len(data), size=int(rng.integers(1, 8))):
            data[index] ^= int(rng.integers(1, 256))
    elif kind == 1:  # cut short
        data = data[:int(rng.integers(0, len(data)))]
    elif kind == 2:  # grown
        data += rng.bytes(int(rng.integers(1, 512)))
    else:  # noise of a plausible length
        data = bytearray(rng.bytes(len(data)))
    return bytes(data)


@pytest.fixture
def quiet() -> Iterator[None]:
    """Each rejection is logged; pytest would keep all 10^5 records in memory, which is not the node's."""
    logger = logging.getLogger("diloco_node")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.mark.usefixtures("quiet")
def test_a_hundred_thousand_damaged_payloads_change_nothing_they_should_not() -> None:
    rng = np.random.default_rng(0)
    own_delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    per_codec = PAYLOADS // len(CODEC_CONFIG)
    for name, config in CODEC_CONFIG.items():
        averaging = Averaging(make_codec(config), NUMEL, "us")
        own = averaging.encode(1, own_delta, 1000.0)
        assert own.decoded is not None
        valid = make_codec(config).encode(own_delta * 0.5)
        bound = (1 + NORM_CLIP_MULTIPLE) * float(own.decoded.norm())  # ours plus a peer clipped to ≤ that × ours
        for _ in range(per_codec):
            result = averaging.mean(own, Gathered(Outcome.TOGETHER, 1, {"peer": (damaged(valid, rng), 1000.0)}))
            assert bool(torch.isfinite(result.mean).all()), name
            assert float(result.mean.norm()) <= bound * 1.0001, name
            if "peer" not in result.group:
                assert result.rejected == ("peer",)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 64 * 1024, f"peak memory grew by {grown_kib} KiB over {PAYLOADS} payloads"
