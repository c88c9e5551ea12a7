"""One process, one device: θ is a plain module, trained by the plain inner loop."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from diloco_node.replica.base import ReplicaSettings
from diloco_node.replica.common import (
    eval_batches,
    forward_of,
    inner_config,
    load_dataset,
    mixed_precision,
    peak_memory_bytes,
    rank_device,
    stacked,
    train_batches,
)
from diloco_node.train.fit import fit_micro_batch
from diloco_node.train.inner import InnerTrainer, autocast, evaluate, export_moments, import_moments, lm_loss
from diloco_node.train.model import build_model, logits_of


class SingleReplica:
    def __init__(self, settings: ReplicaSettings):
        self.settings = settings
        self.device = rank_device(settings, 0)
        self.dataset = load_dataset(settings)  # read and tokenized in the background while the model is built
        # random init whatever settings.init says: θ takes φ's values (load) before the first step
        self.model = build_model(settings.model, settings.seed).to(self.device)
        self.eval = eval_batches(settings, self.dataset, self.device)  # waits for the read; its DataError here
        self.named = dict(self.model.named_parameters())  # canonical names and order
        self.forward = forward_of(settings, self.model)
        config = replace(inner_config(settings), back_off=True)  # one process: a back-off stalls nobody
        if settings.micro_batch_auto:
            config.micro_batch = fit_micro_batch(self.model, self._probe_loss, settings.batch_size, settings.seq_len,
                                                 self.device)
        self.trainer = InnerTrainer(self.model, config, self.forward)

    def _probe_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """The loss on `tokens` that fit.py sizes micro-batches by: the module's own forward, not the
        compiled one (compiling once per candidate size would cost more than the probe; eager keeps
        usually at least as much for the backward as compiled code does, so the size found fits it)."""
        with autocast(self.device, mixed_precision(self.settings)):
            return lm_loss(logits_of(self.model), tokens, tokens)

    @torch.no_grad()
    def load(self, phi: list[torch.Tensor] | None) -> None:
        assert phi is not None
        for theta, value in zip(self.named.values(), phi, strict=True):
            theta.copy_(value)

    def train_step(self, stream_seed: int, position: int, batches: int = 1) -> float:
        x, y = stacked(train_batches(self.settings, self.dataset, stream_seed, position, batches))
        # several batches: at most one --batch-size per forward, the size its owner chose for the device
        piece = self.settings.batch_size if batches > 1 else 0
        return self.trainer.train_step(x.to(self.device), y.to(self.device), piece)

    def theta(self) -> list[torch.Tensor] | None:
        return [p.detach().to("cpu", torch.float32, copy=True) for p in self.named.values()]

    def evaluate(self) -> float:
        return evaluate(self.model, self.eval, mixed_precision(self.settings), self.forward)

    def inner_state(self) -> dict[str, Any] | None:
        moments, adam_step = export_moments(self.trainer.optimizer, self.named, lambda t: t.detach().cpu().clone())
        return {"step": self.trainer.step, "adam_step": adam_step, "moments": moments}

    def load_inner_state(self, state: dict[str, Any] | None) -> None:
        assert state is not None
        self.trainer.optimizer.state.clear()
        import_moments(self.trainer.optimizer, self.named, state["moments"], state["adam_step"],
                       lambda full, param: full.to(param.device, param.dtype, copy=True))
        self.trainer.step = int(state["step"])

    def advance_schedule(self, step: int) -> None:
        self.trainer.step = max(self.trainer.step, step)

    def set_progress(self, progress: float) -> None:
        self.trainer.progress = progress

    def prepare_data(self, stream_seed: int, position: int) -> None:
        self.dataset.prepare(self.settings.batch_size, stream_seed, position)

    def peak_memory(self) -> list[int] | None:
        return [peak_memory_bytes(self.device)]

    def micro_batch(self) -> int:
        return self.trainer.micro or self.settings.batch_size

    def close(self) -> None:
        pass
