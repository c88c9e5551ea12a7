"""A node whose p2pd daemon or averager process dies exits 1 as when its DHT process dies (see
test_dead_helper.py, which holds the check)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import NodeFactory
from tests.system.test_dead_helper import dies_and_exits_1

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("victim", ["p2pd", "averager"])
def test_a_dead_p2pd_or_averager_makes_the_node_unhealthy_and_exit_1(spawn: NodeFactory, victim: str) -> None:
    dies_and_exits_1(spawn, victim)
