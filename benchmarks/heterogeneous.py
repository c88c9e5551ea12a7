"""Nodes of different speeds (issue #29): fixed H against --round-seconds, blocking and eager.

Three nodes at speeds 1×, 2× and 4× (the harness pauses the slower ones' processes part of every
0.2 s: harness/throttle.py) train the tiny model for --seconds of wall-clock per variant:

- fixed-H blocking / fixed-H eager: --inner-steps H (every node H steps per round);
- budget blocking / budget eager: --round-seconds T (every node the steps that fit before the deadline).

Per node: compute utilization in steady state (Σ compute / Σ (compute + wait) over the rounds after
the first, from the round records; a paused step counts as compute, as a slow GPU's step would),
inner steps and tokens trained, rounds; per variant: the eval loss of the fastest node's φ at the
last round within the window (equal wall-clock). Time to a target loss is not measured (see README).

`.venv/bin/python benchmarks/heterogeneous.py --seconds 90 --round-seconds 6 --h 20` (~8 minutes).
Results: benchmarks/results/heterogeneous.{json,md}. On a machine with fewer cores than nodes the
nodes also slow each other down, so the speeds are only roughly 1:2:4 (the md says the core count).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

from diloco_node.launch import NodeProcess
from harness.bench import RESULTS_DIR, machine_info, work_dir, write_results
from harness.nodes import FAST, start_node, stop
from harness.throttle import Throttle

NAME = "heterogeneous"
SPEEDS = (4, 2, 1)  # node1 the fastest: the others start by dialling it
VARIANTS = ("fixed-H blocking", "fixed-H eager", "budget blocking", "budget eager")


def flags(variant: str, args: argparse.Namespace, run_id: str) -> list[str]:
    common = [arg for arg in FAST if arg not in ("--sync", "blocking")]
    sync = variant.split()[-1]
    length = (["--inner-steps", str(args.h)] if variant.startswith("fixed")
              else ["--round-seconds", str(args.round_seconds)])
    return [*common, "--sync", sync, *length, "--run-id", run_id, "--min-peers", str(len(SPEEDS)),
            "--max-outer-steps", "100000", "--checkpoint-dir", "", "--matchmaking-time", "1"]


def run_variant(variant: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_id = f"hetero-{variant.replace(' ', '-')}-{int(time.time())}"
    options = flags(variant, args, run_id)
    (work / run_id).mkdir()
    nodes: list[NodeProcess] = [start_node("node1", options, work / run_id)]
    throttles: list[Throttle] = []
    try:
        address = nodes[0].wait_for_address(120)
        for i in range(2, len(SPEEDS) + 1):
            nodes.append(start_node(f"node{i}", [*options, "--peer", address], work / run_id))
        for node in nodes:
            node.wait_joined(180)
        for node, speed in zip(nodes, SPEEDS, strict=True):
            assert node.process is not None
            throttles.append(Throttle(node.process.pid, SPEEDS[0] / speed).start())
        started = time.time()
        time.sleep(args.seconds)
        ended = time.time()
    finally:
        for throttle in throttles:
            throttle.stop()
        for node in nodes:
            stop(node)
    per_node = []
    for node, speed in zip(nodes, SPEEDS, strict=True):
        rounds = [r for _, r in sorted(node.rounds.items()) if started < r.time <= ended]
        steady = rounds[1:] or rounds
        compute = sum(r.compute_seconds for r in steady)
        wait = sum(r.wait_seconds for r in steady)
        per_node.append({
            "node": node.name, "speed": speed, "rounds": len(rounds),
            "utilization": round(compute / (compute + wait), 4) if compute + wait > 0 else None,
            "inner_steps": sum(r.last_round_inner_steps for r in rounds),
            "tokens": sum(r.last_round_tokens for r in rounds),
            "skipped": sum(1 for r in rounds if r.skipped),
            "eval_loss": rounds[-1].eval_loss if rounds else None})
    return {"variant": variant, "seconds": round(ended - started, 1), "nodes": per_node,
            "eval_loss": per_node[0]["eval_loss"]}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| variant | node speed | rounds | utilization | inner steps | tokens | skipped | eval loss |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        for node in result["nodes"]:
            utilization = "–" if node["utilization"] is None else f"{100 * node['utilization']:.1f} %"
            loss = "–" if node["eval_loss"] is None else f"{node['eval_loss']:.4f}"
            lines.append(f"| {result['variant']} | {node['speed']}× | {node['rounds']} | {utilization} | "
                         f"{node['inner_steps']} | {node['tokens']:,.0f} | {node['skipped']} | {loss} |")
    return "\n".join(lines)


def report(payload: dict[str, Any]) -> str:
    """The results as markdown (also made again from a results JSON: `report(json.load(...))`)."""
    run, machine = payload["args"], payload["machine"]
    return (f"# Heterogeneous speeds: fixed H against --round-seconds\n\n"
            f"`python benchmarks/heterogeneous.py --seconds {run['seconds']:g} --round-seconds "
            f"{run['round_seconds']:g} --h {run['h']}`, {payload['date']}, {machine['nproc']} cores "
            f"({machine['processor']}), torch {machine['torch']}, hivemind {machine['hivemind']}.\n\n"
            f"Nodes at speeds 4×, 2×, 1× (the slower ones paused part of every 0.2 s by the harness); each variant "
            f"trains {run['seconds']:g} s of wall-clock; utilization over the rounds after the first; eval loss of "
            f"each node's φ at its last round in the window.\n\n{table(payload['results'])}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="wall-clock of training per variant")
    parser.add_argument("--round-seconds", type=float, default=6.0, help="T of the budget variants")
    parser.add_argument("--h", type=int, default=20, help="H of the fixed variants")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    results = []
    with work_dir(f"{NAME}_") as work:
        for variant in args.variants.split(","):
            results.append(run_variant(variant, args, work))
            print(json.dumps(results[-1]), flush=True)
    payload = {"benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "args": {"seconds": args.seconds, "round_seconds": args.round_seconds, "h": args.h},
               "machine": machine_info(), "results": results}
    text = report(payload)
    write_results(args.out_dir, NAME, payload, text)


if __name__ == "__main__":
    main()
