"""A batch that fits (train/fit.py): the micro-batch found by `auto`, and the inner loop's back-off
when a step runs out of memory. No GPU here: the seam is a forward that raises CUDA's own
out-of-memory error for micro-batches above a threshold, as a GPU would."""

from __future__ import annotations

import logging

import pytest
import torch

from diloco_node.replica import ReplicaSettings, make_replica
from diloco_node.train import fit
from diloco_node.train.fit import FitError, fit_micro_batch, largest_fitting, saved_bytes_per_sequence
from diloco_node.train.inner import InnerConfig, InnerTrainer, lm_loss
from diloco_node.train.model import build_model

BATCH = 8


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(0, 256, (n, BATCH, 17), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in text]


def _failing_above(model: torch.nn.Module, limit: int, calls: list[int]) -> fit.LossOf:
    def forward(tokens: torch.Tensor) -> torch.Tensor:
        calls.append(len(tokens))
        if len(tokens) > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (test seam: {len(tokens)} > {limit})")
        return model(tokens)  # type: ignore[no-any-return]
    return forward


def _trained(micro: int, limit: int | None = None, back_off: bool = True) -> tuple[InnerTrainer, list[int]]:
    model, calls = build_model("tiny", seed=0), []
    forward = _failing_above(model, limit, calls) if limit is not None else None
    trainer = InnerTrainer(model, InnerConfig(lr=3e-3, warmup_steps=2, micro_batch=micro, back_off=back_off), forward)
    for x, y in _batches(3):
        trainer.train_step(x, y)
    return trainer, calls


def _same(a: InnerTrainer, b: InnerTrainer) -> bool:
    return all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in
               zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_out_of_memory_backs_off_logs_once_and_trains_as_the_fitting_size(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="diloco_node.train.inner")
    backed, calls = _trained(0, limit=2)  # the whole batch of 8 at once does not fit, nor 4; 2 does
    assert backed.micro == 2 and backed.step == 3
    warnings = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert warnings == ["out of memory at micro-batch 8: now 4", "out of memory at micro-batch 4: now 2"]
    assert calls[:3] == [8, 4, 2] and set(calls[3:]) == {2}  # later steps go straight to the size that fits
    fitting, _ = _trained(2)
    assert _same(backed, fitting)
    assert all(p.grad is None for p in backed.model.parameters())


def test_the_gradient_does_not_depend_on_the_micro_batch() -> None:
    """The loss is the batch's mean whatever the pieces: gradients agree up to summation order. (After
    a few AdamW steps the parameters differ by more than that: its first steps are nearly the sign
    of the gradient, which amplifies rounding; so the gradient itself is compared.)"""
    x, y = _batches(1)[0]
    grads = []
    for micro in (8, 4, 2, 1):
        trainer = InnerTrainer(build_model("tiny", seed=0), InnerConfig())
        loss = trainer._accumulate(x, y, micro)
        grads.append((float(loss), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]))
    for loss, grad in grads[1:]:
        assert loss == pytest.approx(grads[0][0], rel=1e-6)
        assert all(torch.allclose(g, w, rtol=1e-4, atol=1e-7) for g, w in zip(grad, grads[0][1], strict=True))


def test_a_step_that_does_not_fit_one_sequence_stops_with_one_line() -> None:
    with pytest.raises(FitError) as caught:
        _trained(0, limit=0)
    assert caught.value.exit_code == 1 and "\n" not in str(caught.value)
    assert "micro-batch of 1 sequence" in str(caught.value)


def test_ranks_of_a_split_replica_do_not_back_off_alone() -> None:
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _trained(0, limit=2, back_off=False)


@pytest.mark.parametrize(("batch", "limit", "tried"), [(12, 3, [12, 6, 3]), (12, 5, [12, 6, 3]), (8, 8, [8]),
                                                        (9, 2, [9, 3, 1]), (7, 6, [7, 1])])
def test_trying_halves_among_the_divisors(batch: int, limit: int, tried: list[int]) -> None:
    attempts: list[int] = []

    def attempt(micro: int) -> None:
        attempts.append(micro)
        if micro > limit:
            raise torch.cuda.OutOfMemoryError("seam")

    assert largest_fitting(batch, attempt) == tried[-1]
    assert attempts == tried and all(batch % micro == 0 for micro in attempts)


def test_trying_gives_up_below_one_sequence() -> None:
    def attempt(micro: int) -> None:
        raise torch.cuda.OutOfMemoryError("seam")

    with pytest.raises(FitError):
        largest_fitting(6, attempt)


def _loss_of(model: torch.nn.Module) -> fit.LossOf:
    return lambda tokens: lm_loss(model, tokens, tokens)


def test_auto_on_the_cpu_takes_the_largest_divisor_the_memory_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model("tiny", seed=0)
    per_sequence = fit.BACKWARD_FACTOR * saved_bytes_per_sequence(model, _loss_of(model), 64)
    fixed = 3 * 4 * sum(p.numel() for p in model.parameters())
    assert per_sequence > 0
    for room, expected in [(5.5, 4), (12.5, 12), (100, 12), (1.2, 1)]:  # room for this many sequences
        available = int((fixed + room * per_sequence) / fit.CPU_SHARE)
        monkeypatch.setattr(fit, "memory_available", lambda available=available: available)
        micro = fit_micro_batch(model, _loss_of(model), 12, 64, torch.device("cpu"))
        assert micro == expected and 12 % micro == 0
    assert all(p.grad is None for p in model.parameters())  # the measure trains nothing
    monkeypatch.setattr(fit, "memory_available", lambda: fixed)
    with pytest.raises(FitError, match="micro-batch of 1 sequence needs about"):
        fit_micro_batch(model, _loss_of(model), 12, 64, torch.device("cpu"))


def test_a_replica_with_auto_trains_at_the_size_it_found() -> None:
    settings = ReplicaSettings(model="tiny", seed=0, data=None, seq_len=32, batch_size=6, eval_batches=1,
                               inner_lr=1e-3, warmup_steps=2, weight_decay=0.1, grad_clip=1.0, total_steps=20,
                               precision="fp32", parallel="none", devices=("cpu",), threads=1, micro_batch_auto=True)
    replica = make_replica(settings)
    try:
        assert replica.micro_batch() in (1, 2, 3, 6)
        assert replica.train_step(7, 0) > 0
    finally:
        replica.close()


def test_a_replica_backs_off_and_reports_the_size_it_trains_at() -> None:
    """The node's own replica (parallel none) turns a step's out-of-memory into a smaller micro-batch,
    and micro_batch() (what /api/status shows) follows it."""
    settings = ReplicaSettings(model="tiny", seed=0, data=None, seq_len=32, batch_size=6, eval_batches=1,
                               inner_lr=1e-3, warmup_steps=2, weight_decay=0.1, grad_clip=1.0, total_steps=20,
                               precision="fp32", parallel="none", devices=("cpu",), threads=1)
    replica = make_replica(settings)
    try:
        assert replica.micro_batch() == 6  # 0: the whole batch at once
        calls: list[int] = []
        replica.trainer.forward = _failing_above(replica.model, 2, calls)  # type: ignore[attr-defined]
        assert replica.train_step(7, 0) > 0
        assert calls == [6, 3, 1, 1, 1, 1, 1, 1]  # 6 and 3 ran out; 1 is the largest divisor of 6 ≤ 3 // 2
        assert replica.micro_batch() == 1
    finally:
        replica.close()


def test_the_gpu_probe_tries_real_steps_and_leaves_no_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """fit._try_on_cuda's own flow (reserve, forward+backward per candidate, back-off, cleanup), run on
    the CPU with the seam's out-of-memory standing in for the GPU's: only synchronize needs a GPU."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    model, calls = build_model("tiny", seed=0), []
    forward = _failing_above(model, 5, calls)
    before = [p.detach().clone() for p in model.parameters()]
    micro = fit._try_on_cuda(model, lambda tokens: lm_loss(forward, tokens, tokens), 12, 16, torch.device("cpu"))
    assert micro == 3 and calls == [12, 6, 3]
    assert all(p.grad is None for p in model.parameters())  # the probe trains nothing
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
