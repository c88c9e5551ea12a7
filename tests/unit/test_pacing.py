"""hivemind's leader search, paced (swarm/pacing.py)."""

from __future__ import annotations

import asyncio
import time

from hivemind.averaging.key_manager import GroupKeyManager

from diloco_node.swarm import pacing


def test_group_key_reads_are_paced(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    reads: list[float] = []

    async def read(self, group_key, only_active):  # type: ignore[no-untyped-def]
        reads.append(time.monotonic())
        return []

    monkeypatch.setattr(GroupKeyManager, "get_averagers", read)
    pacing.pace_leader_search()
    pacing.pace_leader_search()  # applied once, however often imported
    manager = object.__new__(GroupKeyManager)  # no DHT: only the pacing is under test

    async def search() -> None:
        for _ in range(4):
            await GroupKeyManager.get_averagers(manager, "key.0b", True)

    asyncio.run(search())
    gaps = [b - a for a, b in zip(reads, reads[1:], strict=False)]
    assert len(reads) == 4 and min(gaps) >= pacing.SEARCH_INTERVAL * 0.95, gaps
