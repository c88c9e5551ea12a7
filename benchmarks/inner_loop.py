"""The node's inner phase against a plain training loop, side by side: tokens/s, peak memory, MFU.

Both sides train the same model (same init), batch shape, device, precision and compile setting.
Throughput: one process builds both and alternates them step by step (plain, node, node, plain,
...), timing each step, so a busy machine slows both alike: --repeats x --steps steps per side.
Reported: each side's tokens/s at its median step time, and node/plain as the median of the
ratios of neighbouring steps (plain time / node time), which a shared machine's load drift moves
least. Peak memory: each side alone in a fresh
process (peak RSS on a CPU, peak allocated on a GPU).

  node   SingleReplica.train_step (replica/single.py), built from a NodeConfig exactly as `join`
         builds it: the node's data (the embedded corpus unless --data), its AdamW schedule, clip,
         autocast, micro-batches, fused AdamW on CUDA, torch.compile when --compile on.
  plain  the loop below (`plain_loop`, ~40 lines): batches of the same data made up front (another
         stream of the node's own data, so both see the same token statistics), AdamW, clip, step.

Usage (CPU, the ~20M preset):   .venv/bin/python benchmarks/inner_loop.py --model llama-20m
Usage (GPU, 150M, bf16, compile): .venv/bin/python benchmarks/inner_loop.py --model llama-150m \\
                                   --batch-size 16 --seq-len 1024 --compile on
MFU (GPU only): 6·N + 12·L·d·T FLOPs per token (PaLM's count) over the card's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

# dense bf16 tensor-core peaks, FLOP/s (vendor datasheets, no sparsity)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
             "RTX 4090": 165e12, "RTX 3090": 71e12}


def plain_loop(args: argparse.Namespace) -> Any:
    """What a user would write: model, AdamW, autocast, clip, step; a float(loss) per step, as logging does."""
    import torch
    import torch.nn.functional as F

    from diloco_node.train.model import build_model

    device = torch.device(args.device)
    bf16 = args.precision == "bf16"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(args.model, seed=0).to(device)
    hf = not hasattr(model, "blocks")
    forward = torch.compile(model) if args.compile == "on" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    data = node_batches(args, args.warmup + args.steps)

    def step(i: int) -> float:
        x, y = data[i % len(data)]
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = forward(input_ids=x).logits if hf else forward(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def node_config(args: argparse.Namespace) -> Any:
    from diloco_node.config import build_config

    return build_config({"model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size,
                         "device": args.device, "precision": args.precision, "compile": args.compile,
                         "micro_batch_size": args.micro_batch_size, "eval_batches": 1, "threads": args.threads,
                         **({"data": args.data} if args.data else {})})


def node_batches(args: argparse.Namespace, count: int) -> list[Any]:
    """`count` batches of the node's data (stream 2: not the node side's own), read before timing starts."""
    from diloco_node.replica import settings_of
    from diloco_node.replica.common import load_dataset

    data = load_dataset(settings_of(node_config(args)))
    batches = [data.train_batch(args.batch_size, 2, position) for position in range(count)]
    prefetch = getattr(data, "prefetch", None)
    if prefetch is not None:
        prefetch.close()
    return batches


def node_loop(args: argparse.Namespace) -> Any:

    from diloco_node.replica import settings_of
    from diloco_node.replica.single import SingleReplica
    from diloco_node.train.model import build_model

    replica = SingleReplica(settings_of(node_config(args)))
    replica.load([p.detach().float() for p in build_model(args.model, seed=0).parameters()])
    return lambda i: replica.train_step(1, i)


def block(step: Any, first: int, args: argparse.Namespace) -> float:
    """Tokens/s over steps first .. first+steps−1 (the device drained before and after)."""
    import torch

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(first, first + args.steps):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    return args.steps * args.batch_size * args.seq_len / (time.perf_counter() - start)


def alone(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side in this process: its peak memory, after warmup and one block."""
    import torch

    step = (node_loop if side == "node" else plain_loop)(args)
    for i in range(args.warmup):
        step(i)
    rate = block(step, args.warmup, args)
    cuda = args.device.startswith("cuda")
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens_per_s": rate, "peak_bytes": int(peak), "device_name": torch.cuda.get_device_name() if cuda
            else "cpu"}


def both(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides in this process, alternating step by step; each step's seconds per side."""
    steps = {"plain": plain_loop(args), "node": node_loop(args)}
    for side in ("plain", "node"):
        for i in range(args.warmup):
            steps[side](i)
    seconds: dict[str, list[float]] = {"plain": [], "node": []}
    for i in range(args.warmup, args.warmup + args.repeats * args.steps):
        for side in ("plain", "node") if i % 2 == 0 else ("node", "plain"):
            seconds[side].append(timed_step(steps[side], i, args))
        print(f"step {i}: plain {seconds['plain'][-1]:.3f} s, node {seconds['node'][-1]:.3f} s",
              file=sys.stderr, flush=True)
    return seconds


def timed_step(step: Any, i: int, args: argparse.Namespace) -> float:
    import torch

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(i)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def flops_per_token(model: str, seq_len: int) -> float:
    import torch

    from diloco_node.train.hf import HFSpec, build_meta
    from diloco_node.train.model import GPT, resolve_model

    spec = resolve_model(model)
    if isinstance(spec, HFSpec):
        module = build_meta(spec)[0]
    else:
        with torch.device("meta"):
            module = GPT(spec.config)
    params = sum(p.numel() for p in module.parameters())
    return 6 * params + 12 * spec.n_layer * spec.d_model * seq_len


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-20m")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--compile", default="off", choices=["on", "off"])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--data", default=None, help="the node's --data (default: the embedded corpus)")
    parser.add_argument("--side", choices=["node", "plain", "both"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    args = parser.parse_args()
    if args.side:  # a child: one side, one JSON line
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(both(args) if args.side == "both" else alone(args.side, args)))
        return 0
    import torch

    from diloco_node.replica.base import resolve_precision

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.precision = resolve_precision(args.precision, (args.device,))
    child = [sys.executable, __file__, "--model", args.model, "--batch-size", str(args.batch_size),
             "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size), "--steps",
             str(args.steps), "--warmup", str(args.warmup), "--device", args.device, "--precision", args.precision,
             "--compile", args.compile, "--threads", str(args.threads), *(["--data", args.data] if args.data else [])]
    child += ["--repeats", str(args.repeats)]
    runs: dict[str, Any] = {}
    for side in ("both", "plain", "node"):
        done = subprocess.run([*child, "--side", side], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode:
            return done.returncode
        runs[side] = json.loads(done.stdout.strip().splitlines()[-1])
    per_token = flops_per_token(args.model, args.seq_len)
    name = runs["node"]["device_name"]
    peak = next((value for key, value in PEAK_BF16.items() if key in name), None) if args.device != "cpu" else None
    summary: dict[str, Any] = {"model": args.model, "device": name, "precision": args.precision,
                               "compile": args.compile, "batch_size": args.batch_size, "seq_len": args.seq_len,
                               "micro_batch_size": args.micro_batch_size, "steps": args.steps,
                               "repeats": args.repeats, "flops_per_token": per_token}
    print(f"\n{args.model} on {name}, {args.precision}, compile {args.compile}, batch {args.batch_size}x"
          f"{args.seq_len}, {args.steps * args.repeats} steps per side (median step)")
    print(f"{'side':6s} {'tokens/s':>10s} {'peak MiB':>9s} {'MFU':>6s}")
    tokens = args.batch_size * args.seq_len
    for side in ("plain", "node"):
        rate = tokens / statistics.median(runs["both"][side])
        memory = runs[side]["peak_bytes"] / 2**20
        mfu = rate * per_token / peak if peak else None
        summary[side] = {"tokens_per_s": rate, "peak_mib": memory, "mfu": mfu, "step_seconds": runs["both"][side],
                         "alone_tokens_per_s": runs[side]["tokens_per_s"]}
        print(f"{side:6s} {rate:10.1f} {memory:9.0f} {f'{mfu:.1%}' if mfu is not None else 'n/a':>6s}")
    ratio = statistics.median(p / n for p, n in zip(runs["both"]["plain"], runs["both"]["node"], strict=True))
    summary["node_over_plain"] = ratio
    print(f"node / plain tokens/s (median of neighbouring steps): {ratio:.3f} ({(ratio - 1):+.1%})")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(summary, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
