"""Nodes of different speeds (issue #29): fixed H against --round-seconds, blocking and eager.

Three nodes at speeds 1×, 2× and 4× (the harness pauses the slower ones' processes part of every
0.2 s: harness/throttle.py) train the tiny model for --seconds of wall-clock per variant:

- fixed-H blocking / fixed-H eager: --inner-steps H (every node H steps per round);
- budget blocking / budget eager: --round-seconds T (every node the steps that fit before the deadline);
- batch blocking / batch eager (not run unless named in --variants): --round-seconds T --speed-spent
  batch --inner-steps --batch-h (every node H steps, a faster one more batches per step; §13).

Per node: compute utilization in steady state (Σ compute / Σ (compute + wait) over the rounds after
the first, from the round records; a paused step counts as compute, as a slow GPU's step would),
inner steps and tokens trained, rounds; per variant: the eval loss of the fastest node's φ at the
last round within the window (equal wall-clock). Time to a target loss is not measured (see docs/benchmarks.md).

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

from diloco_node.commands.launch import NodeProcess
from diloco_node.outer.aggregate import WEIGHTINGS
from harness.bench import RESULTS_DIR, machine_info, work_dir, write_results
from harness.nodes import FAST, start_node, stop
from harness.throttle import Throttle

NAME = "heterogeneous"
SPEEDS = (4, 2, 1)  # node1 the fastest: the others start by dialling it
# a budget variant's third word is its --weighting (docs/architecture.md §13): the default's choice
VARIANTS = ("fixed-H blocking", "fixed-H eager", "budget blocking", "budget eager",
            "budget eager sqrt-tokens", "budget eager equal")
# the time budget with speed spent on batch (--speed-spent batch, docs/architecture.md §13); the same words
BATCH_VARIANTS = ("batch blocking", "batch eager")


def flags(variant: str, args: argparse.Namespace, run_id: str) -> list[str]:
    common = [arg for arg in FAST if arg not in ("--sync", "blocking")]
    words = variant.split()
    sync, weighting = words[1], (words[2:] or ["tokens"])[0]
    length = (["--inner-steps", str(args.h)] if variant.startswith("fixed")
              else ["--round-seconds", str(args.round_seconds)])
    if variant.startswith("batch"):
        length += ["--speed-spent", "batch", "--inner-steps", str(args.batch_h)]
    return [*common, "--sync", sync, *length, "--weighting", weighting, "--run-id", run_id,
            "--min-peers", str(len(SPEEDS)),
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
        steady = rounds[1:]
        compute = sum(r.compute_seconds for r in steady)
        wait = sum(r.wait_seconds for r in steady)
        # of the wall-clock from the first round's end to the last's: every second not in an inner
        # step is idle, the eval and the round's bookkeeping too (the records' own figure,
        # compute / (compute + wait), leaves those out)
        span = rounds[-1].time - rounds[0].time if len(rounds) > 1 else 0.0
        per_node.append({
            "node": node.name, "speed": speed, "rounds": len(rounds),
            "utilization": round(compute / span, 4) if span > 0 else None,
            "record_utilization": round(compute / (compute + wait), 4) if compute + wait > 0 else None,
            "inner_steps": sum(r.last_round_inner_steps for r in rounds),
            "tokens": sum(r.last_round_tokens for r in rounds),
            "skipped": sum(1 for r in rounds if r.skipped),
            "eval_loss": rounds[-1].eval_loss if rounds else None})
    return {"variant": variant, "seconds": round(ended - started, 1), "nodes": per_node,
            "eval_loss": per_node[0]["eval_loss"]}


def run_weighting(weighting: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The weighting at equal wall-clock without the machine's load in it: under a time budget every
    round lasts T and the nodes train steps in proportion to their speeds, which blocking rounds of
    H = 4k, 2k and k steps reproduce exactly (H is not part of the fingerprint), unthrottled and
    deterministic (one torch thread, bit-equal φ): the eval loss after R rounds is that of R·T
    seconds of wall-clock on machines at 4×, 2×, 1×, whatever else this machine runs."""
    run_id = f"hetero-weighting-{weighting}-{int(time.time())}"
    common = [arg for arg in FAST if arg not in ("--sync", "blocking")]
    options = [*common, "--sync", "blocking", "--weighting", weighting, "--run-id", run_id,
               "--min-peers", str(len(SPEEDS)), "--max-outer-steps", str(args.weighting_rounds),
               "--checkpoint-dir", "", "--matchmaking-time", "1"]
    (work / run_id).mkdir()
    steps = [args.weighting_h * speed // SPEEDS[0] for speed in SPEEDS]
    nodes = [start_node("node1", [*options, "--inner-steps", str(steps[0])], work / run_id)]
    try:
        address = nodes[0].wait_for_address(120)
        for i in range(2, len(SPEEDS) + 1):
            nodes.append(start_node(f"node{i}", [*options, "--inner-steps", str(steps[i - 1]), "--peer", address],
                                    work / run_id))
        for node in nodes:
            node.wait_exit(60 * args.weighting_rounds)
    finally:
        for node in nodes:
            stop(node)
    last = [node.rounds[max(node.rounds)] for node in nodes if node.rounds]
    return {"weighting": weighting, "inner_steps": steps, "rounds": args.weighting_rounds,
            "group_sizes": sorted({r.group_size for node in nodes for r in node.rounds.values()}),
            "weights": [r.last_round_weight for r in last],
            "eval_loss": last[0].eval_loss if last else None,
            "same_phi": len({r.digest for r in last}) == 1}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| variant | node speed | rounds | utilization | (records) | inner steps | tokens | skipped | eval loss |",
             "|---|---|---|---|---|---|---|---|---|"]

    def percent(value: float | None) -> str:
        return "–" if value is None else f"{100 * value:.1f} %"

    for result in results:
        for node in result["nodes"]:
            utilization = f"{percent(node['utilization'])} | {percent(node.get('record_utilization'))}"
            loss = "–" if node["eval_loss"] is None else f"{node['eval_loss']:.4f}"
            lines.append(f"| {result['variant']} | {node['speed']}× | {node['rounds']} | {utilization} | "
                         f"{node['inner_steps']} | {node['tokens']:,.0f} | {node['skipped']} | {loss} |")
    return "\n".join(lines)


def weighting_table(results: list[dict[str, Any]]) -> str:
    lines = ["| weighting | inner steps 4× / 2× / 1× | rounds | weights | eval loss | same φ |",
             "|---|---|---|---|---|---|"]
    for r in results:
        weights = " / ".join(f"{w:.3f}" for w in r["weights"])
        loss = "–" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        lines.append(f"| {r['weighting']} | {' / '.join(map(str, r['inner_steps']))} | {r['rounds']} | {weights} | "
                     f"{loss} | {r['same_phi']} |")
    return "\n".join(lines)


def report(payload: dict[str, Any]) -> str:
    """The results as markdown (also made again from a results JSON: `report(json.load(...))`)."""
    run, machine = payload["args"], payload["machine"]
    return (f"# Heterogeneous speeds: fixed H against --round-seconds\n\n"
            f"`python benchmarks/heterogeneous.py --seconds {run['seconds']:g} --round-seconds "
            f"{run['round_seconds']:g} --h {run['h']}`, {payload['date']}, {machine['nproc']} cores "
            f"({machine['processor']}), torch {machine['torch']}, hivemind {machine['hivemind']}.\n\n"
            f"Nodes at speeds 4×, 2×, 1× (the slower ones paused part of every 0.2 s by the harness); each variant "
            f"trains {run['seconds']:g} s of wall-clock; utilization: inner-step seconds over the wall-clock from "
            f"the first round's end to the last's in the window (records: compute / (compute + wait) of the "
            f"rounds after the first, which leaves the eval out); eval loss of each node's φ at its last round "
            f"in the window; a budget variant's third word is its --weighting (none: tokens).\n\n"
            f"{table(payload['results'])}\n" + weighting_report(payload))


def weighting_report(payload: dict[str, Any]) -> str:
    if not payload.get("weighting"):
        return ""
    run = payload["args"]
    when = f", {payload['weighting_date']}" if payload.get("weighting_date") else ""
    note = f" ({payload['weighting_note']})" if payload.get("weighting_note") else ""
    return (f"\n## Weighting at equal wall-clock\n\n`--weighting-rounds {run['weighting_rounds']} --weighting-h "
            f"{run['weighting_h']}`{when}{note}: blocking rounds of H = 4k, 2k, k steps (the steps a time budget "
            f"gives nodes at 4×, 2×, 1×), unthrottled, so the machine's load does not enter; eval loss of φ after "
            f"the last round.\n\n{weighting_table(payload['weighting'])}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="wall-clock of training per variant")
    parser.add_argument("--round-seconds", type=float, default=6.0, help="T of the budget variants")
    parser.add_argument("--h", type=int, default=20, help="H of the fixed variants")
    parser.add_argument("--batch-h", type=int, default=10,
                        help="H of the batch variants: steps of one batch the slowest node fits in T")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"',' separated; '' for none (also: {', '.join(BATCH_VARIANTS)})")
    parser.add_argument("--weightings", default=",".join(WEIGHTINGS),
                        help="--weighting values compared at equal wall-clock (',' separated; '' for none)")
    parser.add_argument("--weighting-rounds", type=int, default=12, help="R of the weighting comparison")
    parser.add_argument("--weighting-h", type=int, default=40, help="H of the fastest node there (4k)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    results = []
    with work_dir(f"{NAME}_") as work:
        for variant in filter(None, args.variants.split(",")):
            results.append(run_variant(variant, args, work))
            print(json.dumps(results[-1]), flush=True)
        weighting = []
        for each in filter(None, args.weightings.split(",")):
            weighting.append(run_weighting(each, args, work))
            print(json.dumps(weighting[-1]), flush=True)
    payload = {"benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "args": {"seconds": args.seconds, "round_seconds": args.round_seconds, "h": args.h,
                        "batch_h": args.batch_h,
                        "weighting_rounds": args.weighting_rounds, "weighting_h": args.weighting_h},
               "machine": machine_info(), "results": results, "weighting": weighting}
    text = report(payload)
    write_results(args.out_dir, NAME, payload, text)


if __name__ == "__main__":
    main()
