"""The butterfly's arithmetic (swarm/butterfly.py parts, outer/averaging.py reduce and combine),
against the all-gather mean the same contributions give."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from diloco_node.codec import CodecConfig, make_codec
from diloco_node.outer.averaging import Averaging
from diloco_node.round import Gathered, Outcome, Own, PartIn, Reduced, part_bounds
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


Declare = dict[str, dict[int, tuple[float, tuple[float, ...]]]]  # member → owner index → (norm, part norms)


def reduce_all(codec_name: str, deltas: dict[str, torch.Tensor], tokens: dict[str, float],
               lie: dict[str, float] | None = None, declare: Declare | None = None
               ) -> tuple[dict[str, Averaging], dict[str, Own], dict[int, tuple[bytes, dict[str, Any]]]]:
    """Every member owns a part and reduces it: the members, their own contributions and the averaged
    parts. `lie`: a member declares this for each part norm; `declare`: other part norms per owner."""
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
        pushed = []
        for p in sorted(deltas):
            norm, norms = (declare or {}).get(p, {}).get(index) or (
                sources[p].norm, tuple((lie or {}).get(p, n) for n in sources[p].norms(bounds)))
            pushed.append(PartIn(p, sources[p].encode(start, end), tokens[p], norm, norms))
        parts[index] = members[owner].reduce_part(0, index, bounds, pushed)
    return members, owns, parts


def mean_from(members: dict[str, Averaging], owns: dict[str, Own], parts: dict[int, tuple[bytes, dict[str, Any]]],
              member: str = "a") -> torch.Tensor:
    group = tuple(sorted(members))
    gathered = Gathered(Outcome.TOGETHER, 0, reduced=Reduced(group, len(group), parts, group.index(member)))
    return members[member].mean(owns[member], gathered).mean


def butterfly_mean(codec_name: str, deltas: dict[str, torch.Tensor], tokens: dict[str, float],
                   lie: dict[str, float] | None = None) -> torch.Tensor:
    """What member 'a' gets when every member owns a part, reduces it and hands it back."""
    return mean_from(*reduce_all(codec_name, deltas, tokens, lie))


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


def test_every_member_reports_the_work_the_bounds_removed_as_the_allgather_mean_does() -> None:
    # a fast member (4x the tokens, a longer Δ): the cap and the clip take the same share in both
    deltas, tokens = honest(), {"a": 1.0, "b": 1.0, "c": 1.0, "d": 4.0}
    deltas["d"] = deltas["d"] * 3
    members, owns, parts = reduce_all("none", deltas, tokens)
    group = tuple(sorted(members))
    removed = {member: members[member].mean(owns[member], Gathered(
        Outcome.TOGETHER, 0, reduced=Reduced(group, len(group), parts, group.index(member)))).weight_removed
        for member in group}
    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, 1000, "a")
    payloads = {p: (codec.encode(deltas[p]), tokens[p]) for p in deltas if p != "a"}
    allgather = averaging.mean(averaging.encode(0, deltas["a"], tokens["a"]), Gathered(Outcome.TOGETHER, 0, payloads))
    assert len(set(removed.values())) == 1 and 0.5 < allgather.weight_removed < 1
    assert removed["a"] == pytest.approx(allgather.weight_removed, rel=1e-5)


def test_a_part_longer_than_its_declared_norm_is_left_out() -> None:
    deltas, tokens = honest(), dict.fromkeys(PEERS, 1.0)
    deltas["d"] = deltas["d"] * 1e6
    # d declares tiny part norms to escape clipping: every owner drops its part, so the mean is a, b, c's
    lied = butterfly_mean("none", deltas, tokens, lie={"d": 1.0})
    without = allgather_mean("none", {p: deltas[p] for p in "abc"}, tokens)
    assert torch.allclose(lied, without, rtol=1e-5, atol=1e-6)


def test_a_part_nobody_delivered_is_zero_in_the_mean() -> None:
    deltas, tokens = honest(300), dict.fromkeys(PEERS, 1.0)
    members, owns, parts = reduce_all("none", deltas, tokens)
    whole = mean_from(members, owns, parts)
    del parts[1]
    mean = mean_from(members, owns, parts)
    assert mean[75:150].eq(0).all() and torch.equal(mean[:75], whole[:75]) and torch.equal(mean[150:], whole[150:])


def test_an_owner_returning_a_huge_part_is_skipped_by_every_member_alike() -> None:
    deltas, tokens = honest(), dict.fromkeys(PEERS, 1.0)
    members, owns, parts = reduce_all("none", deltas, tokens)
    whole = mean_from(members, owns, parts)
    codec = make_codec(CodecConfig(name="none"))
    averaged, report = parts[2]
    parts[2] = codec.encode(codec.decode(averaged, 250) * 1e16), report  # the owner of part 2 attacks
    means = [mean_from(members, owns, parts, member) for member in PEERS]
    assert all(torch.equal(mean, means[0]) for mean in means)  # every member skips it alike
    assert means[0][500:750].eq(0).all() and torch.equal(means[0][:500], whole[:500])
    # a part just within what the declared contributions allow is kept (the bound is not looser than that)
    parts[2] = codec.encode(codec.decode(averaged, 250) * 1.1), report
    assert mean_from(members, owns, parts)[500:750].ne(0).any()


def test_a_whole_norm_declared_for_every_part_is_refused_by_its_owners() -> None:
    """The √M pull: a member that declares its whole norm as each part's norm could bring each part
    at the length of its whole Δ. Its part norms must add up to its whole norm, so no owner takes it."""
    deltas, tokens = honest(), dict.fromkeys(PEERS, 1.0)
    deltas["d"] = deltas["d"] * 1e6
    members, owns, parts = reduce_all("none", deltas, tokens, lie={"d": float(deltas["d"].norm())})
    assert all("d" in report["rejected"] and "d" not in report["used"] for _, report in parts.values())


def test_a_member_that_declares_differently_to_different_owners_loses_the_parts_that_disagree() -> None:
    deltas, tokens = honest(), dict.fromkeys(PEERS, 1.0)
    _, _, honest_parts = reduce_all("none", deltas, tokens)
    norm, _, norms = honest_parts[0][1]["declared"]["d"]
    # to owner 3 alone, d declares a Δ twice as long (consistent in itself, so owner 3 takes it)
    twice = (2 * norm, tuple(2 * n for n in norms))
    members, owns, parts = reduce_all("none", deltas, tokens, declare={"d": {3: twice}})
    assert "d" in parts[3][1]["used"]
    means = [mean_from(members, owns, parts, member) for member in PEERS]
    assert all(torch.equal(mean, means[0]) for mean in means)  # every member skips part 3 alike
    assert means[0][750:].eq(0).all() and means[0][:750].ne(0).any()
    # an owner that misreports d's declaration: its part disagrees with the others' and is skipped alike
    members, owns, parts = reduce_all("none", deltas, tokens)
    averaged, report = parts[1]
    parts[1] = averaged, {**report, "declared": {**report["declared"], "d": [2 * norm, 1.0, [2 * n for n in norms]]}}
    means = [mean_from(members, owns, parts, member) for member in PEERS]
    assert all(torch.equal(mean, means[0]) for mean in means) and means[0][250:500].eq(0).all()


def test_part_norms_that_do_not_add_up_are_refused_by_the_owner() -> None:
    deltas, tokens = honest(), dict.fromkeys(PEERS, 1.0)
    _, _, honest_parts = reduce_all("none", deltas, tokens)
    norm, _, norms = honest_parts[0][1]["declared"]["d"]
    _, _, parts = reduce_all("none", deltas, tokens, declare={"d": {3: (norm, tuple(2 * n for n in norms))}})
    assert "d" in parts[3][1]["rejected"] and "d" not in parts[3][1]["used"]


@pytest.mark.parametrize("report", [
    {"used": 5}, {"used": ["a"], "tokens": [1.0]}, {"used": ["z"], "tokens": [1.0], "declared": {"z": [1, 1, [1]]}},
    {"used": ["a", "a"], "tokens": [1, 1], "declared": {"a": [1, 1, [1, 0, 0, 0]]}},
    {"used": ["a"], "tokens": [math.inf], "declared": {"a": [1, math.inf, [1, 0, 0, 0]]}},
    {"used": ["a"], "tokens": [5.0], "declared": {"a": [1, 1.0, [1, 0, 0, 0]]}},  # more than it declared
    {"used": ["a"], "tokens": [1.0], "declared": {"a": [1, 1.0, "xyz"]}}, {"used": [], "tokens": []}])
def test_a_malformed_or_impossible_owner_report_skips_its_part(report: dict[str, Any]) -> None:
    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, 8, "a", part_align=1)
    own = averaging.encode(0, torch.ones(8), 1.0)
    reduced = Reduced(PEERS, 4, {0: (codec.encode(torch.full((2,), 0.1)), report)}, None)
    result = averaging.mean(own, Gathered(Outcome.TOGETHER, 0, reduced=reduced))
    assert result.mean.eq(0).all() and result.group == ()


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
    declared = (2.0, 0.0)
    averaged, report = averaging.reduce_part(0, 0, ((0, 2), (2, 4)), [PartIn("b", part, 0.0, 2.0, declared),
                                                                      PartIn("c", part, -1.0, 2.0, declared)])
    assert averaged == b"" and report["rejected"] == ["b", "c"]


def test_infinite_tokens_from_two_members_are_refused_not_raised() -> None:
    """#28: `tokens: Infinity` from two members made the owner's mean non-finite (CodecError out of gather)."""
    codec = make_codec(CodecConfig(name="none"))
    averaging = Averaging(codec, 4, "a", part_align=1)
    part = codec.encode(torch.ones(2))
    declared = (math.sqrt(2), 0.0)
    parts = [PartIn("a", part, 1.0, math.sqrt(2), declared), PartIn("b", part, math.inf, math.sqrt(2), declared),
             PartIn("c", part, math.inf, math.sqrt(2), declared)]
    averaged, report = averaging.reduce_part(0, 0, ((0, 2), (2, 4)), parts)
    assert report["used"] == ["a"] and report["rejected"] == ["b", "c"]
    assert codec.decode(averaged, 2).tolist() == [1.0, 1.0]


# --- what hostile pushers can make an owner hold ---------------------------------------------------


class _Writer:
    """A push stream's writing end: what the owner answers is dropped."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def _push_stream(round_: int, group: list[str], payload: bytes, acknowledge: bool = True) -> Any:
    import asyncio
    import json

    from diloco_node.swarm.butterfly import RECEIVED
    from diloco_node.swarm.streams import HEADER_LEN

    request = json.dumps({"round": round_, "part": 0, "group": group, "admission": "", "tokens": 1.0,
                          "norm": 1.0, "norms": [1.0]}).encode()
    reader = asyncio.StreamReader()
    for message in (request, payload):
        reader.feed_data(len(message).to_bytes(HEADER_LEN, "big") + message)
    if acknowledge:
        reader.feed_data(RECEIVED)
    reader.feed_eof()
    return reader


def _butterfly(wait: float) -> Any:
    import asyncio
    from types import SimpleNamespace

    from diloco_node.swarm.butterfly import Butterfly

    streams = SimpleNamespace(p2p=None, loop=asyncio.get_running_loop(), count=lambda **_: None)
    return Butterfly(streams, "bounds", 1 << 20, lambda *_: None, "", wait, None)  # type: ignore[arg-type]


def _pusher(index: int) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(peer_id=f"fake-{index:05d}")


def test_pushes_are_released_once_their_round_is_reduced(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 fake ids push 64 KiB each to a round we have not reduced yet: held while their streams
    wait; the round closed (reduced, or we will not reduce), every one goes at once, and a later
    push to it is answered without being held (before: all kept for about six rounds)."""
    import asyncio

    async def main() -> None:
        butterfly = _butterfly(wait=30.0)
        butterfly._current = 5
        pushes = [asyncio.ensure_future(butterfly._serve(_pusher(i), _push_stream(5, [f"fake-{i:05d}"], b"x" * 65536),
                                                         _Writer())) for i in range(64)]
        for _ in range(500):  # 50 ms was the bound: too short on a loaded machine (the round not yet made)
            if 5 in butterfly._rounds and len(butterfly._rounds[5].received) == 64:
                break
            await asyncio.sleep(0.01)
        rnd = butterfly._rounds[5]
        assert len(rnd.received) == 64  # one per open push stream, as the stream limits allow
        await butterfly.close(5)
        assert rnd.received == {}
        await asyncio.wait_for(asyncio.gather(*pushes), 5)
        await butterfly._serve(_pusher(99), _push_stream(5, ["fake-00099"], b"x" * 65536), _Writer())
        assert rnd.received == {}

    asyncio.run(main())


def test_fresh_ids_pushing_before_the_group_is_known_hold_nothing_once_their_streams_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 fake ids push one after another to rounds near ours and give up: nothing stays held
    (what they can make us hold is one push per open stream), nor for a past round we never
    exchanged."""
    import asyncio

    from diloco_node.swarm import butterfly as butterfly_module

    monkeypatch.setattr(butterfly_module, "ANSWER_SLACK", 0.0)

    async def main() -> None:
        butterfly = _butterfly(wait=0.001)
        butterfly._current = 10
        for i in range(1000):
            round_ = 8 + i % 5  # two past rounds, ours and the next two
            await butterfly._serve(_pusher(i), _push_stream(round_, [f"fake-{i:05d}"], b"x" * 4096), _Writer())
            assert sum(len(rnd.received) for rnd in butterfly._rounds.values()) == 0
        assert len(butterfly._rounds) <= butterfly_module.KEPT_ROUNDS + 2

    asyncio.run(main())


def test_once_the_group_is_known_only_its_members_pushes_are_held() -> None:
    import asyncio

    async def main() -> None:
        butterfly = _butterfly(wait=30.0)
        butterfly._current = 3
        rnd = butterfly._round(3)
        rnd.group, rnd.owning, rnd.owned = ("a", "b"), ("a", "b"), 0
        outsider = asyncio.ensure_future(butterfly._serve(_pusher(1), _push_stream(3, ["fake-00001"], b"x"), _Writer()))
        await asyncio.wait_for(outsider, 5)  # answered at once, empty, and not held
        member = asyncio.ensure_future(butterfly._serve(SimpleNamespace(peer_id="b"), _push_stream(3, ["a", "b"], b"y"),
                                                        _Writer()))
        await asyncio.sleep(0.05)
        assert list(rnd.received) == ["b"]
        await butterfly.close(3)
        await asyncio.wait_for(member, 5)
        assert rnd.received == {}

    from types import SimpleNamespace

    asyncio.run(main())


def test_one_peer_gets_an_averaged_part_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """An averaged part we hold goes to one peer at most MAX_SENDS_PER_PEER times a round (a fetch and
    its retries), as a payload does; another peer still gets it. Before, a member or a joiner's
    voucher could pull it as often as the stream limits allowed."""
    import asyncio
    import json

    from diloco_node.swarm.butterfly import RECEIVED
    from diloco_node.swarm.exchange import MAX_SENDS_PER_PEER
    from diloco_node.swarm.streams import HEADER_LEN

    class Writer(_Writer):
        def __init__(self) -> None:
            self.data = b""

        def write(self, data: bytes) -> None:
            self.data += data

    def request() -> Any:
        reader = asyncio.StreamReader()
        for message in (json.dumps({"round": 5, "part": 0, "admission": ""}).encode(), b""):
            reader.feed_data(len(message).to_bytes(HEADER_LEN, "big") + message)
        reader.feed_data(RECEIVED)
        reader.feed_eof()
        return reader

    part = b"p" * 1000

    async def main() -> None:
        butterfly = _butterfly(wait=30.0)
        monkeypatch.setattr(butterfly, "_may", lambda *_: None)
        monkeypatch.setattr(butterfly, "_served", lambda rnd, index: (part, {}))
        rnd = butterfly._round(5)
        rnd.group, rnd.owning, rnd.finished = ("a", "fake-00001"), ("a", "fake-00001"), True
        rnd.held[0] = (part, {})
        answers = []
        for peer in [1] * (MAX_SENDS_PER_PEER + 3) + [2]:
            writer = Writer()
            await butterfly._serve_part(_pusher(peer), request(), writer)
            answers.append(part in writer.data)
        assert answers == [True] * MAX_SENDS_PER_PEER + [False] * 3 + [True]
        assert len(rnd.part_sends) == 2

    asyncio.run(main())
