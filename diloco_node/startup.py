"""What a node loads before its first round: its checkpoint, in the canonical layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from diloco_node.checkpoint import CheckpointError, CheckpointStore
from diloco_node.codec import Codec
from diloco_node.outer.state import OuterState
from diloco_node.outer.sync import Applied
from diloco_node.replica import Replica

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    inner_step: int
    data_position: int
    stream_seed: int
    outstanding: list[Applied]  # our pseudo-gradients still awaiting their round's mean


def resume(store: CheckpointStore, fingerprint: str, state: OuterState, replica: Replica,
           codec: Codec) -> Resumed | None:
    """Install the checkpoint into φ's state, the replica and the codec; None when there is none."""
    saved = store.load()
    if saved is None:
        return None
    if saved["fingerprint"] != fingerprint:
        raise CheckpointError(f"checkpoint in '{store.directory}' was made with another model/config")
    state.install(saved["round"], saved["outer_params"], saved["momentum"])
    inner_step = 0
    if saved["format"] >= 2:
        replica.load_inner_state(saved["inner"])
        inner_step = int(saved["inner"]["step"])
    else:
        logger.warning("checkpoint from an older version: the inner optimizer starts afresh")
    codec.load_state_dict(saved["codec"])
    logger.info("resumed round=%d from %s", state.round, store.path)
    return Resumed(inner_step, saved["data_position"], saved["stream_seed"],
                   [Applied(**entry) for entry in saved.get("outstanding", [])])
