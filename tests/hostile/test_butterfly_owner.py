"""Hostile butterfly owners between three real hivemind DHT peers in this process (swarm/butterfly.py,
outer/verify.py): an owner that sends different bytes to different members, or a ×1e16 part to all,
has its part skipped by both honest members alike, which apply the same mean (docs/architecture.md §9)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from diloco_node.codec import CodecConfig, make_codec
from diloco_node.outer.averaging import Averaging
from diloco_node.round import Gathered, Outcome, PartIn, Reduced, Reducer
from diloco_node.swarm.butterfly import Butterfly
from diloco_node.swarm.streams import Streams
from tests.integration.test_butterfly import NUMEL, run_round


def hostile_owner(member: tuple[str, Streams, Butterfly], change: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    """Member's butterfly answers the n-th push of its averaged part with change(part, n) instead."""
    codec, answers = make_codec(CodecConfig(name="none")), []

    async def answer(writer: asyncio.StreamWriter, answer: tuple[bytes, dict[str, Any]]) -> int:
        averaged, report = answer
        if averaged and "used" in report:  # a push's answer (not a recovery or hash request)
            answers.append(averaged)
            averaged = codec.encode(change(codec.decode(averaged, NUMEL // 3), len(answers)))
        return await Butterfly._answer(writer, (averaged, report))
    member[2]._answer = answer  # type: ignore[method-assign]


def means(results: dict[str, Reduced], honest: list[str]) -> list[torch.Tensor]:
    """The mean each honest member applies from what its exchange returned (outer/verify.py checks)."""
    codec = make_codec(CodecConfig(name="none"))
    out = []
    for index, peer in enumerate(honest):
        averaging = Averaging(codec, NUMEL, peer, part_align=1)
        own = averaging.encode(1, torch.full((NUMEL,), float(index + 4)), 100.0)
        out.append(averaging.mean(own, Gathered(Outcome.TOGETHER, 1, reduced=results[peer])).mean)
    return out


def test_an_owner_that_sends_different_parts_to_different_members_is_skipped_by_both(
        trio: list[tuple[str, Streams, Butterfly]]) -> None:
    group = [peer for peer, _, _ in trio]
    hostile_owner(trio[2], lambda part, n: part * (0.5 if n % 2 else 1.0))  # both within the bound
    results = run_round(trio, group)
    honest = group[:2]
    assert [sorted(results[peer].parts) for peer in honest] == [[0, 1], [0, 1]]
    applied = means(results, honest)
    assert torch.equal(applied[0], applied[1]) and applied[0][666:].eq(0).all()
    assert torch.allclose(applied[0][:666], torch.full((666,), 5.0))


def test_an_owner_that_sends_a_huge_part_to_everyone_has_it_skipped_alike(
        trio: list[tuple[str, Streams, Butterfly]]) -> None:
    codec = make_codec(CodecConfig(name="none"))

    def huge(reduce: Reducer) -> Reducer:
        def reduced(round_: int, index: int, layout: tuple[tuple[int, int], ...],
                    parts: list[PartIn]) -> tuple[bytes, dict[str, Any]]:
            averaged, report = reduce(round_, index, layout, parts)
            return codec.encode(codec.decode(averaged, NUMEL // 3) * 1e16), report
        return reduced
    group = [peer for peer, _, _ in trio]
    results = run_round(trio, group, reducers={group[2]: huge})
    honest = group[:2]
    assert [sorted(results[peer].parts) for peer in honest] == [[0, 1, 2], [0, 1, 2]]  # the same bytes to all
    applied = means(results, honest)
    assert torch.equal(applied[0], applied[1]) and applied[0][666:].eq(0).all()
    assert torch.allclose(applied[0][:666], torch.full((666,), 5.0))
