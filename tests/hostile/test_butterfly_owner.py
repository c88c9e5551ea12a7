"""Hostile butterfly owners (swarm/butterfly.py, outer/verify.py): an owner that sends different bytes
to different members, or a ×1e16 part to all, has its part skipped by both honest members alike,
which apply the same mean (docs/architecture.md §9). First between three real hivemind DHT peers in
this process, then with forger.py in a process of its own against two real nodes and a clean twin
run (as tests/hostile/test_deviation.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_node.codec import CodecConfig, make_codec
from diloco_node.identity import create
from diloco_node.outer.averaging import Averaging
from diloco_node.round import Gathered, Outcome, PartIn, Reduced, Reducer
from diloco_node.swarm.butterfly import Butterfly
from diloco_node.swarm.streams import Streams
from tests.hostile.test_deviation import MEMORY_SLACK, MOMENTUM, OUTER_LR, ROUNDS, peak_memory, twin_run
from tests.integration.conftest import NodeFactory
from tests.integration.test_butterfly import NUMEL, run_round

pytestmark = pytest.mark.integration


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


# --- the same attacks from forger.py in a process of its own, against two real nodes -----------

BUTTERFLY = ("--exchange", "butterfly")  # an open run that asks for it: every group exchanges by butterfly


def test_a_hostile_owner_moves_phi_no_further_than_its_part_of_the_clean_mean(
        spawn: NodeFactory, tmp_path: Path) -> None:
    """forger.py's owner answers ×1e16 parts in even rounds and different parts to the two members
    in odd ones. Both honest nodes skip its part in every round it owned one (twin_run asserts they
    end with the same φ, round after round). Its part is zero in their mean, so a round's mean
    differs from the clean twin's by at most both runs' honest means: the bound sums that through
    Nesterov, as test_deviation.py does; a ×1e16 part applied would be ~1e16 beyond it."""
    keys = {name: tmp_path / f"{name}.key" for name in "ab"}
    for path in keys.values():
        create(path)  # the same peer ids, so the same data orders, in both runs
    clean = twin_run(spawn, "clean", keys, extra=BUTTERFLY)
    hostile = twin_run(spawn, "hostile", keys, attack="owner", extra=BUTTERFLY)
    in_group = [int(line.split()[1]) for line in hostile.forged if line.split()[2] == "3"]
    assert in_group, f"the forger never averaged\n{hostile.nodes[0].log_text()[-3000:]}"
    log = hostile.nodes[0].log_text()
    too_long, differing = log.count("its contributions allow"), log.count("other bytes or none")
    assert too_long + differing >= len(in_group) and too_long and differing, (too_long, differing, in_group)
    rounds = range(1, ROUNDS + 1)
    clean_norms, hostile_norms = clean.checkpoints.mean_norms(rounds), hostile.checkpoints.mean_norms(rounds)
    bound = sum(OUTER_LR * sum(MOMENTUM ** j for j in range(ROUNDS - r + 2)) * (clean_norms[r] + hostile_norms[r])
                for r in rounds)
    deviation = float((hostile.phi(hostile.nodes[0]) - clean.phi(clean.nodes[0])).norm())
    print(f"owner in {len(in_group)} rounds; its part skipped as too long {too_long}×, as differing "
          f"{differing}×; ‖φ_hostile − φ_clean‖ = {deviation:.4g}, bound {bound:.4g}; peak memory "
          f"{peak_memory(hostile) >> 20} MiB (clean {peak_memory(clean) >> 20} MiB)")
    assert deviation <= bound, (deviation, bound)
    assert peak_memory(hostile) <= peak_memory(clean) + MEMORY_SLACK
