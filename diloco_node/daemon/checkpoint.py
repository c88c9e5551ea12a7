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
A checkpoint is confined to its directory: the manifest may name only a plain tensors file beside
it (no path, no link, no device), and any damage, a missing or mistyped key included, is refused in
one line (`CheckpointError`), never a traceback (docs/architecture.md §11).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from diloco_node.errors import NodeError

if TYPE_CHECKING:
    from diloco_node.config import NodeConfig
    from diloco_node.telemetry.progress import Meter

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "node.json"  # the manifest; what a checkpoint is found by
LEGACY_NAME = "node.pt"  # formats 1 and 2: one torch.save file
TENSORS_PREFIX, TENSORS_SUFFIX = "node-", ".safetensors"
FORMAT_VERSION = 3  # 3: safetensors + JSON manifest; 2: the inner optimizer's state in the canonical layout
READABLE_FORMATS = (1, 2, 3)
HASH_CHUNK = 1 << 22
# what a manifest may name: a file our own save wrote beside it (`node-<16 hex>.safetensors`); no
# directory part, so neither an absolute path (`/dev/zero`, which hangs the hash) nor `..`
TENSORS_NAME = re.compile(r"node-[0-9a-f]{16}\.safetensors")
# a manifest holds the state's structure and scalars (the tensors are elsewhere): a few MiB at most
MAX_MANIFEST_BYTES = 64 << 20
MAX_ROUND = 2**40  # the records' bound on a round (swarm/records.py)


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


def _sha256(path: Path, progress: Meter | None = None) -> str:
    """The file's SHA-256; `progress` is told its size and each chunk read (a large checkpoint's
    check is most of `export`'s time)."""
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        if progress is not None:
            progress.expect(os.fstat(file.fileno()).st_size)
        while chunk := file.read(HASH_CHUNK):
            hasher.update(chunk)
            if progress is not None:
                progress.add(len(chunk))
    return hasher.hexdigest()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- reading --------------------------------------------------------------------------------------


def read_checkpoint(path: Path, progress: Meter | None = None) -> dict[str, Any]:
    """A checkpoint's state, without the directory's lock (files are only ever replaced whole).
    `path` is the manifest, the run's checkpoint directory, or an old torch `node.pt`; `progress`
    is told the bytes of its check."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME if (path / CHECKPOINT_NAME).exists() or not (path / LEGACY_NAME).exists() \
            else path / LEGACY_NAME
    if path.suffix == ".pt":
        return _read_legacy(path)
    try:
        manifest = json.loads(_read_manifest(path))
        if not isinstance(manifest, dict) or not _is_int(manifest.get("format")) \
                or manifest["format"] not in READABLE_FORMATS:
            raise CheckpointError(f"checkpoint '{path}' has an unknown format")
        tensors_path = _tensors_path(path, manifest.get("tensors"))
        if _sha256(tensors_path, progress) != manifest.get("sha256"):
            raise ValueError(f"{tensors_path.name} does not match the SHA-256 its manifest names")
        from safetensors.torch import load_file

        state = _decode(manifest.get("state"), load_file(tensors_path, device="cpu"))
    except CheckpointError:
        raise
    except Exception as exc:  # json, safetensors and the OS raise many types; all mean the same here
        raise CheckpointError(f"checkpoint '{path}' is unreadable (damaged, or not a checkpoint): "
                              f"{_first_line(exc)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint '{path}' has an unknown format")
    return {**state, "format": manifest["format"]}


def _read_manifest(path: Path) -> bytes:
    """The manifest's bytes, once it is known to be a regular file of a manifest's size: a FIFO or
    a device in its place would block or never end (ValueError: refused)."""
    # O_NONBLOCK: opening a FIFO would otherwise wait for a writer (no effect on a regular file)
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
            raise ValueError("the manifest is not a regular file of at most "
                             f"{MAX_MANIFEST_BYTES >> 20} MiB")
        return file.read(MAX_MANIFEST_BYTES + 1)


def _tensors_path(manifest_path: Path, name: Any) -> Path:
    """The tensors file a manifest names, confined to the manifest's directory: a name our save
    writes, naming a regular file there (not a link, a device or a FIFO)."""
    if not isinstance(name, str) or not TENSORS_NAME.fullmatch(name):
        raise CheckpointError(f"checkpoint '{manifest_path}' names a tensors file outside its directory "
                              f"or not of its own making: {_shown(name)}")
    path = manifest_path.parent / name
    if not stat.S_ISREG(os.lstat(path).st_mode):  # OSError when missing: unreadable, as before
        raise CheckpointError(f"checkpoint '{manifest_path}' names {name}, which is not a regular file")
    return path


def _shown(value: Any, limit: int = 80) -> str:
    """A manifest's value in a one-line message: repr-escaped and cut, whatever it holds."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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


# --- a node's state: every key it is resumed or exported from, checked before use --------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_tensors(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value)


def _is_inner(value: Any) -> bool:
    """The inner optimizer's canonical state: steps, and per parameter name a pair of moments."""
    return isinstance(value, dict) and _is_int(value.get("step")) and value["step"] >= 0 \
        and _is_number(value.get("adam_step")) and isinstance(value.get("moments"), dict) \
        and all(isinstance(name, str) and isinstance(pair, (tuple, list)) and len(pair) == 2
                and all(isinstance(t, torch.Tensor) for t in pair) and pair[0].shape == pair[1].shape
                for name, pair in value["moments"].items())


def _is_outstanding(value: Any) -> bool:
    """Our Δs awaiting their rounds' means (outer/sync.Applied, as dicts)."""
    return isinstance(value, list) and all(
        isinstance(entry, dict) and set(entry) <= {"round", "own", "weight", "at_step"}
        and _is_int(entry.get("round")) and isinstance(entry.get("own"), torch.Tensor)
        and entry["own"].dim() == 1 and _is_number(entry.get("weight")) and _is_int(entry.get("at_step", 0))
        for entry in value)


# what each key of a node's checkpoint must hold (node.Node.save_checkpoint writes them); the
# resume reads every one, so a missing or mistyped key is refused here in one line, not as a
# KeyError or TypeError from deep inside the install
NODE_KEYS: dict[str, Callable[[Any], bool]] = {
    "fingerprint": lambda v: isinstance(v, str),
    "round": lambda v: _is_int(v) and 0 <= v <= MAX_ROUND,
    "outer_params": _is_tensors,
    "momentum": lambda v: v is None or _is_tensors(v),
    "codec": lambda v: isinstance(v, dict),
    "data_position": lambda v: _is_int(v) and v >= 0,
    "stream_seed": _is_int,
}
OPTIONAL_KEYS: dict[str, Callable[[Any], bool]] = {
    "inner": _is_inner,  # formats 2 and 3 (required there)
    "outstanding": _is_outstanding,
    "export": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
    "drift": lambda v: True,  # Drift.restore checks it against φ and starts θ afresh when it does not fit
    "reach": lambda v: True,  # Reach.restore checks it, and holds nothing measured when it is refused
}


def export_info(cfg: NodeConfig) -> dict[str, str]:
    """What `diloco-node export` needs to know of a run, saved in each checkpoint under "export" (plain
    strings: the JSON manifest); commands/export.py reads it back."""
    from diloco_node.train.hf import HFSpec
    from diloco_node.train.model import resolve_model

    spec = resolve_model(cfg.inputs.model)
    tokenizer = cfg.inputs.tokenizer or ""
    if tokenizer:
        from diloco_node.train.tokenizer import tokenizer_file

        tokenizer = str(tokenizer_file(tokenizer).resolve())
    return {"model": cfg.inputs.model, "config": spec.config_json if isinstance(spec, HFSpec) else "",
            "tokenizer": tokenizer}


def check_node_state(state: dict[str, Any], path: Path | str, keys: Sequence[str] | None = None) -> None:
    """Refuse, in one line, a checkpoint lacking one of `keys` (default: every key a resume
    reads) or holding a value of the wrong kind under any key it has."""
    wanted = list(NODE_KEYS) + (["inner"] if state.get("format", FORMAT_VERSION) >= 2 else []) \
        if keys is None else list(keys)
    for key in wanted:
        if key not in state:
            raise CheckpointError(f"checkpoint '{path}' is damaged: it lacks '{key}'")
    for key, fits in {**NODE_KEYS, **OPTIONAL_KEYS}.items():
        if key in state and not fits(state[key]):
            raise CheckpointError(f"checkpoint '{path}' is damaged: its '{key}' is not what a checkpoint holds")


def check_fits(state: dict[str, Any], path: Path | str, shapes: Sequence[torch.Size]) -> None:
    """Refuse, in one line, a checkpoint whose tensors are not of the model's shapes (φ's): a
    mismatch would otherwise surface as a torch error mid-install, or mid-run for the moments."""
    def same(tensors: Sequence[torch.Tensor]) -> bool:
        return len(tensors) == len(shapes) and all(t.shape == s for t, s in zip(tensors, shapes, strict=True))

    moments = state.get("inner", {}).get("moments", {}) if isinstance(state.get("inner"), dict) else {}
    known = set(shapes)
    if not same(state["outer_params"]) or (state.get("momentum") is not None and not same(state["momentum"])) \
            or len(moments) > len(shapes) or any(pair[0].shape not in known for pair in moments.values()):
        raise CheckpointError(f"checkpoint '{path}' does not fit this model: its tensors have other shapes "
                              "(damaged, or made with another model)")


@contextmanager
def installing(path: Path | str) -> Iterator[None]:
    """Around the install of a checked checkpoint into the node's parts: what the checks cannot
    foresee (a codec's or the replica's own view of its state) still ends in one line."""
    try:
        yield
    except (CheckpointError, torch.OutOfMemoryError):
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
        logger.debug("installing checkpoint %s failed", path, exc_info=True)
        raise CheckpointError(f"checkpoint '{path}' does not fit this node (damaged?): {_first_line(exc)}") from None


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
            return str(json.loads(_read_manifest(self.directory / CHECKPOINT_NAME))["tensors"])
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
