"""A Hugging Face model split into pipeline stages (replica/hf_stages.py), in one process: the stages
chained give the whole model's logits exactly for every architecture the pipeline accepts, hold
its parameters under their canonical names (a tie once, plus the last stage's copy), and config
refuses an architecture it cannot split in one line. The stages across processes:
tests/system/test_hf_layouts.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_node.config import ConfigError, build_config
from diloco_node.replica.hf_stages import build_hf_stage, parts
from diloco_node.replica.pipeline import stage_layers
from diloco_node.train.hf import PIPELINE_TYPES, build_hf, build_meta, resolve_hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the tiny vocabulary
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma": {**SHAPE, "head_dim": 8},
    "gpt2": {"n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": 256, "n_positions": 64},
    "llama": {**SHAPE, "tie_word_embeddings": True},
    "mistral": {**SHAPE, "sliding_window": None},
    "olmo2": SHAPE,
    "phi3": SHAPE,
    "qwen2": SHAPE,
    "qwen3": {**SHAPE, "head_dim": 8},
    "starcoder2": SHAPE,
    # multiplies the embeddings inside its forward: a later stage would scale its input again
    "granite": {**SHAPE, "embedding_multiplier": 12.0},
}


def model_path(root: Path, kind: str) -> str:
    path = root / f"{kind}.json"
    path.write_text(json.dumps({"model_type": kind, **CONFIGS[kind], **IDS}))
    return str(path)


def chained(path: str, stages: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """The whole model's logits, its stages' chained, and each stage (its values copied from the model's)."""
    spec = resolve_hf(path)
    assert spec is not None
    model = build_hf(spec, seed=1).eval()
    values = dict(model.named_parameters())
    built = []
    with torch.no_grad():
        hidden = x
        for rank, layers in enumerate(stage_layers(spec.n_layer, stages)):
            stage, names = build_hf_stage(spec, layers, rank == 0, rank == stages - 1, torch.device("cpu"))
            assert names == list(values)  # the canonical layout: the model's own order, a tie once
            for name, param in stage.canonical.items():
                param.copy_(values[name])
            if stage.head_copy is not None:
                stage.head_copy.copy_(values[stage.tied_name])
            hidden = stage.eval()(hidden)
            built.append(stage)
        return model(input_ids=x, use_cache=False).logits, hidden, built


@pytest.mark.parametrize("kind", PIPELINE_TYPES)
def test_stages_chained_give_the_whole_models_logits(tmp_path: Path, kind: str) -> None:
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    whole, staged, stages = chained(model_path(tmp_path, kind), 3, x)  # first, middle and last stage
    assert torch.equal(staged, whole)
    names = [name for stage in stages for name in stage.canonical]
    assert sorted(names) == sorted(name for name, _ in build_meta(resolve_hf(model_path(tmp_path, kind)))[0]
                                   .named_parameters())  # each parameter on exactly one stage
    assert all(".layers.1." in name or ".h.1." in name for name in stages[1].canonical)  # keeps its index
    tied = stages[0].tied_name is not None
    assert [stage.head_copy is not None for stage in stages] == [False, False, tied]


def test_an_architecture_the_pipeline_cannot_split_is_refused_in_one_line(tmp_path: Path) -> None:
    path = model_path(tmp_path, "granite")
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    whole, staged, _ = chained(path, 2, x)
    assert not torch.allclose(staged, whole)  # why granite is not in PIPELINE_TYPES
    with pytest.raises(ConfigError) as error:
        build_config({"model": path, "parallel": "pipeline", "local_ranks": 2, "seq_len": 16})
    message = str(error.value)
    assert f"model '{path}' (granite) is not one of them: use parallel fsdp or none" in message
    assert "gpt2, llama, mistral" in message and "\n" not in message
    accepted = build_config({"model": model_path(tmp_path, "qwen2"), "parallel": "pipeline", "local_ranks": 2,
                             "seq_len": 16})
    assert accepted.local.parallel == "pipeline"


def test_a_model_without_one_list_of_its_layers_has_no_parts(tmp_path: Path) -> None:
    spec = resolve_hf(model_path(tmp_path, "llama"))
    assert spec is not None
    model, _ = build_meta(spec)
    assert parts(model).layers == "layers" and parts(model).outputs == ("norm",)
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:2])  # 2 of its 3 layers
    with pytest.raises(ValueError, match="LlamaForCausalLM has no single list of its 3 decoder layers"):
        parts(model)
