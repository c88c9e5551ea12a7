"""A node's three local layouts side by side on the CPU: one process (--parallel none), FSDP shards over
2 local ranks (--parallel fsdp --local-ranks 2) and a 2-stage pipeline (--parallel pipeline --local-ranks 2).

For each layout one real `diloco-node join` runs on its own (no --peer: it starts its own run, sync
blocking, checkpoints off), one layout after the other so they do not fight over the cores. All run
the same model, seed, seq_len, batch size and token budget (--rounds x --inner-steps x --batch-size x
--seq-len tokens), and share one libp2p identity, so their data order is the same too (a node's
data order follows its peer id). --threads stays 0: the node shares the machine's cores among its
ranks itself. From the node's JSON events (--events FILE) after its last round we read:
- tokens/s of the inner phase: inner steps x batch size x seq_len / the rounds' compute_seconds
  (start-up, evaluation and the outer step are not in it);
- peak memory per local rank (the last round event's peak_memory_bytes: peak RSS of each rank's
  process on CPU, CUDA's peak allocated bytes on a GPU);
- eval loss at equal tokens (the last round's eval_loss, from the joined event's).

    .venv/bin/python benchmarks/layouts.py                  # model small, 5 x 30 steps: about 6 minutes on 2 cores
    .venv/bin/python benchmarks/layouts.py --model gpt-125m --rounds 2 --inner-steps 4 --batch-size 4
    .venv/bin/python benchmarks/layouts.py --model tiny --rounds 2 --inner-steps 5 --out /tmp/layouts

Results: benchmarks/results/layouts.{json,md} (layouts-MODEL.* for another --model; or --out DIR),
with ratios against `none`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_node.commands.launch import NodeProcess, read_events
from harness.bench import RESULTS_DIR, machine_info
from harness.nodes import BLOCKING_FLAGS, PUBLISHED_OUTER, start_node

NAME = "layouts"
LOCAL_RANKS = 2
LAYOUTS: dict[str, int] = {"none": 1, "fsdp": LOCAL_RANKS, "pipeline": LOCAL_RANKS}  # --parallel: --local-ranks
REFERENCE = "none"
STOP_WITHIN = 60.0  # seconds a node may take to exit after SIGTERM
MIB = 1024 * 1024


def figures(name: str, events: list[dict[str, Any]], rounds: int, inner_steps: int) -> dict[str, Any]:
    """What a finished node's events say: inner seconds (the sum of its rounds' compute_seconds), eval
    loss at the start and after the last round, and each rank's peak memory as of that round."""
    done = [e for e in events if e.get("event") == "round"]  # in round order
    joined = [e for e in events if e.get("event") == "joined"]
    if not joined or not done or done[-1]["round"] != rounds:
        raise RuntimeError(f"{name}: the node's events show no finished round {rounds} "
                           f"(rounds {[e['round'] for e in done]})")
    return {"parameters": joined[0]["parameters"], "compute_seconds": sum(float(e["compute_seconds"]) for e in done),
            "eval_loss_initial": float(joined[0]["eval_loss"]), "eval_loss": float(done[-1]["eval_loss"]),
            "inner_steps": rounds * inner_steps, "peak_memory_bytes": [int(b) for b in done[-1]["peak_memory_bytes"]]}


def wait_exit(node: NodeProcess, timeout: float) -> int | None:
    """The node leaves by itself after its last round (--max-outer-steps). One that is still there after
    `timeout` gets SIGTERM, then SIGKILL after STOP_WITHIN more seconds, each with a warning."""
    assert node.process is not None
    try:
        return node.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"WARNING: {node.name} still running after {timeout:.0f}s; SIGTERM\n{node.tail()}", file=sys.stderr)
    return node.terminate(STOP_WITHIN)


def node_flags(parallel: str, ranks: int, args: argparse.Namespace, run_id: str, identity: Path) -> list[str]:
    return ["--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0", "--run-id", run_id,
            "--checkpoint-dir", "", "--identity", str(identity), *BLOCKING_FLAGS, *PUBLISHED_OUTER, "--threads", "0",
            "--model", args.model, "--seed", str(args.seed), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--inner-steps", str(args.inner_steps),
            "--max-outer-steps", str(args.rounds), "--parallel", parallel, "--local-ranks", str(ranks)]


def measure(parallel: str, ranks: int, args: argparse.Namespace, work: Path, identity: Path) -> dict[str, Any]:
    run_id = f"bench-layouts-{parallel}-{os.getpid()}-{int(time.time())}"
    events_path = work / f"{parallel}.events.jsonl"
    started = time.monotonic()
    node = start_node(parallel, node_flags(parallel, ranks, args, run_id, identity)
                      + ["--events", str(events_path)], work)
    code = wait_exit(node, args.timeout)
    wall = time.monotonic() - started
    if code != 0:
        print(f"WARNING: {parallel} exited {code}\n{node.tail()}", file=sys.stderr)
    found = figures(parallel, read_events(events_path), args.rounds, args.inner_steps)
    tokens = found["inner_steps"] * args.batch_size * args.seq_len
    result = {"layout": parallel, "local_ranks": ranks, **found, "tokens": tokens,
              "tokens_per_second": tokens / found["compute_seconds"], "wall_seconds": round(wall, 1),
              "exit_code": code}
    print(f"{parallel}: {result['tokens_per_second']:,.0f} tokens/s, peak MiB "
          f"{' / '.join(f'{b / MIB:.0f}' for b in found['peak_memory_bytes'])}, "
          f"eval loss {result['eval_loss_initial']:.4f} -> {result['eval_loss']:.4f}, {wall:.0f}s wall, exit {code}",
          flush=True)
    return result


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    ref = next(r for r in results if r["layout"] == REFERENCE)
    tokens = ref["tokens"]
    lines = [f"# Local layouts on the CPU: model {args.model} ({ref['parameters']:,} parameters), {args.rounds} rounds "
             f"x H={args.inner_steps} x batch {args.batch_size} x seq_len {args.seq_len} = {tokens:,} tokens each, "
             f"sync blocking, {os.cpu_count()} cores shared by the ranks (--threads 0)", "",
             "| layout | tokens/s | vs none | peak MiB per rank | eval loss | eval / none |",
             "|---|---|---|---|---|---|"]
    for r in results:
        label = r["layout"] if r["local_ranks"] == 1 else f"{r['layout']} x{r['local_ranks']}"
        peak = " / ".join(f"{b / MIB:,.0f}" for b in r["peak_memory_bytes"])
        speed = r["tokens_per_second"] / ref["tokens_per_second"]
        lines.append(f"| {label} | {r['tokens_per_second']:,.0f} | {speed:.2f}x | {peak} "
                     f"| {r['eval_loss_initial']:.4f} → {r['eval_loss']:.4f} "
                     f"| {r['eval_loss'] / ref['eval_loss']:.4f} |")
    lines += ["", "tokens/s: inner steps only (the node's compute_seconds). Peak memory: peak RSS of each local "
              "rank's process (rank 0 is the node's own process, with its swarm). Same data order in every layout "
              "(one shared identity)."]
    unequal = {r["layout"]: r["tokens"] for r in results if r["tokens"] != tokens}
    if unequal:
        lines.append(f"WARNING: unequal token counts: {unequal} vs {tokens:,}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="model preset: tiny, small, gpt-125m")
    parser.add_argument("--rounds", type=int, default=5, help="outer rounds per layout (--max-outer-steps)")
    parser.add_argument("--inner-steps", type=int, default=30, help="H: inner steps per round")
    parser.add_argument("--batch-size", type=int, default=8, help=f"sequences per inner step (divisible by "
                                                                  f"{LOCAL_RANKS})")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per layout, start-up included")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for layouts.{json,md}")
    args = parser.parse_args()
    if args.batch_size % LOCAL_RANKS:
        parser.error(f"--batch-size {args.batch_size} does not split over {LOCAL_RANKS} local ranks")
    if min(args.rounds, args.inner_steps, args.batch_size, args.seq_len) < 1:
        parser.error("--rounds, --inner-steps, --batch-size and --seq-len must be positive")
    work = Path(tempfile.mkdtemp(prefix="layouts_"))
    identity = work / "identity.key"  # created by the first node, reused by the others: same data order
    results = [measure(parallel, ranks, args, work, identity) for parallel, ranks in LAYOUTS.items()]
    text = report(args, results)
    ref = results[0]
    args.out.mkdir(parents=True, exist_ok=True)
    name = NAME if args.model == "small" else f"{NAME}-{args.model}"  # one result file per model
    (args.out / f"{name}.json").write_text(json.dumps({
        "args": {**vars(args), "out": str(args.out)}, "machine": machine_info(), "logs": str(work),
        "results": results,
        "vs_none": {r["layout"]: {"tokens_per_second": r["tokens_per_second"] / ref["tokens_per_second"],
                                  "eval_loss": r["eval_loss"] / ref["eval_loss"]} for r in results}}, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
