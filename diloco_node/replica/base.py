"""The Replica seam: what the round engine asks of a node's local compute.

Every method is called on local rank 0 and returns canonical-layout values there (full
parameters in canonical name order, fp32, on the CPU). A multi-rank replica runs the same method
on every rank (SPMD); arguments that only rank 0 holds (φ, a checkpoint's inner state) are passed
as None on the other ranks and moved by the implementation's own collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from diloco_node.errors import NodeError
from diloco_node.train.device import resolve_devices

if TYPE_CHECKING:
    from diloco_node.config import NodeConfig


class ReplicaError(NodeError, RuntimeError):
    """A local rank failed (died, or a collective between the node's ranks broke); one line."""

    exit_code = 1  # not the input's fault: the node resumes from its last checkpoint


@dataclass(frozen=True)
class ReplicaSettings:
    """What every rank needs to build its part of the replica; plain values, sent to ranks as JSON."""

    model: str
    seed: int
    data: str | None
    seq_len: int
    batch_size: int  # sequences per inner step for the whole node, split over its ranks
    eval_batches: int
    inner_lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    total_steps: int
    precision: str  # fp32 | bf16 (autocast); config's auto is resolved by settings_of
    parallel: str  # none | fsdp | pipeline
    devices: tuple[str, ...]  # one per local rank
    threads: int  # torch threads per rank (0: torch's default)
    init: str = "random"  # random | pretrained: how φ starts (daemon/compose.py); a replica's own θ always comes from φ
    compile: bool = False  # torch.compile the model's forward
    micro_batch_size: int = 0  # sequences per forward/backward per rank (0: the rank's whole batch)
    micro_batch_auto: bool = False  # find the largest micro-batch that fits (train/fit.py); parallel none only
    tokenizer: str | None = None  # a tokenizer.json or its directory (None: bytes)
    text_column: str = "text"  # the column of --data's datasets that holds the text


def settings_of(cfg: NodeConfig) -> ReplicaSettings:
    """The replica's part of a node's config, with each local rank's device resolved (DeviceError if missing)."""
    inputs, inner, local = cfg.inputs, cfg.inner, cfg.local
    devices = resolve_devices(local.device, local.devices, local.local_ranks)
    return ReplicaSettings(
        model=inputs.model, seed=inputs.seed, init=inputs.init, data=inputs.data, seq_len=inputs.seq_len,
        batch_size=inputs.batch_size, eval_batches=inputs.eval_batches, inner_lr=inner.inner_lr,
        warmup_steps=inner.warmup_steps, weight_decay=inner.weight_decay, grad_clip=inner.grad_clip,
        # under --round-seconds a node's step count depends on its speed: the decay follows the rounds;
        # with --speed-spent batch every node runs H steps a round, as with a fixed H (§13)
        total_steps=cfg.inner_steps_before(cfg.outer.max_outer_steps) if cfg.steps_agreed else 0,
        precision=resolve_precision(local.precision, devices),
        compile=local.compile == "on", parallel=local.parallel,
        micro_batch_size=local.micro_batch_size if isinstance(local.micro_batch_size, int) else 0,
        micro_batch_auto=local.micro_batch_size == "auto",
        devices=devices, threads=cfg.local.rank_threads(), tokenizer=inputs.tokenizer, text_column=inputs.text_column)


def resolve_precision(precision: str, devices: tuple[str, ...]) -> str:
    """auto: bf16 autocast when every local rank is a GPU that computes in bf16, else fp32."""
    if precision != "auto":
        return precision
    gpus = all(device.startswith("cuda") for device in devices)
    return "bf16" if gpus and torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


class Compute(Protocol):
    """One rank's part of a replica (SPMD). `Replica` is this, seen from rank 0."""

    def load(self, phi: list[torch.Tensor] | None) -> None:
        """θ ← φ (φ given on rank 0 only)."""

    def train_step(self, stream_seed: int, position: int, batches: int = 1) -> float:
        """One AdamW step on batch `position` of the stream, or on the `batches` batches from it with their
        gradients accumulated (--speed-spent batch, docs/architecture.md §13); the node's mean loss."""

    def theta(self) -> list[torch.Tensor] | None:
        """θ in canonical layout on rank 0 (None elsewhere)."""

    def evaluate(self) -> float:
        """Mean held-out loss of θ."""

    def inner_state(self) -> dict[str, Any] | None:
        """The AdamW state in canonical layout on rank 0: {"step", "adam_step", "moments": {name: (m, v)}}."""

    def load_inner_state(self, state: dict[str, Any] | None) -> None:
        """Install a canonical inner state (given on rank 0 only)."""

    def advance_schedule(self, step: int) -> None:
        """Move the learning-rate schedule forward to `step` if behind (a joiner follows the run's progress)."""

    def set_progress(self, progress: float) -> None:
        """Under --round-seconds: the run's progress in [0, 1] for the rounds that follow; the lr then
        warms up by this node's steps and decays by the progress (train/inner.py budget_lr_at)."""

    def prepare_data(self, stream_seed: int, position: int) -> None:
        """Start making the batches from `position` in the background, before the first train_step asks."""

    def peak_memory(self) -> list[int] | None:
        """Peak bytes per local rank (RSS on CPU, CUDA max allocated on GPU), on rank 0."""


class Replica(Compute, Protocol):
    def micro_batch(self) -> int:
        """Sequences per forward/backward on each rank now (a back-off after out-of-memory lowers it)."""

    def close(self) -> None:
        """Stop the node's other ranks; idempotent."""
