"""A pipeline over the node's K local ranks (torch.distributed.pipelining, GPipe schedule): rank r
holds stage r, a contiguous run of blocks (decoder layers); the first stage also holds the
embeddings, the last the final norm and the output head. A built-in GPT preset's stage is `Stage`
below, a Hugging Face model's is `hf_stages.HFStage`: both list their parameters under canonical names.

The GPT head's weight is tied to the token embedding (model.py), as is a Hugging Face model's with
`tie_word_embeddings`. Across two stages the tie becomes a copy on the last stage whose gradient is
summed with the first stage's before every step, so both copies take identical AdamW steps and stay
equal; the canonical layout lists the weight once, as the first stage's. Each step splits the
node's batch into K microbatches (or one per --micro-batch-size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from diloco_node.replica.base import ReplicaSettings
from diloco_node.replica.common import (
    RankContext,
    eval_batches,
    gather_to_first,
    inner_config,
    load_dataset,
    mixed_precision,
    peak_memory_bytes,
    rank_device,
)
from diloco_node.replica.hf_stages import HFStage, build_hf_stage
from diloco_node.train.hf import HFSpec
from diloco_node.train.inner import InnerTrainer, autocast, export_moments, import_moments
from diloco_node.train.model import GPT, Block, GPTConfig, resolve_model

COPY = "<the tie's copy>"  # the key of the last stage's head copy among its named parameters (load_inner_state)


def stage_layers(n_layer: int, stages: int) -> list[range]:
    """Contiguous, as even as possible: 5 layers over 2 stages → [0, 1, 2], [3, 4]."""
    bounds = [round(i * n_layer / stages) for i in range(stages + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(stages)]


class Stage(nn.Module):
    """Blocks `layers` of the GPT, with the embeddings on the first stage and the head on the last."""

    tied_name = "tok_emb.weight"  # the head's weight is this one (model.py)

    def __init__(self, cfg: GPTConfig, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in layers)
        if last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.layers = layers

    @property
    def canonical(self) -> dict[str, nn.Parameter]:
        """Canonical name → this stage's parameter (the last stage's head copy is not listed).

        Built on each use: `to_empty` replaces the parameter objects the stage was built with.
        """
        named = {}
        for name, param in self.named_parameters():
            if name.startswith("blocks."):
                index, rest = name.removeprefix("blocks.").split(".", 1)
                name = f"blocks.{self.layers[int(index)]}.{rest}"
            if name != "head.weight":
                named[name] = param
        return named

    @property
    def head_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the tied embedding (None on any other stage)."""
        return self.head.weight if self.last and not self.first else None  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_stage(model: str, ctx: RankContext, device: torch.device) -> tuple[Stage | HFStage, list[str]]:
    """This rank's stage on `device`, its parameters uninitialised (φ fills them, load), and the
    model's canonical parameter names."""
    spec = resolve_model(model)
    layers = stage_layers(spec.n_layer, ctx.world)[ctx.rank]
    if isinstance(spec, HFSpec):  # config/ refused what hf_stages cannot split (HFSpec.layout_refusal)
        return build_hf_stage(spec, layers, ctx.is_first, ctx.is_last, device)
    with torch.device("meta"):
        names = [name for name, _ in GPT(spec.config).named_parameters()]
        stage = Stage(spec.config, layers, ctx.is_first, ctx.is_last)
    stage.to_empty(device=device)
    return stage, names


class PipelineCompute:
    def __init__(self, settings: ReplicaSettings, ctx: RankContext):
        self.settings, self.ctx = settings, ctx
        self.device = rank_device(settings, ctx.rank)
        self.dataset = load_dataset(settings)
        self.eval = eval_batches(settings, self.dataset, self.device)
        stage, self.names = build_stage(settings.model, ctx, self.device)
        self.stage = stage
        self.trainer = InnerTrainer(stage, inner_config(settings))
        # K microbatches, or one per --micro-batch-size sequences (config: it divides batch_size / K, so n ≥ K)
        micro = settings.batch_size // settings.micro_batch_size if settings.micro_batch_size else ctx.world
        self.schedule = ScheduleGPipe(PipelineStage(stage, ctx.rank, ctx.world, self.device), n_microbatches=micro,
                                      loss_fn=_loss)
        # the first and last stage sum the tied weight's gradients (on GPUs over NCCL, the default group);
        # every rank knows whether the model ties, so all or none create the group
        self.tied_name = stage.tied_name
        self.tied_group = dist.new_group([0, ctx.world - 1]) if self.tied_name is not None else None
        self.tied = (None if self.tied_name is None else
                     stage.canonical[self.tied_name] if ctx.is_first else stage.head_copy)

    # --- moving values between rank 0 and the stages ------------------------------------------

    def _scatter(self, values: dict[str, torch.Tensor] | None, wanted: list[str]) -> dict[str, Any]:
        """Rank 0's {name: value} cut into what each stage asks for (`wanted`, gathered first)."""
        asked = gather_to_first(self.ctx, wanted)
        parts = ([{name: values[name] for name in names if name in values} for names in asked]
                 if values is not None and asked else None)
        received: list[Any] = [None]
        dist.scatter_object_list(received, parts, src=0, group=self.ctx.control)
        return received[0]

    def _wanted(self, names: list[str]) -> list[str]:
        """A stage's own names, and the last stage also the tied weight its copy takes its value from."""
        if self.stage.head_copy is None or self.tied_name is None or self.tied_name in names:
            return names
        return [*names, self.tied_name]

    def _merge(self, mine: dict[str, Any]) -> dict[str, Any] | None:
        parts = gather_to_first(self.ctx, mine)
        return {name: value for part in parts for name, value in part.items()} if parts else None

    # --- the Compute protocol -------------------------------------------------------------------

    @torch.no_grad()
    def load(self, phi: list[torch.Tensor] | None) -> None:
        values = dict(zip(self.names, phi, strict=True)) if phi is not None else None
        mine = self._scatter(values, self._wanted(list(self.stage.canonical)))
        for name, param in self.stage.canonical.items():
            param.copy_(mine[name])
        if (copy := self.stage.head_copy) is not None and self.tied_name is not None:
            copy.copy_(mine[self.tied_name])

    def train_step(self, stream_seed: int, position: int, batches: int = 1) -> float:
        if batches != 1:  # config/ refuses --speed-spent batch with a pipeline
            raise ValueError("a pipeline step trains one batch")
        x, y = self.dataset.train_batch(self.settings.batch_size, stream_seed, position)
        x, y = x.to(self.device), y.to(self.device)
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = self.trainer.lr()
        losses: list[torch.Tensor] = []
        with autocast(self.device, mixed_precision(self.settings)):
            self._run(self.schedule.step, x, y, losses)
        if self.tied is not None and self.tied.grad is not None:
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        self._clip_gradients()
        self.trainer.optimizer.step()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self.trainer.step += 1
        return self._from_last(losses)

    def _run(self, step: Any, x: torch.Tensor, y: torch.Tensor, losses: list[torch.Tensor]) -> None:
        if self.ctx.is_first:
            step(x)
        elif self.ctx.is_last:
            step(target=y, losses=losses)
        else:
            step()

    def _clip_gradients(self) -> None:
        """clip_grad_norm_ over the whole model: the norm sums every stage's squares (the tie once)."""
        grads = [p.grad for p in self.stage.canonical.values() if p.grad is not None]
        squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        total = squares.reshape(1).to(self.device)
        dist.all_reduce(total)
        norm = float(total.sqrt())
        scale = min(1.0, self.trainer.cfg.grad_clip / (norm + 1e-6))
        if scale < 1.0:
            for param in self.stage.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)

    def _from_last(self, losses: list[torch.Tensor]) -> float:
        value = torch.tensor([float(torch.stack(losses).detach().mean()) if losses else 0.0], dtype=torch.float64)
        dist.broadcast(value, src=self.ctx.world - 1, group=self.ctx.control)
        return float(value)

    def theta(self) -> list[torch.Tensor] | None:
        merged = self._merge({name: p.detach().to("cpu", torch.float32, copy=True)
                              for name, p in self.stage.canonical.items()})
        return [merged[name] for name in self.names] if merged is not None else None

    @torch.no_grad()
    def evaluate(self) -> float:
        self.stage.eval()
        try:
            total = 0.0
            for x, y in self.eval:
                losses: list[torch.Tensor] = []
                with autocast(self.device, mixed_precision(self.settings)):
                    self._run(self.schedule.eval, x, y, losses)
                total += self._from_last(losses)
        finally:
            self.stage.train()
        return total / len(self.eval)

    def inner_state(self) -> dict[str, Any] | None:
        moments, adam_step = export_moments(self.trainer.optimizer, self.stage.canonical,  # type: ignore[arg-type]
                                            lambda t: t.detach().cpu().clone())
        merged = self._merge(moments)
        return None if merged is None else {"step": self.trainer.step, "adam_step": adam_step, "moments": merged}

    def load_inner_state(self, state: dict[str, Any] | None) -> None:
        header = [None if state is None else (state["step"], state["adam_step"])]
        dist.broadcast_object_list(header, src=0, group=self.ctx.control)
        step, adam_step = header[0]  # type: ignore[misc]
        moments = state["moments"] if state is not None else None
        mine = self._scatter(moments, self._wanted(list(self.stage.canonical)))
        named: dict[str, torch.Tensor] = dict(self.stage.canonical)
        if (copy := self.stage.head_copy) is not None:
            named[COPY] = copy  # the tie's copy takes the same moments
            if self.tied_name in mine:
                mine[COPY] = mine[self.tied_name]
        self.trainer.optimizer.state.clear()
        import_moments(self.trainer.optimizer, named, mine, adam_step,
                       lambda full, param: full.to(param.device, param.dtype, copy=True))
        self.trainer.step = step

    def advance_schedule(self, step: int) -> None:
        self.trainer.step = max(self.trainer.step, step)

    def set_progress(self, progress: float) -> None:
        self.trainer.progress = progress

    def prepare_data(self, stream_seed: int, position: int) -> None:
        self.dataset.prepare(self.settings.batch_size, stream_seed, position)

    def peak_memory(self) -> list[int] | None:
        return gather_to_first(self.ctx, peak_memory_bytes(self.device))  # type: ignore[return-value]
