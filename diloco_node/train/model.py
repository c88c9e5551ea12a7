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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diloco_node.train import hf as hf_models
from diloco_node.train.hf import HFSpec, build_hf
from diloco_node.train.presets import GPTConfig, resolve_model

logger = logging.getLogger(__name__)


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
