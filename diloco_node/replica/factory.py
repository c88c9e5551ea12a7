"""The replica a node's config asks for."""

from __future__ import annotations

from collections.abc import Callable

from diloco_node.replica.base import Replica, ReplicaSettings


def make_replica(settings: ReplicaSettings, on_failure: Callable[[], None] | None = None) -> Replica:
    if settings.parallel == "none":
        from diloco_node.replica.single import SingleReplica
        return SingleReplica(settings)
    from diloco_node.replica.ranks import RankedReplica
    return RankedReplica(settings, on_failure)
