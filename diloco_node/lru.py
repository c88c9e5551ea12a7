"""Tables a peer can grow, bounded by forgetting their least recently used entries.

Records, streams and claims name peer ids, and peer ids are free: every per-peer table keeps its
most recent entries only (docs/architecture.md §9). One leaf module, so that trust/ (its
declared work, trust/work.py) and swarm/ share it without importing hivemind.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_TRACKED_PEERS = 4096  # per-peer tables (limits, logged refusals, isolation) forget the least recent beyond this


def trim_oldest(table: OrderedDict[Any, Any], capacity: int) -> None:
    """Drop `table`'s least recent entries (its first) beyond `capacity`."""
    while len(table) > capacity:
        table.popitem(last=False)


class LRUSet:
    """A set that forgets its least recently added members beyond `capacity`: a per-peer table
    fresh peer ids cannot grow without bound."""

    def __init__(self, capacity: int = MAX_TRACKED_PEERS):
        self._items: OrderedDict[Any, None] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Any) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        trim_oldest(self._items, self._capacity)
