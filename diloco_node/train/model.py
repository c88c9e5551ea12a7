"""A small GPT-style decoder over bytes (vocab 256), and what a run's `--model` resolves to.

`--model` names a built-in GPT preset (below) or a Hugging Face model (train/hf.py: a Llama-shaped
preset from configs/, a directory, a config.json or a hub id); `resolve_model` turns the name into
a spec, `build_model` into a module, and both kinds train through `logits_of`.

Pre-LayerNorm blocks, causal self-attention through ``scaled_dot_product_attention`` (so CPU and
GPU pick their fastest kernel), a 4x GELU MLP, learned positional embeddings and tied input/output
embeddings. Initialisation is a pure function of the seed: every DiLoCo node must start from the
same outer parameters, so ``build_model(preset, seed)`` is bit-identical across processes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from diloco_node import registry
from diloco_node.train import hf as hf_models
from diloco_node.train.hf import HF_PRESETS, HFSpec, build_hf, resolve_hf

logger = logging.getLogger(__name__)


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
    """A built-in preset as a run knows it (config.py reads the shape through registry.MODELS)."""

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


ModelSpec = GPTSpec | HFSpec


def resolve_model(name: str) -> ModelSpec:
    """What `--model NAME` names; ValueError (one line) when nothing."""
    if name in PRESETS:
        return GPTSpec(name, PRESETS[name])
    spec = resolve_hf(name)
    if spec is None:
        raise ValueError(f"unknown model preset '{name}' (known: {', '.join(preset_names())}; or a Hugging Face "
                         "model directory, a config.json or a hub id)")
    return spec


def preset_names() -> tuple[str, ...]:
    return (*PRESETS, *HF_PRESETS)


class _Presets(Mapping[str, Any]):
    """Every preset by name, each resolved on first look (a Llama-shaped one reads its config.json)."""

    def __getitem__(self, name: str) -> ModelSpec:
        if name not in preset_names():
            raise KeyError(name)
        return resolve_model(name)

    def __iter__(self) -> Iterator[str]:
        return iter(preset_names())

    def __len__(self) -> int:
        return len(preset_names())


registry.MODEL_PRESETS.declare(_Presets())  # the names --help lists
registry.MODELS.declare(resolve_model)  # what config.py checks --model against


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head != 0:
            raise ValueError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.is_residual_proj = True  # type: ignore[assignment]  # scaled at init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, C/H): SDPA attends over the last two dims per head.
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.proj.is_residual_proj = True  # type: ignore[assignment]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Tied embeddings: saves vocab*d parameters, and every parameter crosses the wire each
        # outer round, so fewer parameters is less traffic.
        self.head.weight = self.tok_emb.weight

    def init_weights(self, generator: torch.Generator) -> None:
        """Normal(0, 0.02) everywhere; residual projections scaled by 1/sqrt(2*n_layer) (GPT-2)
        so the residual stream's variance does not grow with depth."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    std = resid_std if getattr(module, "is_residual_proj", False) else 0.02
                    if module is not self.head:  # tied: initialised through tok_emb
                        module.weight.normal_(0.0, std, generator=generator)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, nn.Embedding):
                    module.weight.normal_(0.0, 0.02, generator=generator)
                elif isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.config.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy in nats (ln 256 ≈ 5.545 at random init)."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_model(preset: str, seed: int, init: str = "random") -> nn.Module:
    """Build the model `preset` names with parameters that depend only on ``seed`` (not on global RNG
    state), or on its safetensors with init 'pretrained' (Hugging Face models)."""
    spec = resolve_model(preset)
    if isinstance(spec, HFSpec):
        return build_hf(spec, seed, init)
    # nn.Linear/nn.Embedding constructors run their own default init from the global RNG;
    # fork_rng restores it so building a model never shifts the caller's random stream. The
    # real init then draws only from a local generator, which makes it reproducible.
    with torch.random.fork_rng(devices=[]):
        model = GPT(spec.config)
    model.init_weights(torch.Generator().manual_seed(seed))
    logger.debug("built model preset=%s seed=%d params=%d", preset, seed, count_parameters(model))
    return model


def logits_of(model: nn.Module, compiled: nn.Module | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's forward pass as tokens [B, T] → logits [B, T, V], through `compiled` when given."""
    run = compiled if compiled is not None else model
    if isinstance(model, GPT):
        return run
    return lambda x: hf_models.logits(run, x)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (the tied embedding counts once, as ``parameters()`` deduplicates)."""
    return sum(p.numel() for p in model.parameters())
