"""`diloco-node export`: a run's φ as a Hugging Face model directory.

The checkpoint names its model (`export_info` in daemon/checkpoint.py, saved with every checkpoint):
a Hugging Face model by its full config.json, a built-in GPT preset by name, which maps onto transformers' GPT-2 (the
same pre-LayerNorm blocks, exact GELU, learned positions, tied head; GPT-2's Conv1D stores each
linear weight transposed). φ is the canonical layout, i.e. the model's own `named_parameters`, so
a Hugging Face model is written by its own `save_pretrained` (config.json, model.safetensors).
The run's tokenizer.json goes beside it with a tokenizer_config.json, so AutoTokenizer loads it.
The directory is written beside OUT and renamed into place: a failed export leaves nothing.
torch and transformers are imported once the request itself is known to be good (bad input is fast).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco_node.errors import NodeError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from diloco_node.telemetry.progress import Meter
    from diloco_node.train.model import GPTConfig

CHECKPOINT_NAME = "node.json"  # checkpoint.CHECKPOINT_NAME (not imported: it would load torch first)
LEGACY_NAME = "node.pt"  # checkpoint.LEGACY_NAME: a checkpoint from before safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class ExportError(NodeError, ValueError):
    """A checkpoint that cannot be exported, or an output directory in the way; one line."""


def gpt2_config(cfg: GPTConfig) -> PretrainedConfig:
    """transformers' GPT-2 config of the same shape: exact GELU (ours), no dropout, tied head."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                      n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu", resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0)


def gpt2_state(names: list[str], phi: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our GPT's canonical tensors under GPT-2's names (Conv1D weights are [in, out]: transposed)."""
    renamed = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
               "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
    parts = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
             "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    state = {}
    for name, value in zip(names, phi, strict=True):
        if name in renamed:
            state[renamed[name]] = value
            continue
        _, index, rest = name.split(".", 2)  # blocks.<i>.<module>.<weight|bias>
        module, kind = rest.rsplit(".", 1)
        linear = module != "ln1" and module != "ln2"
        state[f"transformer.h.{index}.{parts[module]}.{kind}"] = value.t() if linear and kind == "weight" else value
    return state


def _model_with(info: dict[str, Any], phi: list[torch.Tensor]) -> Any:
    """The Hugging Face model holding φ."""
    import torch
    from transformers import AutoModelForCausalLM

    from diloco_node.train.hf import HFSpec, build_hf
    from diloco_node.train.model import GPT
    from diloco_node.train.presets import PRESETS

    if info["config"]:
        spec = HFSpec(name=info["model"], config_json=info["config"], directory=None, hub=False,
                      n_layer=0, d_model=0, n_head=0, vocab_size=0, max_seq_len=0, model_type="")
        model = build_hf(spec, seed=0)
        params = list(model.named_parameters())
        if [tuple(p.shape) for _, p in params] != [tuple(t.shape) for t in phi]:
            raise ExportError(f"the checkpoint's parameters do not fit model '{info['model']}'s config")
        with torch.no_grad():
            for (_, param), value in zip(params, phi, strict=True):
                param.copy_(value)
        return model
    preset = info["model"]
    if preset not in PRESETS:
        raise ExportError(f"the checkpoint names model '{preset}', which is no built-in preset of this version")
    with torch.device("meta"):
        names = [name for name, _ in GPT(PRESETS[preset]).named_parameters()]
    if len(names) != len(phi):
        raise ExportError(f"the checkpoint's parameters do not fit model preset '{preset}'")
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(gpt2_config(PRESETS[preset]), attn_implementation="sdpa",
                                                 dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gpt2_state(names, phi), strict=False)
    missing = [name for name in missing if name != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise ExportError(f"model preset '{preset}' does not map onto GPT-2: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    model.tie_weights()
    return model


def _write_tokenizer(source: str, out: Path) -> None:
    path = Path(source)
    if not path.is_file():
        raise ExportError(f"the run's tokenizer '{source}' is gone; export needs it to write the tokenizer files")
    shutil.copyfile(path, out / "tokenizer.json")
    for name in TOKENIZER_FILES[1:]:
        if (path.parent / name).is_file():
            shutil.copyfile(path.parent / name, out / name)
    if not (out / "tokenizer_config.json").exists():
        from diloco_node.train.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(str(path))
        eot = tokenizer.backend.id_to_token(tokenizer.eot_id)  # type: ignore[attr-defined]  # an HFTokenizer
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": eot, "unk_token": None,
             "clean_up_tokenization_spaces": False}, indent=2) + "\n")


def _built(path: Path, info: dict[str, Any], phi: list[torch.Tensor]) -> Any:
    """`_model_with`, where a config.json the checkpoint holds that transformers cannot build (a
    damaged manifest) ends in one line too."""
    try:
        return _model_with(info, phi)
    except ExportError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"checkpoint '{path}' names a model this version cannot build (damaged?): {first}") from None


def export(checkpoint_dir: str, run_id: str, out: str, progress: Meter | None = None) -> Path:
    """Write run `run_id`'s latest checkpointed φ under `checkpoint_dir` as a model directory `out`;
    `progress` is told the bytes read (the checkpoint's check) and written (the model's weights)."""
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"export directory '{out}' exists and is not empty")
    path = Path(checkpoint_dir) / run_id / CHECKPOINT_NAME
    if not path.is_file() and (path.parent / LEGACY_NAME).is_file():
        path = path.parent / LEGACY_NAME
    if not path.is_file():
        raise ExportError(f"no checkpoint of run '{run_id}' in '{checkpoint_dir}' (looked for {path})")
    from diloco_node.daemon import checkpoint

    assert (checkpoint.CHECKPOINT_NAME, checkpoint.LEGACY_NAME) == (CHECKPOINT_NAME, LEGACY_NAME)
    from diloco_node.daemon.checkpoint import CheckpointError, check_node_state, read_checkpoint

    try:
        state = read_checkpoint(path, progress)
        if "export" in state:  # the keys export reads, checked: a damaged one is one line, not a KeyError
            check_node_state(state, path, keys=("outer_params", "export"))
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    info = state.get("export")
    if not isinstance(info, dict):
        raise ExportError(f"checkpoint '{path}' predates export (it does not name its model): resume the run with "
                          "this version for one checkpoint, then export")
    if not (isinstance(info.get("model"), str) and isinstance(info.get("config"), str)):
        raise ExportError(f"checkpoint '{path}' is damaged: its 'export' does not name a model and its config")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the command prints its one line
    model = _built(path, info, list(state["outer_params"]))
    # what save_pretrained writes: each tensor once (tied embeddings share one)
    weights = sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
    if progress is not None and progress.total:
        progress.expect(progress.total + weights)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        if progress is not None:
            progress.add(weights)
        if info.get("tokenizer"):
            _write_tokenizer(info["tokenizer"], staging)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
