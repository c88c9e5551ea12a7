"""FSDP2 over the node's K local ranks: each rank holds ~1/K of θ, its gradients and AdamW state.

Every rank trains on its 1/K of the node's batch (FSDP averages the gradients), so a step sees
the same sequences as in one process. θ is built on the meta device and sharded before any memory
is allocated: no rank ever holds the whole model except one parameter at a time while loading φ
or gathering θ. φ and the outer momentum stay on rank 0, in CPU memory (see ranks.py for why).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from diloco_node.replica.base import ReplicaSettings
from diloco_node.replica.common import (
    RankContext,
    eval_batches,
    forward_of,
    gather_to_first,
    inner_config,
    load_dataset,
    mixed_precision,
    peak_memory_bytes,
    rank_device,
    stacked,
    train_batches,
)
from diloco_node.train.hf import HFSpec, build_meta, decoder_layers
from diloco_node.train.inner import InnerTrainer, evaluate, export_moments, import_moments
from diloco_node.train.model import GPT, resolve_model


class FsdpCompute:
    def __init__(self, settings: ReplicaSettings, ctx: RankContext):
        self.settings, self.ctx = settings, ctx
        self.device = rank_device(settings, ctx.rank)
        self.dataset = load_dataset(settings)
        self.eval = [self._my_rows(batch) for batch in eval_batches(settings, self.dataset, self.device)]
        spec = resolve_model(settings.model)
        buffers: dict[str, torch.Tensor] = {}
        model: nn.Module
        if isinstance(spec, HFSpec):
            model, buffers = build_meta(spec)  # rotary frequencies are buffers: computed here, kept below
            layers = decoder_layers(model)
            if not layers:  # config/ refuses it first (HFSpec.layout_refusal)
                raise ValueError(f"model '{settings.model}' has no decoder layers to shard")
        else:
            with torch.device("meta"):
                model = GPT(spec.config)
            layers = list(model.blocks)
        for layer in layers:
            fully_shard(layer)  # one unit per decoder layer: its parameters are gathered only while it runs
        fully_shard(model)  # the rest (embeddings, tied head, final norm) in the root unit
        model.to_empty(device=self.device)  # values come from φ (load) before the first step
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
        self.model = model
        self.named: dict[str, DTensor] = dict(model.named_parameters())  # type: ignore[arg-type]
        self.forward = forward_of(settings, model)
        self.trainer = InnerTrainer(model, inner_config(settings), self.forward)

    def _my_rows(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        return x.chunk(self.ctx.world)[self.ctx.rank], y.chunk(self.ctx.world)[self.ctx.rank]

    def _full_on_every_rank(self, full: torch.Tensor | None, like: DTensor) -> torch.Tensor:
        """Rank 0's full tensor broadcast to all ranks (over gloo, from CPU memory)."""
        value = full.float().contiguous() if full is not None else torch.empty(like.shape, dtype=torch.float32)
        dist.broadcast(value, src=0, group=self.ctx.control)
        return value

    def _shard(self, full: torch.Tensor, like: DTensor) -> DTensor:
        # every rank holds `full`: src_data_rank=None takes this rank's chunk without communicating
        return distribute_tensor(full.to(self.device, like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)

    @torch.no_grad()
    def load(self, phi: list[torch.Tensor] | None) -> None:
        for index, param in enumerate(self.named.values()):
            full = self._full_on_every_rank(phi[index] if phi is not None else None, param)
            param.to_local().copy_(self._shard(full, param).to_local())

    def train_step(self, stream_seed: int, position: int, batches: int = 1) -> float:
        # each batch split over the ranks as one would be, so a rank's rows are its share of every batch
        mine = [self._my_rows(batch) for batch in train_batches(self.settings, self.dataset, stream_seed, position,
                                                                batches)]
        x, y = stacked(mine)
        piece = self.settings.batch_size // self.ctx.world if batches > 1 else 0
        return self._node_mean(self.trainer.train_step(x.to(self.device), y.to(self.device), piece))

    def _node_mean(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self.ctx.control)
        return float(total) / self.ctx.world

    @torch.no_grad()
    def theta(self) -> list[torch.Tensor] | None:
        full = [param.full_tensor().to("cpu", torch.float32) for param in self.named.values()]
        return full if self.ctx.is_first else None

    def evaluate(self) -> float:
        return self._node_mean(evaluate(self.model, self.eval, mixed_precision(self.settings), self.forward))

    def inner_state(self) -> dict[str, Any] | None:
        moments, adam_step = export_moments(self.trainer.optimizer, self.named,
                                            lambda t: t.full_tensor().cpu())  # type: ignore[attr-defined]
        if not self.ctx.is_first:
            return None
        return {"step": self.trainer.step, "adam_step": adam_step, "moments": moments}

    def load_inner_state(self, state: dict[str, Any] | None) -> None:
        header = [None if state is None else (state["step"], state["adam_step"], sorted(state["moments"]))]
        dist.broadcast_object_list(header, src=0, group=self.ctx.control)
        step, adam_step, names = header[0]  # type: ignore[misc]
        moments = {}
        for name in names:
            param = self.named[name]
            given = state["moments"][name] if state is not None else (None, None)
            moments[name] = (self._full_on_every_rank(given[0], param), self._full_on_every_rank(given[1], param))
        self.trainer.optimizer.state.clear()
        import_moments(self.trainer.optimizer, self.named, moments, adam_step, self._shard)  # type: ignore[arg-type]
        self.trainer.step = step

    def advance_schedule(self, step: int) -> None:
        self.trainer.step = max(self.trainer.step, step)

    def set_progress(self, progress: float) -> None:
        self.trainer.progress = progress

    def prepare_data(self, stream_seed: int, position: int) -> None:
        self.dataset.prepare(self.settings.batch_size, stream_seed, position)

    def peak_memory(self) -> list[int] | None:
        return gather_to_first(self.ctx, peak_memory_bytes(self.device))  # type: ignore[return-value]
