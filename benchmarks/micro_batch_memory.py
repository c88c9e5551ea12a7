"""How well train/fit.py's CPU estimate predicts a step's memory (docs/architecture.md §11).

`--micro-batch-size auto` on a CPU sizes the micro-batch from `saved_bytes_per_sequence` (the bytes
autograd keeps for one sequence's backward) times fit.BACKWARD_FACTOR. This measures the real
ratio: the peak resident set a forward+backward of B sequences adds (over a warmed-up process that
already holds the parameters and their gradients) divided by B x the saved bytes. BACKWARD_FACTOR
must stay above every ratio printed here.

Usage: .venv/bin/python benchmarks/micro_batch_memory.py tiny:256:8 small:512:8 gpt-125m:512:4
       (model:seq_len:batch; each in a fresh process, so one's peak does not hide the next's)
"""

from __future__ import annotations

import resource
import subprocess
import sys

import torch

from diloco_node.train.fit import BACKWARD_FACTOR, saved_bytes_per_sequence
from diloco_node.train.inner import lm_loss
from diloco_node.train.model import build_model, logits_of


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure(model_name: str, seq_len: int, batch: int) -> str:
    torch.set_num_threads(1)
    model = build_model(model_name, 0)
    forward = logits_of(model, None)  # as the node's replica calls it (a preset's module or an HF model)

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(forward, tokens, tokens)

    per_sequence = saved_bytes_per_sequence(model, loss_of, seq_len)
    loss_of(torch.zeros(1, seq_len, dtype=torch.long)).backward()  # gradients exist before the baseline
    model.zero_grad(set_to_none=False)
    base = resident_bytes()
    loss_of(torch.randint(0, 200, (batch, seq_len))).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ratio = (peak - base) / (batch * per_sequence)
    return (f"{model_name} seq_len={seq_len} batch={batch}: saved {per_sequence / 2**20:.1f} MiB/sequence, "
            f"step added {(peak - base) / 2**20:.1f} MiB, ratio {ratio:.2f} (BACKWARD_FACTOR {BACKWARD_FACTOR})")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        name, seq_len, batch = sys.argv[2].split(":")
        print(measure(name, int(seq_len), int(batch)))
        return
    for case in sys.argv[1:] or ["tiny:256:8"]:
        subprocess.run([sys.executable, __file__, "--one", case], check=True)


if __name__ == "__main__":
    main()
