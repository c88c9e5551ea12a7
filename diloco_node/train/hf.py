"""Hugging Face models: any `AutoModelForCausalLM` architecture, named by a local directory, a
config.json, a hub id or one of the Llama-shaped presets shipped in configs/.

What a run needs of a model is a `ModelSpec`: its shape (what config/ checks seq_len and the
layouts against), its config as canonical JSON (what the run's fingerprint and the export carry)
and, for `--init pretrained`, the directory holding its safetensors. Building one is then a pure
function of the spec and the seed: the random initialisation is transformers' own (`_init_weights`,
what a user of from_config gets), drawn from a seeded generator inside `fork_rng`, so it is
bit-identical across processes and never shifts the caller's random stream. φ, the wire and
checkpoints use the model's own `named_parameters` order (docs/architecture.md §2, canonical
layout), which is also the name set a Hugging Face directory stores: export is a rename-free save.

transformers is imported on first use only: a node with a built-in GPT preset never loads it.
The design, with what each layout does with such a model: docs/architecture.md §11.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from diloco_node.errors import NodeError
from diloco_node.train.presets import HF_PRESETS

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Where the Llama-shaped presets live: configs/<name>.json of the repository (an editable install),
# else where an installed wheel puts them (pyproject.toml's data-files: <prefix>/share/diloco-node/configs)
PRESET_DIRS = (Path(__file__).resolve().parents[2] / "configs", Path(sys.prefix) / "share" / "diloco-node" / "configs")
# Keys of a config.json that change nothing the run computes: where it came from, how it is stored
# or served, generation defaults. Left out of the fingerprint so two copies of one model match.
NOT_ARCHITECTURE = frozenset({
    "_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "chunk_size_feed_forward", "task_specific_params",
})
# The architectures --parallel pipeline splits into stages (replica/hf_stages.py says why a list):
# each proven by tests/unit/test_hf_stages.py, whose chained stages give the whole model's logits.
PIPELINE_TYPES = ("gemma", "gpt2", "llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3", "starcoder2")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelError(NodeError, ValueError):
    """A model that cannot be used (missing config.json, unknown architecture, no weights); one line."""


@dataclass(frozen=True)
class HFSpec:
    """A Hugging Face model as a run knows it (config/ reads the shape through registry.MODELS)."""

    name: str  # as the user gave it
    config_json: str  # the full config (to_dict), sorted keys: what export writes and builds from
    directory: str | None  # where its weights and tokenizer files are (None: a bare config.json)
    hub: bool  # named by a hub id (its directory is the hub cache's)
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    max_seq_len: int
    model_type: str

    def config(self) -> PretrainedConfig:
        from transformers import AutoConfig

        values = json.loads(self.config_json)
        return AutoConfig.for_model(values.pop("model_type"), **values)  # type: ignore[no-any-return]

    def fingerprint_fields(self) -> dict[str, Any]:
        """The architecture, one key per config entry (so a refused peer is told which entry differs)."""
        return {"model": f"hf:{self.model_type}", **_architecture(self.config_json)}

    @property
    def has_weights(self) -> bool:
        """Whether `--init pretrained` has weights to load (a hub model's are fetched when it is built)."""
        return self.hub or bool(self.weights())

    def layout_refusal(self, parallel: str) -> str | None:
        if parallel == "fsdp" and not _layer_classes(self.model_type):
            return (f"parallel fsdp shards per decoder layer, and model '{self.name}' ({self.model_type}) names no "
                    "decoder layer class (_no_split_modules): use parallel none")
        if parallel == "pipeline" and self.model_type not in PIPELINE_TYPES:
            return (f"parallel pipeline splits the decoder layers of {', '.join(PIPELINE_TYPES)} models; model "
                    f"'{self.name}' ({self.model_type}) is not one of them: use parallel fsdp or none")
        return None

    def weights(self) -> list[Path]:
        """The safetensors files of the directory, [] when there are none."""
        if self.directory is None:
            return []
        return sorted(Path(self.directory).glob("*.safetensors"))


@functools.lru_cache(maxsize=32)
def _architecture(config_json: str) -> dict[str, Any]:
    """The config's entries that differ from its class's defaults, less NOT_ARCHITECTURE: two
    config.json files of one model (defaults written out or not) give the same fields."""
    from transformers import AutoConfig

    values = json.loads(config_json)
    diff = AutoConfig.for_model(values.pop("model_type"), **values).to_diff_dict()
    return {f"model.{key}": value for key, value in sorted(diff.items()) if key not in NOT_ARCHITECTURE}


@functools.lru_cache(maxsize=32)
def _layer_classes(model_type: str) -> tuple[str, ...]:
    """The decoder layer classes of an architecture (what transformers never splits across devices)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_class = AutoModelForCausalLM._model_mapping[CONFIG_MAPPING[model_type]]
    return tuple(getattr(model_class, "_no_split_modules", None) or ())


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_config(path: Path, name: str, directory: Path | None, hub: bool = False) -> HFSpec:
    """The spec of a config.json; ModelError (one line) when it is not a causal LM transformers knows."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelError(f"model config '{path}' cannot be read: {exc.strerror}") from None
    except ValueError as exc:
        raise ModelError(f"model config '{path}' is not JSON: {_one_line(exc)}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"model config '{path}' is not a JSON object")
    model_type = raw.get("model_type")
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(model_type, str) or not model_type:
        raise ModelError(f"model config '{path}' names no model_type (e.g. \"llama\")")
    if model_type not in CONFIG_MAPPING:
        raise ModelError(f"model config '{path}' has model_type '{model_type}', which transformers "
                         f"{transformers.__version__} does not know")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"model_type '{model_type}' in '{path}' has no causal language model in transformers "
                         "(AutoModelForCausalLM)")
    values = {key: value for key, value in raw.items() if key != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # transformers validates configs with many exception types
        raise ModelError(f"model config '{path}' is not a valid {model_type} config: {_one_line(exc)}") from None
    full = config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        full.pop(key, None)
    return HFSpec(
        name=name, config_json=json.dumps(full, sort_keys=True), directory=str(directory) if directory else None,
        hub=hub, n_layer=int(config.num_hidden_layers), d_model=int(config.hidden_size),
        n_head=int(config.num_attention_heads), vocab_size=int(config.vocab_size),
        max_seq_len=int(getattr(config, "max_position_embeddings", None) or 1 << 20), model_type=model_type)


def _from_hub(name: str) -> HFSpec:
    """A hub id: its config.json through the hub's cache; offline, one line naming the fix."""
    try:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(name, CONFIG_FILE))
    except Exception as exc:  # offline mode, no route, no such repository: all end the same way
        kind = type(exc).__name__
        why = "no such repository" if "RepositoryNotFound" in kind else \
            "offline" if any(word in kind for word in ("Offline", "LocalEntry", "Connect", "Timeout")) else kind
        raise ModelError(f"model '{name}' is not a preset or a local path, and the hub cannot give it ({why}): "
                         "download it where the hub is reachable and pass its local directory") from None
    return read_config(path, name, path.parent, hub=True)


@functools.lru_cache(maxsize=32)
def resolve_hf(name: str) -> HFSpec | None:
    """The spec `name` names (a shipped preset, a directory, a .json file or a hub id); None when it
    names none of these (the caller lists the presets)."""
    if name in HF_PRESETS:
        found = [directory / f"{name}.json" for directory in PRESET_DIRS if (directory / f"{name}.json").is_file()]
        return read_config(found[0] if found else PRESET_DIRS[0] / f"{name}.json", name, None)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise ModelError(f"model directory '{name}' has no {CONFIG_FILE} (a Hugging Face model directory "
                             "holds config.json and its *.safetensors)")
        return read_config(path / CONFIG_FILE, name, path)
    if path.is_file():
        if path.suffix != ".json":
            raise ModelError(f"model '{name}' is a file but not a config.json")
        return read_config(path, name, path.parent if path.name == CONFIG_FILE else None)
    if "/" in name and HUB_ID.fullmatch(name) and not name.startswith((".", "/", "~")):
        return _from_hub(name)
    if "/" in name or name.endswith(".json"):
        raise ModelError(f"model path '{name}' does not exist")
    return None


# --- building ------------------------------------------------------------------------------------

def build_hf(spec: HFSpec, seed: int, init: str = "random") -> PreTrainedModel:
    """fp32 on the CPU, SDPA attention; random init from `seed` alone, or the directory's safetensors."""
    from transformers import AutoModelForCausalLM

    if init == "pretrained":
        return load_pretrained(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(spec.config(), attn_implementation="sdpa", dtype=torch.float32)
    return model.train()  # type: ignore[no-any-return]


def load_pretrained(spec: HFSpec) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    directory = spec.directory
    if spec.hub:
        directory = _hub_weights(spec.name)
    if directory is None or not list(Path(directory).glob("*.safetensors")):
        raise ModelError(f"init pretrained needs the model's *.safetensors beside its config.json; "
                         f"'{spec.name}' has none")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a node logs lines, not progress bars
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, config=spec.config(), attn_implementation="sdpa",
                                                     dtype=torch.float32, use_safetensors=True)
    except Exception as exc:
        raise ModelError(f"the weights of model '{spec.name}' cannot be loaded: {_one_line(exc)}") from None
    return model.train()  # type: ignore[no-any-return]


def _hub_weights(name: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as exc:
        raise ModelError(f"the weights of model '{name}' cannot be fetched from the hub ({_one_line(exc)}): pass "
                         "a local directory") from None


def build_meta(spec: HFSpec) -> tuple[PreTrainedModel, dict[str, torch.Tensor]]:
    """The model with its parameters on the meta device (no memory, no init) and its buffers (rotary
    frequencies: computed, not learned, so φ does not carry them) as real CPU tensors, by name, to put
    back after `to_empty`."""
    from transformers import AutoModelForCausalLM

    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(spec.config(), attn_implementation="sdpa", dtype=torch.float32)
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
    model.tie_weights()
    return model, {name: buffer.clone() for name, buffer in model.named_buffers()}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers FSDP shards one by one: the modules transformers itself never splits."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in kinds]


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, use_cache=False).logits  # type: ignore[no-any-return]
