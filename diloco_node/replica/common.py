"""What every layout builds the same way: data, the inner optimizer's settings, precision, memory."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco_node.replica.base import ReplicaSettings
from diloco_node.train.data import NodeData, open_data
from diloco_node.train.inner import Forward, InnerConfig
from diloco_node.train.model import logits_of

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RankContext:
    """This process's place in the node: its local rank, the node's rank count, and the gloo group
    that carries control messages and CPU tensors (the default group itself on CPU; a separate one
    beside NCCL on GPUs). None when the node runs in one process."""

    rank: int = 0
    world: int = 1
    control: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1


def inner_config(settings: ReplicaSettings) -> InnerConfig:
    return InnerConfig(lr=settings.inner_lr, weight_decay=settings.weight_decay, warmup_steps=settings.warmup_steps,
                       total_steps=settings.total_steps, grad_clip=settings.grad_clip,
                       mixed_precision=mixed_precision(settings), micro_batch=settings.micro_batch_size)


def forward_of(settings: ReplicaSettings, model: nn.Module) -> Forward:
    """The model's logits function, through torch.compile when asked (the module itself keeps its
    own parameter names: the canonical layout never sees the compiled wrapper's)."""
    compiled = torch.compile(model) if settings.compile else None
    return logits_of(model, compiled)  # type: ignore[arg-type]


def mixed_precision(settings: ReplicaSettings) -> torch.dtype | None:
    return torch.bfloat16 if settings.precision == "bf16" else None


def rank_device(settings: ReplicaSettings, rank: int) -> torch.device:
    device = torch.device(settings.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # TF32 matmuls: ~8x the fp32 throughput on Ampere and later for a mantissa loss the inner
        # optimizer does not notice; outer state stays exact fp32 on the CPU.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device


def train_batches(settings: ReplicaSettings, dataset: NodeData, stream_seed: int, position: int,
                  batches: int) -> list[Batch]:
    """Batches `position` .. `position + batches − 1` of the stream, in order (one step's, when it
    accumulates several: --speed-spent batch)."""
    return [dataset.train_batch(settings.batch_size, stream_seed, position + i) for i in range(batches)]


def stacked(batches: list[Batch]) -> Batch:
    """One step's batches as one: their rows in order (a single batch as it is, uncopied)."""
    if len(batches) == 1:
        return batches[0]
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def load_dataset(settings: ReplicaSettings) -> NodeData:
    """The node's data: train batches made by a background prefetch, eval batches the same on every node."""
    return open_data(settings.data, settings.tokenizer, settings.seq_len, settings.text_column)


def eval_batches(settings: ReplicaSettings, dataset: NodeData, device: torch.device) -> list[Batch]:
    return [(x.to(device), y.to(device)) for x, y in dataset.eval_batches(settings.batch_size, settings.eval_batches)]


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA's peak allocated bytes on a GPU, else this process's peak resident set (Linux reports KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gather_to_first(ctx: RankContext, value: Any) -> list[Any] | None:
    """Every rank's `value`, in rank order, on rank 0 (None on the others)."""
    if ctx.world == 1:
        return [value]
    received: list[Any] | None = [None] * ctx.world if ctx.is_first else None
    dist.gather_object(value, received, dst=0, group=ctx.control)
    return received
