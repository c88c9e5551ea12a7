"""A batch that fits: the largest micro-batch this device holds (docs/architecture.md §11).

`--micro-batch-size auto` asks for it once, when the replica is built; the inner loop
(train/inner.py) backs off to a smaller one whenever a step runs out of memory later. Only
divisors of the rank's batch are candidates, so the accumulated gradient is the batch's mean
exactly (every piece has the same size), whatever micro-batch the device ends up with.

On CUDA the answer is found by trying: a forward and backward of each candidate, largest first,
halving on out-of-memory. On the CPU nothing raises before the kernel's OOM killer or the swap
does, so the answer is computed instead: the activation bytes one sequence keeps for its backward
(measured, not guessed from the architecture) against the memory the machine has available.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from diloco_node.errors import NodeError

logger = logging.getLogger(__name__)

# CPU: the share of MemAvailable the activations may take. A volunteer's machine runs other
# programs, and the allocator fragments; half leaves them room.
CPU_SHARE = 0.5
# CPU: peak bytes a forward+backward adds per byte autograd saves for the backward (the backward
# also holds the gradient of the activation it is working through, and attention's temporaries).
# Measured by benchmarks/micro_batch_memory.py (results/micro_batch_memory.md): 1.12 to 1.20 on the
# GPT presets, 1.28 to 1.48 on llama-20m; 2 keeps a margin above the worst.
BACKWARD_FACTOR = 2.0

LossOf = Callable[[torch.Tensor], torch.Tensor]  # tokens [B, T] → the scalar loss of a forward on them


class FitError(NodeError, RuntimeError):
    """Not even a micro-batch of one sequence fits the device; one line."""

    # 1, not 2: the config may be fine — what fits depends on what else holds the device's memory
    # right now (the owner's own programs), so a supervisor's restart later may well succeed.
    exit_code = 1


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of `n` that is ≤ `limit` (1 at least: every n has it)."""
    return next((d for d in range(min(n, limit), 0, -1) if n % d == 0), 1)


def smaller_micro_batch(batch: int, micro: int) -> int:
    """The next micro-batch to try after `micro` ran out of memory: the largest divisor of `batch`
    at most half of it. FitError when `micro` was already one sequence."""
    if micro <= 1:
        raise FitError("out of memory with a micro-batch of 1 sequence: this device cannot train the model at "
                       "this --seq-len (free its memory, or use a smaller model or --seq-len)")
    return largest_divisor_at_most(batch, micro // 2)


def largest_fitting(batch: int, attempt: Callable[[int], None], release: Callable[[], None] = lambda: None) -> int:
    """Try `attempt(d)` from the whole `batch` down, halving among its divisors on CUDA's
    out-of-memory; the first d that ran. FitError when not even 1 does."""
    micro = batch
    while True:
        try:
            attempt(micro)
        except torch.cuda.OutOfMemoryError:
            pass
        else:
            return micro
        # outside the except: the exception's frames, and the activations they hold, are gone
        release()
        micro = smaller_micro_batch(batch, micro)


def fit_micro_batch(model: nn.Module, loss_of: LossOf, batch: int, seq_len: int, device: torch.device) -> int:
    """The largest divisor of `batch` (the rank's sequences per step) that fits `device`."""
    if device.type == "cuda":
        micro = _try_on_cuda(model, loss_of, batch, seq_len, device)
        how = "tried on the GPU"
    else:
        micro, how = _estimate_on_cpu(model, loss_of, batch, seq_len)
    logger.info("micro-batch auto: %d of %d sequences per forward/backward (%s)", micro, batch, how)
    return micro


def _try_on_cuda(model: nn.Module, loss_of: LossOf, batch: int, seq_len: int, device: torch.device) -> int:
    # AdamW's moments appear at the first step, after this probe: hold their bytes (two fp32 copies
    # of the parameters) while probing, so the chosen size still fits once they exist.
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:
        reserve = torch.empty(2 * numel, dtype=torch.float32, device=device)
    except torch.cuda.OutOfMemoryError:
        reserve = None
    if reserve is None:  # outside the except, as in largest_fitting
        torch.cuda.empty_cache()
        raise FitError(f"the model's parameters and AdamW's moments ({3 * numel * 4 / 2**30:.1f} GiB in fp32) do not "
                       f"fit {device} beside what else holds its memory")

    def attempt(micro: int) -> None:
        tokens = torch.zeros(micro, seq_len, dtype=torch.long, device=device)
        loss_of(tokens).backward()
        torch.cuda.synchronize(device)
        model.zero_grad(set_to_none=True)

    def release() -> None:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()

    try:
        return largest_fitting(batch, attempt, release)
    finally:
        del reserve
        release()


def _estimate_on_cpu(model: nn.Module, loss_of: LossOf, batch: int, seq_len: int) -> tuple[int, str]:
    per_sequence = BACKWARD_FACTOR * saved_bytes_per_sequence(model, loss_of, seq_len)
    # what every micro-batch size needs alike: the gradients and AdamW's two moments (fp32)
    fixed = 3 * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    available = memory_available()
    if fixed + per_sequence > available:
        raise FitError(f"a micro-batch of 1 sequence needs about {(fixed + per_sequence) / 2**20:.0f} MiB; "
                       f"this machine has {available / 2**20:.0f} MiB available")
    budget = max(per_sequence, CPU_SHARE * available - fixed)
    micro = largest_divisor_at_most(batch, int(budget // per_sequence))
    return micro, (f"{per_sequence / 2**20:.1f} MiB per sequence against {available / 2**20:.0f} MiB "
                   f"available, {CPU_SHARE:.0%} of it allowed")


def saved_bytes_per_sequence(model: nn.Module, loss_of: LossOf, seq_len: int) -> int:
    """The bytes autograd keeps for the backward of one sequence: what activation memory grows by,
    per sequence. Measured on a forward of one sequence (no backward runs, nothing is trained);
    parameters that autograd also saves are not counted, nor a storage twice."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    device = next(model.parameters()).device
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_of(torch.zeros(1, seq_len, dtype=torch.long, device=device))
    return sum(seen.values())


def memory_available() -> int:
    """Bytes the kernel says can be taken without swapping (MemAvailable), else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
