"""The outer update a node's config asks for (outer/update.py has the seam)."""

from __future__ import annotations

from diloco_node.config import NodeConfig
from diloco_node.outer.blocking import BlockingUpdate
from diloco_node.outer.gossip import GossipUpdate
from diloco_node.outer.noloco import NoLoCoOptimizer
from diloco_node.outer.overlapped import OverlappedUpdate
from diloco_node.outer.update import OuterUpdate, UpdateContext


def make_update(cfg: NodeConfig, ctx: UpdateContext) -> OuterUpdate:
    """The update for the configured algorithm and sync mode, on the optimizer OuterState holds."""
    optimizer = ctx.state.optimizer
    if isinstance(optimizer, NoLoCoOptimizer):
        return GossipUpdate(ctx, optimizer)
    if cfg.outer.sync == "blocking":
        return BlockingUpdate(ctx, optimizer)
    return OverlappedUpdate(ctx, optimizer, cfg)
