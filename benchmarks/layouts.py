"""A node's three local layouts side by side on the CPU: one process (--parallel none), FSDP shards over
2 local ranks (--parallel fsdp --local-ranks 2) and a 2-stage pipeline (--parallel pipeline --local-ranks 2).

For each layout one real `diloco-node join` runs on its own (no --peer: it starts its own run, sync
blocking, checkpoints off), one layout after the other so they do not fight over the cores. All run
the same model, seed, seq_len, batch size and token budget (--rounds x --inner-steps x --batch-size x
--seq-len tokens), and share one libp2p identity, so their data order is the same too (a node's
data order follows its peer id). --threads stays 0: the node shares the machine's cores among its
ranks itself. From the node's status API (GET <status>/api/status) after its last round we read:
- tokens/s of the inner phase: inner steps x batch size x seq_len / compute_seconds (the node's
  cumulative seconds of inner steps; start-up, evaluation and the outer step are not in it);
- peak memory per local rank (peak_memory_bytes: peak RSS of each rank's process on CPU);
- eval loss at equal tokens (eval_loss after the last round, from eval_loss_initial).
With --max-outer-steps a node leaves by itself right after its last round, so its status may be gone
before it shows that round: compute_seconds and the eval losses then come from the node's --events
file (the same figures), and the peak memory from its last status answer (the table says which round).

    .venv/bin/python benchmarks/layouts.py                  # model small, 5 x 30 steps: about 6 minutes on 2 cores
    .venv/bin/python benchmarks/layouts.py --model tiny --rounds 2 --inner-steps 5 --out /tmp/layouts

Results: benchmarks/results/layouts.{json,md} (or --out DIR), with ratios against `none`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from common import BLOCKING_FLAGS, RESULTS_DIR, NodeProcess, machine_info

NAME = "layouts"
LOCAL_RANKS = 2
LAYOUTS: dict[str, int] = {"none": 1, "fsdp": LOCAL_RANKS, "pipeline": LOCAL_RANKS}  # --parallel: --local-ranks
REFERENCE = "none"
STOP_WITHIN = 60.0  # seconds a node may take to exit after SIGTERM
POLL = 0.2  # seconds between /api/status reads
MIB = 1024 * 1024


def fetch_status(url: str) -> dict[str, Any] | None:
    """The node's /api/status, or None while (or once) its server does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/api/status", timeout=5) as response:
            return dict(json.load(response))
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return None


def read_events(path: Path) -> list[dict[str, Any]]:
    """The node's --events file: one JSON object per line (a line still being written is skipped)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


def watch(node: NodeProcess, url: str, rounds: int, deadline: float) -> dict[str, Any] | None:
    """The last /api/status answer the node gave, read while it trains until it has finished round `rounds`.

    With --max-outer-steps the node leaves by itself right after its last round, often within a few
    milliseconds (its status server stops with it), so the status may never show that round: the
    events file is then where its figures come from (see figures()). When it does, we keep reading
    for a few seconds, while the server answers, so as to get the peak memory the node records just
    after the round's other figures.
    """
    last: dict[str, Any] | None = None
    done_at: float | None = None
    while node.proc.poll() is None:
        status = fetch_status(url)
        if status is None and done_at is not None:
            break  # its server has stopped: the node is leaving
        if status is not None:
            last = status
            if done_at is None and (status.get("outer_step") or 0) >= rounds:
                done_at = time.monotonic()
        if done_at is not None and time.monotonic() > done_at + 5.0:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node.name}: round {rounds} not reached in time\n{node.tail()}")
        time.sleep(POLL)
    return last


def figures(name: str, status: dict[str, Any] | None, events: list[dict[str, Any]], rounds: int,
            inner_steps: int) -> dict[str, Any]:
    """compute_seconds, eval losses and inner steps after the last round, from /api/status where it showed
    that round, else from the node's events (the same numbers: the status' compute_seconds is the sum
    of the round events' and its eval_loss_initial the joined event's eval_loss)."""
    done = [e for e in events if e.get("event") == "round"]  # in round order
    joined = [e for e in events if e.get("event") == "joined"]
    if not joined or not done or done[-1]["round"] != rounds:
        raise RuntimeError(f"{name}: the node's events show no finished round {rounds} "
                           f"(rounds {[e['round'] for e in done]})")
    parameters = joined[0].get("parameters")
    if status is not None and status.get("outer_step") == rounds:
        return {"source": "status", "parameters": parameters, "compute_seconds": float(status["compute_seconds"]),
                "eval_loss_initial": float(status["eval_loss_initial"]), "eval_loss": float(status["eval_loss"]),
                "inner_steps": int(status["inner_step"])}
    return {"source": "events", "parameters": parameters,
            "compute_seconds": sum(float(e["compute_seconds"]) for e in done),
            "eval_loss_initial": float(joined[0]["eval_loss"]), "eval_loss": float(done[-1]["eval_loss"]),
            "inner_steps": rounds * inner_steps}


def stop(node: NodeProcess, finished: bool) -> tuple[int | None, str]:
    """End the node; (exit code, how it ended).

    A node that `finished` its last round leaves by itself (--max-outer-steps): it is given
    STOP_WITHIN seconds for that before a SIGTERM, as a SIGTERM in its last moments of exiting ends it
    with -15 (seen here). Any other node gets SIGTERM at once. A node still there STOP_WITHIN seconds
    after its SIGTERM is SIGKILLed, with a warning, so no rank is left over.
    """
    how = "left by itself after its last round"
    if finished:
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=STOP_WITHIN)
    if node.proc.poll() is None:
        how = "SIGTERM"
        node.signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=STOP_WITHIN)
        except subprocess.TimeoutExpired:
            print(f"WARNING: {node.name} did not exit within {STOP_WITHIN:.0f}s of SIGTERM; killing it (SIGKILL)"
                  f"\n{node.tail()}", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.proc.pid, signal.SIGKILL)  # this node's own session only
            node.proc.wait()
            return None, "SIGKILL after SIGTERM timed out"
    code = node.proc.returncode
    if code != 0:
        print(f"WARNING: {node.name} exited {code} ({how})\n{node.tail()}", file=sys.stderr)
    return code, how


def node_flags(parallel: str, ranks: int, args: argparse.Namespace, run_id: str, identity: Path) -> list[str]:
    return ["--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0", "--run-id", run_id,
            "--checkpoint-dir", "", "--identity", str(identity), *BLOCKING_FLAGS, "--threads", "0",
            "--model", args.model, "--seed", str(args.seed), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--inner-steps", str(args.inner_steps),
            "--max-outer-steps", str(args.rounds), "--parallel", parallel, "--local-ranks", str(ranks)]


def measure(parallel: str, ranks: int, args: argparse.Namespace, work: Path, identity: Path) -> dict[str, Any]:
    run_id = f"bench-layouts-{parallel}-{os.getpid()}-{int(time.time())}"
    events_path = work / f"{parallel}.events.jsonl"
    started = time.monotonic()
    node = NodeProcess(parallel, node_flags(parallel, ranks, args, run_id, identity)
                       + ["--events", str(events_path)], work)
    finished = False
    try:
        url = node.wait_for("stdout", "status:", args.timeout)
        status = watch(node, url, args.rounds, started + args.timeout)
        finished = True
    finally:
        code, how = stop(node, finished)
    wall = time.monotonic() - started
    found = figures(parallel, status, read_events(events_path), args.rounds, args.inner_steps)
    tokens = found["inner_steps"] * args.batch_size * args.seq_len
    peak = [int(b) for b in (status or {}).get("peak_memory_bytes") or []]
    result = {"layout": parallel, "local_ranks": ranks, **found, "tokens": tokens,
              "tokens_per_second": tokens / found["compute_seconds"], "peak_memory_bytes": peak,
              "peak_memory_after_round": (status or {}).get("outer_step") if peak else None,
              "wall_seconds": round(wall, 1), "exit_code": code,
              "stopped": how}
    print(f"{parallel}: {result['tokens_per_second']:,.0f} tokens/s, peak MiB "
          f"{' / '.join(f'{b / MIB:.0f}' for b in peak) or '?'} (after round {result['peak_memory_after_round']}), "
          f"eval loss {result['eval_loss_initial']:.4f} -> {result['eval_loss']:.4f}, {wall:.0f}s wall, "
          f"figures from {found['source']}, exit {code} ({how})", flush=True)
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
        peak = " / ".join(f"{b / MIB:,.0f}" for b in r["peak_memory_bytes"]) or "?"
        if r["peak_memory_bytes"] and r["peak_memory_after_round"] != args.rounds:
            peak += f" (after round {r['peak_memory_after_round']})"
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
    (args.out / f"{NAME}.json").write_text(json.dumps({
        "args": {**vars(args), "out": str(args.out)}, "machine": machine_info(), "logs": str(work),
        "results": results,
        "vs_none": {r["layout"]: {"tokens_per_second": r["tokens_per_second"] / ref["tokens_per_second"],
                                  "eval_loss": r["eval_loss"] / ref["eval_loss"]} for r in results}}, indent=1) + "\n")
    (args.out / f"{NAME}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
