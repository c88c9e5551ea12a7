"""Pace hivemind's search for a group leader.

While its leader queue holds nobody it may join, hivemind's matchmaking (PotentialLeaders) reads
the group key from the DHT again the moment the last read returns: a DHT get (a ping and a find)
every millisecond or two through the whole matchmaking window. Measured with two nodes, H = 100,
int4: ~500 of them per round, ~450 KB of DHT traffic per node-round on the wire against a 213 KB
payload, 6× the payload over a 10 Mbit/s link (benchmarks/headline.py). One read per
SEARCH_INTERVAL finds a new leader as soon as matters in a window of seconds: 0.2 s still cost ~15
reads per node-round; 0.5 s, a sixth of the default 3 s window, costs ~6.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from hivemind.averaging.key_manager import GroupKeyManager

SEARCH_INTERVAL = 0.5  # seconds between two reads of the group key by one averager


def pace_leader_search() -> None:
    """Make each GroupKeyManager read its group's averagers at most once per SEARCH_INTERVAL.

    Applied in our process before hivemind forks its averager, which inherits the paced class."""
    original = GroupKeyManager.get_averagers
    if getattr(original, "paced", False):
        return

    @functools.wraps(original)
    async def paced(self: GroupKeyManager, *args: Any, **kwargs: Any) -> Any:
        last = getattr(self, "_last_search", None)
        if last is not None and (wait := last + SEARCH_INTERVAL - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        self._last_search = time.monotonic()
        return await original(self, *args, **kwargs)

    paced.paced = True  # type: ignore[attr-defined]
    GroupKeyManager.get_averagers = paced  # type: ignore[method-assign]
