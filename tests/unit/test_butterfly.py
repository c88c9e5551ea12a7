"""The butterfly's arithmetic (swarm/butterfly.py parts, outer/averaging.py reduce and combine),
against the all-gather mean the same contributions give."""

from __future__ import annotations

import pytest
import torch

from diloco_node.codec import CodecConfig, make_codec
from diloco_node.outer.averaging import Averaging
from diloco_node.round import Gathered, Outcome, PartIn, Reduced, part_bounds
from diloco_node.swarm.butterfly import owners

PEERS = ("a", "b", "c", "d")


@pytest.mark.parametrize(("numel", "parts", "align"), [(10, 3, 1), (1000, 4, 64), (64, 3, 64), (5, 8, 1), (130, 2, 64)])
def test_parts_cover_the_vector_once_on_block_boundaries(numel: int, parts: int, align: int) -> None:
    bounds = part_bounds(numel, parts, align)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:], strict=False))
    assert all(start % align == 0 for start, _ in bounds)
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= align


def test_owners_are_the_members_that_accept_connections_in_peer_order() -> None:
    assert owners(["c", "a", "b"]) == ("a", "b", "c")
    assert owners(["c", "a", "b"], clients=["b"]) == ("a", "c")


def butterfly_mean(codec_name: str, deltas: dict[str, torch.Tensor], tokens: dict[str, float],
                   lie: dict[str, float] | None = None) -> torch.Tensor:
    """What member 'a' gets when every member owns a part, reduces it and hands it back."""
    numel = next(iter(deltas.values())).numel()
    codec = make_codec(CodecConfig(name=codec_name))
    members = {p: Averaging(codec, numel, p, part_align=64 if codec_name == "int4" else 1) for p in deltas}
    owns = {p: members[p].encode(0, deltas[p], tokens[p]) for p in deltas}
    sources = {p: members[p].parts(0, owns[p]) for p in deltas}
    order = owners(list(deltas))
    bounds = part_bounds(numel, len(order), members["a"].part_align or 1)
    parts = {}
    for index, owner in enumerate(order):
        start, end = bounds[index]
        pushed = [PartIn(p, sources[p].encode(start, end), tokens[p], (lie or {}).get(p, sources[p].norm))
                  for p in sorted(deltas)]
        parts[index] = members[owner].reduce_part(0, (start, end), pushed)
    gathered = Gathered(Outcome.TOGETHER, 0, reduced=Reduced(tuple(sorted(deltas)), len(order), parts, 0))
    return members["a"].mean(owns["a"], gathered).mean


def allgather_mean(codec_name: str, deltas: dict[str, torch.Tensor], tokens: dict[str, float]) -> torch.Tensor:
    numel = next(iter(deltas.values())).numel()
    codec = make_codec(CodecConfig(name=codec_name))
    averaging = Averaging(codec, numel, "a")
    payloads = {p: (codec.encode(deltas[p]), tokens[p]) for p in deltas if p != "a"}
    return averaging.mean(averaging.encode(0, deltas["a"], tokens["a"]), Gathered(Outcome.TOGETHER, 0, payloads)).mean


def honest(numel: int = 1000) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {p: torch.randn(numel, generator=generator) for p in PEERS}


def test_with_exact_values_the_butterfly_mean_is_the_allgather_mean_bit_for_bit() -> None:
    deltas, tokens = honest(), {"a": 1.0, "b": 2.0, "c": 3.0, "d": 1.0}
    assert torch.equal(butterfly_mean("none", deltas, tokens), allgather_mean("none", deltas, tokens))


def test_int4_parts_average_to_the_allgather_mean_within_one_more_quantization() -> None:
    deltas, tokens = honest(), dict.fromkeys(PEERS, 1.0)
    reference = allgather_mean("int4", deltas, tokens)
    error = (butterfly_mean("int4", deltas, tokens) - reference).norm() / reference.norm()
    assert 0 < error < 0.15  # the averaged part is quantized once more (int4's relative error ≈ 0.07)


def test_a_huge_contribution_is_clipped_per_part_as_its_whole_would_be() -> None:
    deltas, tokens = honest(), dict.fromkeys(PEERS, 1.0)
    deltas["d"] = deltas["d"] * 1e6
    assert torch.allclose(butterfly_mean("none", deltas, tokens), allgather_mean("none", deltas, tokens),
                          rtol=1e-5, atol=1e-6)


def test_a_part_longer_than_its_declared_norm_is_left_out() -> None:
    deltas, tokens = honest(), dict.fromkeys(PEERS, 1.0)
    deltas["d"] = deltas["d"] * 1e6
    # d declares a tiny norm to escape clipping: every owner drops its part, so the mean is a, b, c's
    lied = butterfly_mean("none", deltas, tokens, lie={"d": 1.0})
    without = allgather_mean("none", {p: deltas[p] for p in "abc"}, tokens)
    assert torch.allclose(lied, without, rtol=1e-5, atol=1e-6)


def test_a_part_nobody_delivered_is_zero_in_the_mean() -> None:
    numel = 300
    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, numel, "a", part_align=1)
    own = averaging.encode(0, torch.ones(numel), 1.0)
    part = codec.encode(torch.full((100,), 2.0))
    reduced = Reduced(("a", "b", "c"), 3, {0: (part, {"used": ["a"], "tokens": [1.0]}),
                                           2: (part, {"used": ["a"], "tokens": [1.0]})}, 0)
    result = averaging.mean(own, Gathered(Outcome.TOGETHER, 0, reduced=reduced))
    assert result.mean[:100].eq(2).all() and result.mean[100:200].eq(0).all() and result.mean[200:].eq(2).all()
    assert result.group == ("a",) and result.own_share == 1.0


def test_a_malformed_owner_report_takes_no_share() -> None:
    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, 4, "a", part_align=1)
    own = averaging.encode(0, torch.ones(4), 1.0)
    reduced = Reduced(("a", "b"), 2, {0: (codec.encode(torch.ones(2)), {"used": ["a"], "tokens": ["x", 3]})}, 0)
    assert averaging.mean(own, Gathered(Outcome.TOGETHER, 0, reduced=reduced)).own_share == 0.0


def test_an_owner_given_only_tokenless_parts_averages_nothing() -> None:
    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, 4, "a", part_align=1)
    part = codec.encode(torch.ones(2))
    averaged, report = averaging.reduce_part(0, (0, 2), [PartIn("b", part, 0.0, 2.0), PartIn("c", part, -1.0, 2.0)])
    assert averaged == b"" and report["rejected"] == ["b", "c"]
