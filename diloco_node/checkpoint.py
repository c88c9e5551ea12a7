"""Atomic checkpoints: tensors in a safetensors file, everything else in a JSON manifest written last.

A checkpoint is two files in the run's directory (docs/architecture.md §12):
- `node-<sha>.safetensors`: every tensor of the state (φ, outer momentum, the inner optimizer's
  moments, a codec's residual, in-flight pseudo-gradients), named by where it sits in the state;
  `<sha>` is the start of the file's SHA-256, so a new save never overwrites the file the current
  manifest names;
- `node.json`: the manifest: the rest of the state (round, data position, stream seed, fingerprint,
  export info...) with each tensor replaced by a reference to its name, the tensors file's name and
  its full SHA-256.
Each is written to a temporary file, fsynced and renamed; the manifest goes last, so a crash at any
moment leaves the previous checkpoint or the new one, never half of one. The previous tensors file
is kept (one save longer) so a reader that opened the manifest just before a save still finds it.
No pickle anywhere: a checkpoint cannot run code when read. An old `node.pt` (torch's format, from
before safetensors) is still read, with weights_only=True, and replaced by the next save.
A lock file keeps two nodes from sharing one directory (they would overwrite each other's state).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import IO, Any

import torch

from diloco_node.errors import NodeError

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "node.json"  # the manifest; what a checkpoint is found by
LEGACY_NAME = "node.pt"  # formats 1 and 2: one torch.save file
TENSORS_PREFIX, TENSORS_SUFFIX = "node-", ".safetensors"
FORMAT_VERSION = 3  # 3: safetensors + JSON manifest; 2: the inner optimizer's state in the canonical layout
READABLE_FORMATS = (1, 2, 3)
HASH_CHUNK = 1 << 22


class CheckpointError(NodeError, RuntimeError):
    """A checkpoint that cannot be used, phrased as one line for the user."""


# --- the state as JSON plus named tensors ---------------------------------------------------------
#
# JSON has no tensors, tuples or non-string keys; the state has all three (the inner moments are
# {name: (m, v)}). Each is written as a one-key object whose key starts with "$", which no key of
# the state does.


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor], seen: set[int]) -> Any:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu")
        storage = tensor.untyped_storage()
        # safetensors refuses tensors that share memory or view part of a storage: copy those
        if storage.data_ptr() in seen or storage.nbytes() != tensor.numel() * tensor.element_size() \
                or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(tensor.untyped_storage().data_ptr())
        name = path or "tensor"
        while name in tensors:
            name += "'"
        tensors[name] = tensor
        return {"$tensor": name}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, f"{path}/{k}" if path else k, tensors, seen) for k, v in value.items()}
        return {"$items": [[_encode(k, f"{path}/key{i}", tensors, seen), _encode(v, f"{path}/{i}", tensors, seen)]
                           for i, (k, v) in enumerate(value.items())]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a checkpoint holds tensors and plain values, not {type(value).__name__} (at {path})")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (key, inner), = value.items()
        if key == "$tensor":
            if inner not in tensors:
                raise ValueError(f"the manifest names a tensor '{inner}' the tensors file lacks")
            return tensors[inner]
        if key == "$tuple":
            return tuple(_decode(v, tensors) for v in inner)
        if key == "$items":
            return {_decode(k, tensors): _decode(v, tensors) for k, v in inner}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(HASH_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- reading --------------------------------------------------------------------------------------


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's state, without the directory's lock (files are only ever replaced whole).
    `path` is the manifest, the run's checkpoint directory, or an old torch `node.pt`."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME if (path / CHECKPOINT_NAME).exists() or not (path / LEGACY_NAME).exists() \
            else path / LEGACY_NAME
    if path.suffix == ".pt":
        return _read_legacy(path)
    try:
        manifest = json.loads(path.read_bytes())
        if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
            raise CheckpointError(f"checkpoint '{path}' has an unknown format")
        tensors_path = path.parent / str(manifest["tensors"])
        if _sha256(tensors_path) != manifest["sha256"]:
            raise ValueError(f"{tensors_path.name} does not match the SHA-256 its manifest names")
        from safetensors.torch import load_file

        state = _decode(manifest["state"], load_file(tensors_path, device="cpu"))
    except CheckpointError:
        raise
    except Exception as exc:  # json, safetensors and the OS raise many types; all mean the same here
        raise CheckpointError(f"checkpoint '{path}' is unreadable (damaged, or not a checkpoint): "
                              f"{_first_line(exc)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint '{path}' has an unknown format")
    return {**state, "format": manifest["format"]}


def _read_legacy(path: Path) -> dict[str, Any]:
    """A checkpoint from before safetensors (formats 1 and 2). torch.load with weights_only=True
    builds tensors and plain values only: it runs no pickled code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for damaged files; all mean the same here
        # torch's own message can run to a dozen lines, and for weights_only it advises loading the
        # file unsafely: the user gets one line, without that advice
        text = str(exc).strip()
        first = "it holds more than tensors and plain values" if text.startswith("Weights only load failed") \
            else _first_line(exc)
        raise CheckpointError(f"checkpoint '{path}' is unreadable (damaged, or not a checkpoint): {first}") from None
    if not isinstance(state, dict) or state.get("format") not in (1, 2):
        raise CheckpointError(f"checkpoint '{path}' has an unknown format")
    return state


# --- the store ------------------------------------------------------------------------------------


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
        """The checkpoint's manifest (or, until the first save of this version, an old node.pt)."""
        manifest = self.directory / CHECKPOINT_NAME
        legacy = self.directory / LEGACY_NAME
        return legacy if not manifest.exists() and legacy.exists() else manifest

    def save(self, state: dict[str, Any]) -> None:
        tensors: dict[str, torch.Tensor] = {}
        tree = _encode(state, "", tensors, set())
        from safetensors.torch import save_file

        staging = self.directory / f"{TENSORS_PREFIX}new{TENSORS_SUFFIX}.tmp"
        save_file(tensors, str(staging))
        self._sync(staging)
        sha = _sha256(staging)
        tensors_name = f"{TENSORS_PREFIX}{sha[:16]}{TENSORS_SUFFIX}"
        os.replace(staging, self.directory / tensors_name)
        manifest = json.dumps({"format": FORMAT_VERSION, "tensors": tensors_name, "sha256": sha, "state": tree})
        tmp = self.directory / f"{CHECKPOINT_NAME}.tmp"
        tmp.write_text(manifest)
        self._sync(tmp)
        previous = self._named_tensors()
        os.replace(tmp, self.directory / CHECKPOINT_NAME)
        self._sync_directory()  # makes both renames durable: the manifest never names a missing file
        self._prune(keep={tensors_name, previous})

    def load(self) -> dict[str, Any] | None:
        path = self.path
        if not path.exists():
            return None
        return read_checkpoint(path)

    def close(self) -> None:
        self._lock.close()

    def _named_tensors(self) -> str | None:
        """The tensors file the current manifest names (None when there is none, or it is unreadable)."""
        try:
            return str(json.loads((self.directory / CHECKPOINT_NAME).read_bytes())["tensors"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _prune(self, keep: set[str | None]) -> None:
        """Tensors files no manifest will name again, and an old node.pt the new manifest replaces."""
        for entry in self.directory.iterdir():
            stale = entry.name == LEGACY_NAME or (entry.name.startswith(TENSORS_PREFIX)
                                                  and entry.name not in keep)
            if stale:
                try:
                    entry.unlink()
                except OSError as exc:
                    logger.warning("could not remove old checkpoint file %s: %s", entry, exc.strerror)

    @staticmethod
    def _sync(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _sync_directory(self) -> None:
        self._sync(self.directory)
