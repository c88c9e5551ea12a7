"""The canonical layout (docs/architecture.md §2): full parameters in the model's own name order, tied weights
once (as `named_parameters` lists them), fp32 on the CPU.

φ, pseudo-gradients on the wire, the outer momentum, checkpoints and `model_digest` all use it, so
nodes that shard or split the model differently still exchange and compare the same vectors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like` (no copy)."""
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """Equal exactly when the tensors are bit-for-bit equal (up to hash collisions)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]
