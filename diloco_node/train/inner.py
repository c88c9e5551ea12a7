"""The inner loop: plain AdamW steps on the local replica θ between outer rounds.

Kept as close to a plain training loop as it can be (benchmarks/inner_loop.py measures the gap):
the forward under bf16 autocast where asked, fused AdamW on CUDA, gradients accumulated over
micro-batches when a batch does not fit at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from diloco_node.train.fit import smaller_micro_batch

logger = logging.getLogger(__name__)


@dataclass
class InnerConfig:
    lr: float = 4e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 0  # 0 = no cosine decay, constant lr after warmup
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    mixed_precision: torch.dtype | None = None  # bf16 mixed precision (forward under autocast); None: fp32
    micro_batch: int = 0  # sequences per forward/backward, gradients accumulated over the batch (0: all at once)
    # on CUDA's out-of-memory, redo the step with half the micro-batch (train/fit.py) rather than fail;
    # one process only: a rank of FSDP or a pipeline that backed off alone would stall the others
    back_off: bool = False


def lr_at(step: int, cfg: InnerConfig) -> float:
    """Learning rate for 0-based ``step``: linear warmup, then cosine to ``lr * min_lr_ratio``.

    Warmup reaches ``lr`` at ``step == warmup_steps - 1`` (step 0 gets ``lr / warmup_steps``, not
    zero, so the first step is not wasted). The cosine runs from ``warmup_steps`` to
    ``total_steps`` and stays at the floor afterwards.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.total_steps <= 0:
        return cfg.lr
    min_lr = cfg.lr * cfg.min_lr_ratio
    if step >= cfg.total_steps:
        return min_lr
    decay_steps = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / decay_steps
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def budget_lr_at(step: int, progress: float, cfg: InnerConfig) -> float:
    """Learning rate under --round-seconds (docs/architecture.md §13), where nodes take different
    numbers of steps per round: warmup by this node's own steps ``step`` (it exists for its own AdamW
    moments; the round loop moves ``step`` on at the group's fastest pace meanwhile, budget.warmup_pace),
    times a cosine by the run's ``progress`` in [0, 1] (the round over --max-outer-steps, the same on
    every node whatever its speed):

        lr · min(1, (step + 1) / warmup_steps) · (r + (1 − r)·½·(1 + cos(π·progress)))

    with r = ``min_lr_ratio``. ``total_steps`` is not used: a node's step count at the end of the run
    depends on its speed.
    """
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps > 0 else 1.0
    progress = min(1.0, max(0.0, progress))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay only matrices (linear and embedding weights, >= 2 dims); biases and LayerNorm
    gains are 1-d and stay undecayed, as in GPT-2/nanoGPT. The positional embedding is a matrix
    and is decayed: simpler, and it makes no measurable difference at this scale."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


Forward = Callable[[torch.Tensor], torch.Tensor]  # tokens [B, T] → logits [B, T, V]


def lm_loss(forward: Forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats, computed in fp32 whatever the forward's precision."""
    logits = forward(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def fused_on(model: nn.Module) -> bool:
    """Fused AdamW (one kernel for all parameters) where every parameter is a plain CUDA tensor;
    sharded (DTensor) and CPU parameters keep torch's default implementation."""
    params = list(model.parameters())
    return bool(params) and all(p.is_cuda and type(p.data) in (torch.Tensor, nn.Parameter) for p in params)


class InnerTrainer:
    """Owns the AdamW state of one replica. ``step`` counts inner steps across all rounds, so the
    schedule continues through outer rounds rather than re-warming each round. ``forward`` is the
    model's logits function (train/model.py's ``logits_of``, compiled or not); default: the module."""

    def __init__(self, model: nn.Module, cfg: InnerConfig, forward: Forward | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.forward: Forward = forward if forward is not None else model
        self.step = 0
        # the run's progress under --round-seconds (budget_lr_at); None: the step-indexed lr_at
        self.progress: float | None = None
        self.micro = cfg.micro_batch  # lowered by a back-off; 0: the whole batch at once
        self.optimizer = torch.optim.AdamW(
            _param_groups(model, cfg.weight_decay), lr=lr_at(0, cfg), betas=cfg.betas,
            **({"fused": True} if fused_on(model) else {}),
        )

    def lr(self) -> float:
        """The learning rate of the next step."""
        return lr_at(self.step, self.cfg) if self.progress is None else budget_lr_at(self.step, self.progress, self.cfg)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, piece: int = 0) -> float:
        """One AdamW step on the mean loss of the batch (x, y); `piece` > 0 bounds the sequences of one
        forward/backward, when (x, y) holds several batches of a step that accumulates them
        (--speed-spent batch): each fits as one batch did, whatever the micro-batch setting."""
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        while True:
            micro = self.micro if 0 < self.micro < len(x) else len(x)
            micro = min(micro, piece) if piece > 0 else micro
            try:
                loss = self._accumulate(x, y, micro)
            except torch.cuda.OutOfMemoryError:
                if not self.cfg.back_off:
                    raise
            else:
                break
            # the same batch again from zero gradients, in smaller pieces: the step's result is the one
            # it would have had (up to summation order); outside the except so its activations are freed
            self.optimizer.zero_grad(set_to_none=True)
            self.micro = smaller_micro_batch(len(x), micro)
            logger.warning("out of memory at micro-batch %d: now %d", micro, self.micro)
            if x.device.type == "cuda":
                torch.cuda.empty_cache()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(loss.detach())

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
        """Gradients of the batch's mean loss, summed over pieces of `micro` sequences; the mean loss."""
        pieces = list(zip(x.split(micro), y.split(micro), strict=True))
        total = torch.zeros((), device=x.device)
        # FSDP: reduce-scatter once, after the last piece (a model that is not sharded has no such switch)
        sync = getattr(self.model, "set_requires_gradient_sync", None) if len(pieces) > 1 else None
        for index, (xm, ym) in enumerate(pieces):
            if sync is not None:
                sync(index == len(pieces) - 1)
            with autocast(x.device, self.cfg.mixed_precision):
                loss = lm_loss(self.forward, xm, ym)
            # each piece's mean weighted by its share of the batch: the gradient of the batch's mean
            (loss * (len(xm) / len(x))).backward()
            total += loss.detach() * (len(xm) / len(x))
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def autocast(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             dtype: torch.dtype | None = None, forward: Forward | None = None) -> float:
    """Mean loss over ``batches`` (eval mode, so dropout is off); leaves the model in train mode."""
    if not batches:
        raise ValueError("evaluate() needs at least one batch")
    run: Forward = forward if forward is not None else model
    model.eval()
    try:
        with autocast(batches[0][0].device, dtype):
            total = sum(float(lm_loss(run, x, y)) for x, y in batches)
    finally:
        model.train()
    return total / len(batches)


Moments = dict[str, tuple[torch.Tensor, torch.Tensor]]


def export_moments(optimizer: torch.optim.Optimizer, named: Mapping[str, torch.Tensor],
                   to_full: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Moments, float]:
    """AdamW's (exp_avg, exp_avg_sq) per canonical name, made full by `to_full`, and its step count.

    `to_full` may be a collective (FSDP): every rank walks the same names in the same order.
    """
    moments: Moments = {}
    adam_step = 0.0
    for name, param in named.items():
        state = optimizer.state.get(param)
        if state:
            moments[name] = (to_full(state["exp_avg"]), to_full(state["exp_avg_sq"]))
            adam_step = float(state["step"])
    return moments, adam_step


def import_moments(optimizer: torch.optim.Optimizer, named: Mapping[str, torch.Tensor], moments: Moments,
                   adam_step: float, from_full: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Install canonical moments; `from_full(full, param)` makes a tensor laid out like `param`."""
    for name, param in named.items():
        if name in moments:
            exp_avg, exp_avg_sq = moments[name]
            optimizer.state[param] = {"step": torch.tensor(adam_step), "exp_avg": from_full(exp_avg, param),
                                      "exp_avg_sq": from_full(exp_avg_sq, param)}
