"""What `--model` names: the built-in GPT presets' shapes, and the resolver config/ checks against.

Torch-free (train/model.py builds the modules): the CLI lists these names in --help and checks
--model while parsing, neither of which may pay torch's import (tests/unit/test_cli_imports.py).
A Hugging Face model (train/hf.py) is resolved through a function-level import, on first use.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diloco_node import registry

if TYPE_CHECKING:
    from diloco_node.train.hf import HFSpec

# the Llama-shaped presets shipped in configs/ (train/hf.py reads them)
HF_PRESETS = ("llama-2m", "llama-20m", "llama-150m", "llama-1b")


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    max_seq_len: int
    vocab_size: int = 256
    dropout: float = 0.0


PRESETS: dict[str, GPTConfig] = {
    # Sized so a 16x128 step stays well under 0.1 s on 2 CPU cores: the default must show a
    # falling loss on a laptop within a minute.
    "tiny": GPTConfig(n_layer=2, n_head=4, d_model=128, max_seq_len=256),
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384, max_seq_len=512),
    "gpt-125m": GPTConfig(n_layer=12, n_head=12, d_model=768, max_seq_len=1024),
    # GPT-2-medium-shaped (303M parameters with the byte vocabulary): for two consumer GPUs, sharded
    # (--parallel fsdp) or split (--parallel pipeline), see configs/gpt-350m-*.toml
    "gpt-350m": GPTConfig(n_layer=24, n_head=16, d_model=1024, max_seq_len=1024),
}


@dataclass(frozen=True)
class GPTSpec:
    """A built-in preset as a run knows it (config/ reads the shape through registry.MODELS)."""

    name: str
    config: GPTConfig

    @property
    def n_layer(self) -> int:
        return self.config.n_layer

    @property
    def d_model(self) -> int:
        return self.config.d_model

    @property
    def n_head(self) -> int:
        return self.config.n_head

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def fingerprint_fields(self) -> dict[str, Any]:
        # the same fields as before Hugging Face models existed: checkpoints of those runs still resume
        cfg = self.config
        return {"model": self.name, "n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head,
                "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len}

    def layout_refusal(self, parallel: str) -> str | None:
        return None


def resolve_model(name: str) -> GPTSpec | HFSpec:
    """What `--model NAME` names; ValueError (one line) when nothing."""
    if name in PRESETS:
        return GPTSpec(name, PRESETS[name])
    from diloco_node.train.hf import resolve_hf  # torch (and transformers): only for a Hugging Face model

    spec = resolve_hf(name)
    if spec is None:
        raise ValueError(f"unknown model preset '{name}' (known: {', '.join(preset_names())}; or a Hugging Face "
                         "model directory, a config.json or a hub id)")
    return spec


def preset_names() -> tuple[str, ...]:
    return (*PRESETS, *HF_PRESETS)


class _Presets(Mapping[str, Any]):
    """Every preset by name, each resolved on first look (a Llama-shaped one reads its config.json)."""

    def __getitem__(self, name: str) -> GPTSpec | HFSpec:
        if name not in preset_names():
            raise KeyError(name)
        return resolve_model(name)

    def __iter__(self) -> Iterator[str]:
        return iter(preset_names())

    def __len__(self) -> int:
        return len(preset_names())


registry.MODEL_PRESETS.declare(_Presets())  # the names --help lists
registry.MODELS.declare(resolve_model)  # what config/ checks --model against
