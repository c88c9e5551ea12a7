"""What config/ checks its values against, declared by the packages that own those values.

config/ is a leaf (docs/architecture.md, import rules): it imports no domain module, yet a model
preset, a codec, a multiaddr or a run owner's key is only known to its own package. So each such
value has a slot here, named with the module that fills it; that module declares the slot's
contents when it is imported, and the first use of a slot imports its owner. Validation therefore
works whatever was imported first, and config/ never imports torch, hivemind or cryptography at
import time.

    MODEL_PRESETS.declare(PRESETS)              # in train/presets.py
    MODEL_PRESETS.check("tiny")                 # in config/: ValueError naming the known presets
    MODEL_PRESETS["tiny"].max_seq_len

This module is a leaf as well: the standard library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Declared(Generic[T]):
    """One value declared by the module `owner` when it is imported; the first get() imports it."""

    def __init__(self, what: str, owner: str) -> None:
        self.what, self.owner = what, owner
        self._value: T | None = None
        self._declared = False

    def declare(self, value: T) -> None:
        self._value, self._declared = value, True

    def get(self) -> T:
        if not self._declared:
            importlib.import_module(self.owner)
            if not self._declared:
                raise RuntimeError(f"{self.owner} declares no {self.what}")
        return self._value  # type: ignore[return-value]  # declared, so a T


class Registry(Declared[Mapping[str, T]]):
    """The names a config value may take, each with what it stands for, in the owner's order."""

    def names(self) -> tuple[str, ...]:
        return tuple(self.get())

    def __getitem__(self, name: str) -> T:
        return self.get()[name]

    def check(self, name: str) -> str:
        """`name` when it is known; else ValueError naming the known ones (one line, for the user)."""
        if name not in self.get():
            raise ValueError(f"unknown {self.what} '{name}' (known: {', '.join(self.names())})")
        return name


class ModelShape(Protocol):
    """What the config reads of a model (train/presets.py's GPTSpec, train/hf.py's HFSpec)."""

    @property
    def n_layer(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    def fingerprint_fields(self) -> dict[str, Any]: ...
    def layout_refusal(self, parallel: str) -> str | None: ...


class CodecTraits(Protocol):
    """What the config reads of a codec (codec/codecs.py's CodecSpec, one per codec)."""

    @property
    def feedback(self) -> bool: ...  # drops values and keeps an error-feedback residual
    @property
    def params(self) -> Mapping[str, Any]: ...  # the config keys a peer needs to decode its payloads: defaults
    @property
    def blocks(self) -> str | None: ...  # the config key of the block size a butterfly part is cut on
    @property
    def knobs(self) -> tuple[str, ...]: ...  # the config keys that tune it (--help names it beside them)


MODEL_PRESETS: Registry[ModelShape] = Registry("model preset", "diloco_node.train.presets")
# what --model names (a preset, a Hugging Face directory, config.json or hub id): ValueError, one line, if nothing
MODELS: Declared[Callable[[str], ModelShape]] = Declared("model resolver", "diloco_node.train.presets")
CODECS: Registry[CodecTraits] = Registry("codec", "diloco_node.codec")
# the codec parameters' defaults (CodecConfig's), keyed by config key
CODEC_DEFAULTS: Declared[Mapping[str, Any]] = Declared("codec defaults", "diloco_node.codec")
# a NodeConfig's codec parameters checked by building its codec: CodecError, phrased for the user
CODEC_CHECK: Declared[Callable[[Any], object]] = Declared("codec check", "diloco_node.codec")
# the vocabulary size of a --tokenizer value (None: bytes, 256); TokenizerError (a ValueError) when unusable
TOKENIZER_VOCAB: Declared[Callable[[str | None], int]] = Declared("tokenizer vocabulary", "diloco_node.train.tokenizer")
# what a node's data contributes to the run's fingerprint: {"tokenizer": digest, "eval_data": digest} of a
# NodeConfig's --tokenizer and the held-out split of its --data (DataError, a ValueError, when unusable)
DATA_IDENTITY: Declared[Callable[[Any], Mapping[str, str]]] = Declared("data identity", "diloco_node.train.data")
# ValueError with a one-line reason when a string is not a well-formed multiaddr
MULTIADDR_CHECK: Declared[Callable[[str], object]] = Declared("multiaddr check", "diloco_node.swarm.addresses")
# AdmissionError (a ValueError) when a string is not a run owner's public key
PUBLIC_KEY_CHECK: Declared[Callable[[str], object]] = Declared("public key check", "diloco_node.trust.admission")
