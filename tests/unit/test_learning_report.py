"""The learning report's arithmetic (benchmarks/learning.py): what "gain at the budget" compares."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmark_scripts import load


@pytest.fixture(scope="module")
def learning() -> ModuleType:
    return load("learning")


def curve(*points: tuple[int, float]) -> list[list[object]]:
    return [[tokens, [loss]] for tokens, loss in points]


def test_gain_at_the_budget_takes_alone_s_median_seed_and_its_best_schedule(learning: ModuleType) -> None:
    """Three alone seeds reach loss 5.0 at 200, 300 and 900 tokens: the median's 300, not the lucky
    seed's 200; a second schedule whose median is later does not count; one seed that never gets
    there counts as never."""
    seeds = [curve((100, 6.0), (200, 5.0)), curve((100, 6.0), (300, 5.0)), curve((100, 6.0), (900, 5.0))]
    later = [curve((400, 5.0))] * 3
    assert learning.gain_at_budget([5.0, 5.0], {"6x": seeds, "4x": later}, 100) == 3.0
    never = [curve((100, 6.0)), curve((100, 6.0)), curve((200, 5.0))]
    assert learning.gain_at_budget([5.0], {"6x": never}, 100) is None
    assert learning.gain_at_budget([None], {"6x": seeds}, 100) is None
