"""Tests for the byte-level GPT: determinism, shapes, causality, initial loss, learning."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_node.train.model import GPT, build_model, count_parameters
from diloco_node.train.presets import PRESETS


def test_same_seed_gives_bit_identical_parameters() -> None:
    a, b = build_model("tiny", seed=7), build_model("tiny", seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_different_seed_gives_different_parameters() -> None:
    a, b = build_model("tiny", seed=1), build_model("tiny", seed=2)
    assert not torch.equal(a.tok_emb.weight, b.tok_emb.weight)


def test_build_does_not_touch_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model("tiny", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_preset_names_known_presets() -> None:
    with pytest.raises(ValueError, match="tiny"):
        build_model("huge", seed=0)


def test_presets_exist_and_embeddings_are_tied() -> None:
    assert {"tiny", "small", "gpt-125m"} <= set(PRESETS)
    model = build_model("tiny", seed=0)
    assert model.head.weight is model.tok_emb.weight
    assert isinstance(model, GPT) and model.config == PRESETS["tiny"]
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())


def test_forward_shape() -> None:
    model = build_model("tiny", seed=0)
    idx = torch.randint(0, 256, (3, 17))
    assert model(idx).shape == (3, 17, 256)


def test_causal_masking() -> None:
    model = build_model("tiny", seed=0).eval()
    idx = torch.randint(0, 256, (2, 32))
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        base, other = model(idx), model(changed)
    assert torch.allclose(base[:, :20], other[:, :20], atol=1e-6)
    assert not torch.allclose(base[:, 20:], other[:, 20:])


def test_initial_loss_is_near_uniform() -> None:
    model = build_model("tiny", seed=0)
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = model.loss(idx, targets).item()
    assert abs(loss - math.log(256)) < 0.3


def test_training_on_repeated_text_lowers_loss() -> None:
    model = build_model("tiny", seed=0)
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 4)[:65])
    x, y = text[:-1].unsqueeze(0).repeat(4, 1), text[1:].unsqueeze(0).repeat(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model.loss(x, y).item()
    for _ in range(30):
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert model.loss(x, y).item() < first - 1.0
