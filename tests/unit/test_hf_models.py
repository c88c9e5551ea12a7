"""Hugging Face models as --model (train/hf.py): tiny Llama, Qwen2, Mistral and GPT-2 configs made
here, offline; init determinism; the run fingerprint; the layouts' refusals; export round trips."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_node.commands.export import ExportError, export
from diloco_node.config import ConfigError, build_config
from diloco_node.daemon.checkpoint import CheckpointStore, export_info
from diloco_node.replica import ReplicaSettings
from diloco_node.replica.layout import digest
from diloco_node.replica.single import SingleReplica
from diloco_node.train.inner import InnerConfig, InnerTrainer
from diloco_node.train.model import build_model, logits_of, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the network, whatever a test names

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **SHAPE, "tie_word_embeddings": True},
    "qwen2": {"model_type": "qwen2", **SHAPE},
    "mistral": {"model_type": "mistral", **SHAPE, "sliding_window": None},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64},
}


def model_dir(root: Path, kind: str, **changes: Any) -> str:
    directory = root / f"{kind}-{len(list(root.iterdir()))}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**CONFIGS[kind], **changes}))
    return str(directory)


def config(**values: Any) -> Any:
    return build_config({"seq_len": 16, **values})


def settings(model: str, **changes: Any) -> ReplicaSettings:
    values: dict[str, Any] = dict(model=model, seed=0, data=None, seq_len=16, batch_size=4, eval_batches=2,
                                  inner_lr=3e-3, warmup_steps=1, weight_decay=0.1, grad_clip=1.0, total_steps=0,
                                  precision="fp32", parallel="none", devices=("cpu",), threads=0)
    return ReplicaSettings(**{**values, **changes})


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_each_architecture_builds_trains_and_fits_the_config(tmp_path: Path, kind: str) -> None:
    path = model_dir(tmp_path, kind)
    cfg = config(**{"model": path, "parallel": "fsdp", "local_ranks": 2, "batch_size": 4})
    assert config(**{"model": path, "parallel": "pipeline", "local_ranks": 2}).local.parallel == "pipeline"
    assert cfg.fingerprint_fields()["model"] == f"hf:{kind}"
    model = build_model(path, seed=0)
    assert model.config._attn_implementation == "sdpa"
    trainer = InnerTrainer(model, InnerConfig(lr=3e-3, warmup_steps=1), logits_of(model))
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = [trainer.train_step(x, x) for _ in range(4)]  # learn the identity: the loss must fall
    assert losses[-1] < losses[0]


def test_random_init_is_a_function_of_the_seed_alone(tmp_path: Path) -> None:
    path = model_dir(tmp_path, "llama")
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = digest(list(build_model(path, seed=5).parameters()))
    assert torch.rand(1) == before  # the caller's random stream is untouched
    assert digest(list(build_model(path, seed=5).parameters())) == first
    assert digest(list(build_model(path, seed=6).parameters())) != first
    # in another process, with another thread count: tests/system/test_hf_layouts.py


def test_the_fingerprint_covers_the_architecture_not_the_file(tmp_path: Path) -> None:
    a = config(**{"model": model_dir(tmp_path, "llama")})
    # defaults written out, storage and provenance keys: the same model
    same = config(**{"model": model_dir(tmp_path, "llama", rms_norm_eps=1e-6, torch_dtype="bfloat16",
                                            architectures=["LlamaForCausalLM"], _name_or_path="x")})
    wider = config(**{"model": model_dir(tmp_path, "llama", hidden_size=64)})
    assert a.fingerprint() == same.fingerprint()
    assert a.fingerprint() != wider.fingerprint()
    from diloco_node.swarm.records import config_difference

    assert config_difference(a.fingerprint_fields(), wider.fingerprint_fields()) == \
        "--model hf:llama: head_dim=16 (ours: 8), hidden_size=64 (ours: 32)"
    gpt = config(model="tiny").fingerprint_fields()
    assert {key: gpt[key] for key in ("model", "n_layer", "d_model", "n_head", "vocab_size", "max_seq_len")} == \
        {"model": "tiny", "n_layer": 2, "d_model": 128, "n_head": 4, "vocab_size": 256, "max_seq_len": 256}


def test_presets_resolve_by_name() -> None:
    spec = resolve_model("llama-2m")
    assert (spec.model_type, spec.vocab_size, spec.n_layer) == ("llama", 4096, 6)  # type: ignore[union-attr]
    assert build_config({"model": "llama-20m"}).inputs.model == "llama-20m"


@pytest.mark.parametrize(("values", "message"), [
    ({"init": "pretrained"}, "init pretrained needs a Hugging Face model directory with *.safetensors weights"),
    ({"micro_batch_size": 3}, "micro_batch_size 3 does not divide the 16 sequences per local rank"),
    ({"seq_len": 65}, "seq_len 65 exceeds model 'M' limit of 64"),
])
def test_what_a_model_cannot_do_is_refused_in_one_line(tmp_path: Path, values: dict[str, Any], message: str) -> None:
    path = model_dir(tmp_path, "llama")
    with pytest.raises(ConfigError) as error:
        config(**{"model": path, **values})
    assert message.replace("'M'", f"'{path}'") in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("given", "message"), [
    ("DIR", "has no config.json"),
    ("org/some-model", "the hub cannot give it (offline): download it where the hub is "
                       "reachable and pass its local directory"),
    ("no/such/dir/", "model path 'no/such/dir/' does not exist"),
])
def test_models_that_cannot_be_found_are_named(tmp_path: Path, given: str, message: str) -> None:
    with pytest.raises(ConfigError, match="invalid value for 'model'") as error:
        build_config({"model": str(tmp_path) if given == "DIR" else given})
    assert message in str(error.value)


def test_pretrained_loads_the_directorys_safetensors(tmp_path: Path) -> None:
    path = model_dir(tmp_path, "qwen2")
    build_model(path, seed=3).save_pretrained(path)
    assert config(model=path, init="pretrained").fingerprint_fields()["init"] == "pretrained"
    loaded = build_model(path, seed=0, init="pretrained")
    assert digest(list(loaded.parameters())) == digest(list(build_model(path, seed=3).parameters()))


def _trained_checkpoint(tmp_path: Path, model: str, **cfg: Any) -> tuple[SingleReplica, Path]:
    """A replica after a few steps, and a checkpoint directory holding its θ as φ (as daemon/node.py saves it)."""
    replica = SingleReplica(settings(model))
    replica.load([p.detach().clone() for p in build_model(model, 0).parameters()])
    for position in range(3):
        replica.train_step(1, position)
    store = CheckpointStore(tmp_path / "ckpt" / "run")
    store.save({"fingerprint": "x", "round": 1, "outer_params": replica.theta(), "momentum": None,
                "export": export_info(config(model=model, **cfg))})
    store.close()
    return replica, tmp_path / "ckpt"


@pytest.mark.parametrize("kind", ["llama", "tiny"])
def test_export_round_trips_through_transformers(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    model = model_dir(tmp_path, "llama") if kind == "llama" else "tiny"
    replica, checkpoints = _trained_checkpoint(tmp_path, model)
    out = export(str(checkpoints), "run", str(tmp_path / "out"))
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    total = 0.0
    with torch.no_grad():
        for x, y in replica.eval:
            ours = replica.forward(x)
            theirs = loaded(input_ids=x).logits
            assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), float((theirs - ours).abs().max())
            # transformers' own loss: labels are the window itself, shifted inside
            window = torch.cat([x, y[:, -1:]], dim=1)
            total += float(loaded(input_ids=window, labels=window).loss)
    assert total / len(replica.eval) == pytest.approx(replica.evaluate(), abs=1e-5)


def test_export_writes_the_runs_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from diloco_node.train.tokenizer import train_tokenizer

    text = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen liquor jugs"] * 20
    tokenizer = train_tokenizer(text, 300, tmp_path / "tok")
    _, checkpoints = _trained_checkpoint(tmp_path, model_dir(tmp_path, "llama", vocab_size=300),
                                         tokenizer=str(tmp_path / "tok"))
    out = export(str(checkpoints), "run", str(tmp_path / "out"))
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded("the lazy dog")["input_ids"] == tokenizer.encode_batch(["the lazy dog"])[0]
    assert loaded.eos_token == "<|endoftext|>"


def test_export_refuses_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no checkpoint of run 'run'"):
        export(str(tmp_path), "run", str(tmp_path / "out"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export(str(tmp_path), "run", str(tmp_path / "busy"))
    assert not (tmp_path / "out").exists() and (tmp_path / "busy" / "file").read_text() == "mine"
