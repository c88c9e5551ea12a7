"""NoLoCo's random groups: who averages with whom in a round.

Every node draws the same shuffle of the live peers from a seed both sides know (run id and round),
so the groups agree without a coordinator and change every round. Each node then matchmakes
through hivemind under its group's key only, so it waits for its own group, never the swarm. Where
two nodes' views of the live peers differ (someone just joined or left), a group can come out
smaller than drawn; its members then average with whoever did turn up, or alone.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable

GROUP_BITS = 8  # group key bits for the group index: up to 256 groups (more nodes share keys)


def random_groups(peers: Iterable[str], run_id: str, round_: int, size: int, least: int = 1) -> list[list[str]]:
    """Split the peers into ⌈N/size⌉ groups of sizes differing by at most one, all ≤ size; with
    `least` (--min-group-size from 3), into fewer where needed so that none is smaller than `least`
    (then a group may be larger than `size`, below 2·least). A run of fewer than `least` is one group."""
    ordered = sorted(set(peers))
    seed = hashlib.sha256(f"{run_id}:{round_}".encode()).digest()
    random.Random(seed).shuffle(ordered)
    count = max(1, min(math.ceil(len(ordered) / size), len(ordered) // least))
    return [ordered[index::count] for index in range(count)]


def group_key(peer: str, groups: list[list[str]]) -> str:
    """The group-index bits of the group holding `peer` (all ones when it is in none)."""
    index = next((i for i, group in enumerate(groups) if peer in group), 2**GROUP_BITS - 1)
    return format(index % 2**GROUP_BITS, f"0{GROUP_BITS}b")


# NoLoCo's spare key of a round (one bit longer than any group's): nodes whose drawn partners were
# all dropped matchmake under it once more (swarm/presence.Presence.spare_partners)
SPARE_KEY = "1" * (GROUP_BITS + 1)
