"""Hostile butterfly members (swarm/butterfly.py, seals.py, outer/verify.py): an owner that seals
different bytes for different members, or a ×1e16 part for all, has its part skipped by both honest
members alike, which apply the same mean; bytes their owner did not seal are not taken, and a
member lying about the hashes it holds makes nobody skip anything (docs/architecture.md §9). First
between three real hivemind DHT peers in this process, then with forger.py in a process of its own
against two real nodes and a clean twin run (as tests/hostile/test_deviation.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_node.codec import CodecConfig, make_codec
from diloco_node.outer.averaging import Averaging
from diloco_node.round import Gathered, Outcome, PartIn, Reduced, Reducer
from diloco_node.swarm.butterfly import Butterfly, digest
from diloco_node.swarm.identity import create
from diloco_node.swarm.messages import Told
from diloco_node.swarm.streams import Streams
from diloco_node.trust.seals import statement
from tests.hostile.test_deviation import MEMORY_SLACK, MOMENTUM, OUTER_LR, ROUNDS, peak_memory, twin_run
from tests.integration.conftest import NodeFactory
from tests.integration.test_butterfly import NUMEL, run_round

pytestmark = pytest.mark.integration


def hostile_owner(member: tuple[str, Streams, Butterfly], change: Callable[[torch.Tensor, int], torch.Tensor],
                  sealed: bool = True) -> None:
    """Member's butterfly answers the n-th push of its averaged part with change(part, n) instead,
    sealed with its own key as an honest owner seals (`sealed`) or with the seal of the true part."""
    codec, answers, butterfly = make_codec(CodecConfig(name="none")), [], member[2]

    async def answer(writer: asyncio.StreamWriter, answer: tuple[bytes, dict[str, Any]]) -> int:
        averaged, report = answer
        if averaged and "used" in report:  # a push's answer (not a recovery or hash request)
            answers.append(averaged)
            averaged = codec.encode(change(codec.decode(averaged, NUMEL // 3), len(answers)))
            if sealed:
                unsealed = {key: value for key, value in report.items() if key != "seal"}
                signed = statement("btest", 1, 2, butterfly._rounds[1].owning,
                                   digest((averaged, unsealed)))
                report = {**unsealed, "seal": butterfly._sealer.seal(signed).to_wire()}
        return await Butterfly._answer(writer, (averaged, report))
    butterfly._answer = answer  # type: ignore[method-assign]


def means(results: dict[str, Reduced], honest: list[str]) -> list[torch.Tensor]:
    """The mean each honest member applies from what its exchange returned (outer/verify.py checks)."""
    codec = make_codec(CodecConfig(name="none"))
    out = []
    for index, peer in enumerate(honest):
        averaging = Averaging(codec, NUMEL, peer, part_align=1)
        own = averaging.encode(1, torch.full((NUMEL,), float(index + 4)), 100.0)
        out.append(averaging.mean(own, Gathered(Outcome.TOGETHER, 1, reduced=results[peer])).mean)
    return out


def test_an_owner_that_seals_different_parts_for_different_members_is_skipped_by_both(
        trio: list[tuple[str, Streams, Butterfly]], caplog: pytest.LogCaptureFixture) -> None:
    group = [peer for peer, _, _ in trio]
    hostile_owner(trio[2], lambda part, n: part * (0.5 if n % 2 else 1.0))  # both within the bound
    results = run_round(trio, group)
    honest = group[:2]
    assert [sorted(results[peer].parts) for peer in honest] == [[0, 1], [0, 1]]
    applied = means(results, honest)
    assert torch.equal(applied[0], applied[1]) and applied[0][666:].eq(0).all()
    assert torch.allclose(applied[0][:666], torch.full((666,), 5.0))
    assert caplog.text.count("sealed 2 different versions") == 3  # every member (the owner runs honest code here)


def test_bytes_an_owner_did_not_seal_are_not_taken_and_the_sealed_part_is_fetched_from_a_member(
        trio: list[tuple[str, Streams, Butterfly]], caplog: pytest.LogCaptureFixture) -> None:
    """The owner changes its first answer after sealing: that member refuses the bytes, and takes
    the part from the other member, which holds the sealed version."""
    group = [peer for peer, _, _ in trio]
    hostile_owner(trio[2], lambda part, n: part * (0.5 if n == 1 else 1.0), sealed=False)
    results = run_round(trio, group)
    honest = group[:2]
    assert [sorted(results[peer].parts) for peer in honest] == [[0, 1, 2], [0, 1, 2]]
    applied = means(results, honest)
    assert torch.equal(applied[0], applied[1]) and torch.allclose(applied[0], torch.full((NUMEL,), 5.0))
    assert caplog.text.count("is not what its owner") == 1


def test_a_member_lying_about_the_parts_it_holds_makes_nobody_skip_a_part(
        trio: list[tuple[str, Streams, Butterfly]], caplog: pytest.LogCaptureFixture) -> None:
    """The third member tells everyone a hash its owner did not seal for part 0 and that it lacks
    part 1 (before seals, either made the members it told skip the part, and telling only some of
    them split φ)."""
    group = [peer for peer, _, _ in trio]
    liar = trio[2][2]
    honest_hashes = liar._hashes

    def lies(rnd: Any) -> list[Told | None]:
        told = honest_hashes(rnd)
        return [Told("0" * 64, told[0].seal) if told[0] else None, None, *told[2:]]
    liar._hashes = lies  # type: ignore[method-assign]
    results = run_round(trio, group)
    assert [sorted(results[peer].parts) for peer in group[:2]] == [[0, 1, 2], [0, 1, 2]]
    applied = means(results, group[:2])
    assert torch.equal(applied[0], applied[1]) and torch.allclose(applied[0], torch.full((NUMEL,), 5.0))
    assert "told hashes their owners did not seal" in caplog.text


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
    too_long, differing = log.count("its contributions allow"), log.count("sealed 2 different versions")
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
