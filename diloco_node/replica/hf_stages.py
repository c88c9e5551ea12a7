"""A pipeline stage of a Hugging Face causal LM (docs/architecture.md §11): the whole model with
every part another stage holds replaced by `Skipped`, so that the stage runs transformers' own
forward — position ids, the causal mask and the rotary embeddings are computed on each stage as
the whole model computes them — and its parameters keep their canonical names
(`model.layers.3.mlp.up_proj.weight`), indices included.

The first stage takes token ids; a later one takes the previous stage's hidden states as
`inputs_embeds`, which the base model accepts in place of ids. A stage that is not the last
returns the base model's last hidden state (its final norm skipped), the last returns the logits.

Which architectures: those whose forward does nothing to `inputs_embeds` the first stage already
did (Granite, for one, multiplies them in its forward, so a later stage would scale them again).
train/hf.py's PIPELINE_TYPES lists the ones tests/unit/test_hf_stages.py proves (their stages
chained give the whole model's logits exactly); config refuses any other in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from diloco_node.train.hf import HFSpec


class Skipped(nn.Module):
    """Stands in for a part another stage holds, called where the whole model calls that part: a
    hidden state passes through unchanged (a decoder layer, the embedding dropout or the final
    norm); a lookup by index (GPT-2's position embedding, which the first stage already added)
    adds nothing."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        first = args[0] if args else next(iter(kwargs.values()))
        return first if first.is_floating_point() else first.new_zeros((), dtype=torch.float32)


@dataclass(frozen=True)
class Parts:
    """Where a causal LM keeps what the stages share out, as names of child modules."""

    base: str  # the base model, a child of the LM: embeddings, decoder layers, final norm
    layers: str  # the decoder layers, a ModuleList child of the base model
    inputs: tuple[str, ...]  # the base's children before the layers that the first stage runs (embeddings, dropout)
    outputs: tuple[str, ...]  # the base's children after the layers holding parameters (the final norm)
    head: str  # the LM's child that maps hidden states to logits


def parts(model: PreTrainedModel) -> Parts:
    """The model's parts; ValueError (one line) when its structure is not a base model holding one
    list of `num_hidden_layers` decoder layers, and an output head beside it."""
    kind = type(model).__name__
    children = dict(model.named_children())
    base = getattr(model, "base_model_prefix", "")
    head = model.get_output_embeddings()
    heads = [name for name, module in children.items() if module is head]
    if base not in children or len(heads) != 1 or set(children) != {base, heads[0]}:
        raise ValueError(f"{kind} is not a base model and an output head: the pipeline cannot split it")
    inner = list(children[base].named_children())
    n_layer = model.config.num_hidden_layers
    found = [i for i, (_, module) in enumerate(inner) if isinstance(module, nn.ModuleList) and len(module) == n_layer]
    if len(found) != 1:
        raise ValueError(f"{kind} has no single list of its {n_layer} decoder layers: the pipeline cannot split it")
    at = found[0]
    inputs = tuple(name for name, module in inner[:at] if _holds_parameters(module) or isinstance(module, nn.Dropout))
    outputs = tuple(name for name, module in inner[at + 1:] if _holds_parameters(module))
    return Parts(base, inner[at][0], inputs, outputs, heads[0])


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


class HFStage(nn.Module):
    """Decoder layers `layers` of `model` (built on the meta device), with the embeddings on the
    first stage and the final norm and head on the last. The model's own forward runs each stage.

    A tied head (`tie_word_embeddings`) is the embedding's weight under another name: the last
    stage keeps it as its own copy (`head_copy`), which the pipeline keeps equal to the first
    stage's embedding (replica/pipeline.py), and φ lists the weight once, as the embedding.
    """

    def __init__(self, model: PreTrainedModel, layers: range, first: bool, last: bool):
        super().__init__()
        found = parts(model)
        self.first, self.last = first, last
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        by_id = {id(param): name for name, param in model.named_parameters()}  # the tie once, as the embedding
        self.tied_name = by_id[id(model.get_input_embeddings().weight)] if tied else None
        base = getattr(model, found.base)
        decoder = getattr(base, found.layers)
        for index in range(len(decoder)):
            if index not in layers:
                decoder[index] = Skipped()  # in place: the other layers keep their indices, and names
        for name in () if first else found.inputs:
            setattr(base, name, Skipped())
        for name in () if last else found.outputs:
            setattr(base, name, Skipped())
        if not last:
            setattr(model, found.head, Skipped())
        self.head_name = f"{found.head}.weight"
        self.lm = model

    @property
    def canonical(self) -> dict[str, nn.Parameter]:
        """Canonical name → this stage's parameter (the last stage's copy of a tied head is not
        listed). Built on each use: `to_empty` replaces the parameter objects."""
        named = {name.removeprefix("lm."): param for name, param in self.named_parameters()}
        if self.tied_name is not None:
            named.pop(self.head_name, None)
        return named

    @property
    def head_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the tied embedding (None untied, or on any other stage)."""
        if self.tied_name is None or not self.last or self.first:
            return None
        return dict(self.named_parameters())[f"lm.{self.head_name}"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if self.last:
            return self.lm(**given, use_cache=False).logits  # type: ignore[no-any-return]
        return self.lm.base_model(**given, use_cache=False).last_hidden_state  # type: ignore[no-any-return]


def build_hf_stage(spec: HFSpec, layers: range, first: bool, last: bool,
                   device: torch.device) -> tuple[HFStage, list[str]]:
    """The stage on `device` with its parameters uninitialised (φ fills them) and its buffers (the
    rotary frequencies, computed, not in φ) set; and the model's canonical parameter names."""
    from diloco_node.train.hf import build_meta

    model, buffers = build_meta(spec)
    names = [name for name, _ in model.named_parameters()]
    stage = HFStage(model, layers, first, last)
    stage.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in stage.named_buffers():
            if (key := name.removeprefix("lm.")) in buffers:
                buffer.copy_(buffers[key])
    return stage.train(), names
