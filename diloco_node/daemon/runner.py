"""Runs one node for `diloco-node join`: a start-up error becomes one line and its exit code."""

from __future__ import annotations

import click
import torch

from diloco_node.config import NodeConfig
from diloco_node.daemon.compose import build
from diloco_node.daemon.node import Node
from diloco_node.daemon.startup import start
from diloco_node.errors import NodeError


def say(line: str) -> None:
    click.echo(line)  # stdout, flushed per line: scripts and other nodes read these addresses


def run_node(cfg: NodeConfig) -> int:
    if cfg.local.rank_threads():
        torch.set_num_threads(cfg.local.rank_threads())
    node = None
    try:
        node = Node(build(cfg), say=say)
        start(node)
    except NodeError as exc:
        if node is None or not node.helper_failure:  # a dead helper was named in its one line already
            click.echo(f"diloco-node: error: {exc}", err=True)
        if node is not None:
            node.abort()
        return exc.exit_code
    return node.run()
