"""Atomic checkpoints: write to a temporary file, fsync, rename, fsync the directory.

A crash at any moment leaves either the previous checkpoint or the new one, never half of one.
A lock file keeps two nodes from sharing one directory (they would overwrite each other's state).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import IO, Any

import torch

from diloco_node.errors import NodeError

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "node.pt"
FORMAT_VERSION = 2  # 2: the inner optimizer's state in the canonical layout (any layout resumes it)
READABLE_FORMATS = (1, 2)


class CheckpointError(NodeError, RuntimeError):
    """A checkpoint that cannot be used, phrased as one line for the user."""


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint file's state, without the directory's lock (a file is only ever replaced whole).
    Tensors and plain values only: torch.load with weights_only=True runs no pickled code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for damaged files; all mean the same here
        # torch's own message can run to a dozen lines, and for weights_only it advises loading the
        # file unsafely: the user gets one line, without that advice
        text = str(exc).strip()
        first = "it holds more than tensors and plain values" if text.startswith("Weights only load failed") \
            else text.splitlines()[0] if text else type(exc).__name__
        raise CheckpointError(f"checkpoint '{path}' is unreadable (damaged, or not a checkpoint): {first}") from None
    if not isinstance(state, dict) or state.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"checkpoint '{path}' has an unknown format")
    return state


class CheckpointStore:
    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock: IO[str] = open(self.directory / ".lock", "w")
        except OSError as exc:
            raise CheckpointError(f"checkpoint dir '{directory}' is not usable: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"checkpoint dir '{directory}' is in use by another node") from None

    @property
    def path(self) -> Path:
        return self.directory / CHECKPOINT_NAME

    def save(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as file:
            torch.save({"format": FORMAT_VERSION, **state}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # makes the rename itself durable
        finally:
            os.close(dir_fd)

    def load(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        return read_checkpoint(self.path)

    def close(self) -> None:
        self._lock.close()
