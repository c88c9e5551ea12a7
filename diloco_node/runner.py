"""Runs one node for `diloco-node join`: start-up errors become one line and exit code 2."""

from __future__ import annotations

import logging

import click
import torch

from diloco_node.admission import AdmissionError
from diloco_node.checkpoint import CheckpointError
from diloco_node.config import NodeConfig
from diloco_node.identity import IdentityError
from diloco_node.node import Node
from diloco_node.replica import ReplicaError
from diloco_node.swarm.member import SwarmError
from diloco_node.swarm.presence import IncompatibleRun
from diloco_node.telemetry.events import EventsError
from diloco_node.telemetry.server import StatusServerError
from diloco_node.train.data import DataError
from diloco_node.train.device import DeviceError

logger = logging.getLogger(__name__)

START_UP_ERRORS = (DataError, SwarmError, StatusServerError, CheckpointError, DeviceError,
                   IncompatibleRun, IdentityError, EventsError, AdmissionError)


def say(line: str) -> None:
    click.echo(line)  # stdout, flushed per line: scripts and other nodes read these addresses


def run_node(cfg: NodeConfig) -> int:
    if cfg.rank_threads():
        torch.set_num_threads(cfg.rank_threads())
    node = None
    try:
        node = Node(cfg, say=say)
        node.start()
    except (*START_UP_ERRORS, ReplicaError) as exc:
        click.echo(f"diloco-node: error: {exc}", err=True)
        if node is not None:
            node.abort()
        return 1 if isinstance(exc, ReplicaError) else 2
    return node.run()
