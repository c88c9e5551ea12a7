"""A volunteer on a home link beside fast nodes: does it thrash, and does it slow the others?

The measure of the "slow links never thrash" requirement (docs/scale-and-networks.md, slow links):
nodes on network-namespace islands (harness/islands.py), each inner step paced to the same time
(harness/pace.py) so that only the links differ, at the node's defaults (eager and no compression
when results/slow_link.md was measured; blocking int4 since #39):

- "fast only": `--fast` nodes on `--fast-mbit` links: the fast nodes' round time without the slow one;
- "with a slow node": the same, and one more node on a `--slow-mbit` link.

Read from the nodes' own round events and warnings: the fast nodes' median round time (rounds 2..N)
and its ratio to "fast only" (the requirement: at most 1.10); the slow node's re-syncs after it
joined (the requirement: 0) and the bytes those downloads took; and the share of the fast nodes'
rounds whose group held the slow node (its contribution in the mean; the requirement: at least 80 %
of the rounds it could fit).

Run as root: `.venv/bin/python benchmarks/slow_link.py` (about 5 minutes on 2 cores); results go to
benchmarks/results/slow_link.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_node.config import FIELDS
from harness.bench import RESULTS_DIR, machine_info, run_diloco_on_link, unwind_on_sigterm, write_results
from harness.islands import Islands, require_netns

NAME = "slow_link"
RESYNC = "re-syncing"  # the round loop's warning when it downloads the run's state again (daemon/node.py)


def run(args: argparse.Namespace, slow: bool, work: Path) -> dict[str, Any]:
    nodes = args.fast + slow
    with Islands(count=nodes, rate_mbit=args.fast_mbit) as islands:
        if slow:
            islands.set_rate(islands[nodes - 1], args.slow_mbit)
        result = run_diloco_on_link(islands, "with a slow node" if slow else "fast only", args.h, args.rounds,
                                    work, args.timeout, ["--seq-len", "64", "--batch-size", "8"],
                                    nodes=nodes, step_seconds=[args.step_seconds] * nodes)
    logs = result["logs"]
    fast = [log["rounds"][1:] for log in logs[:args.fast]]
    summary: dict[str, Any] = {
        "variant": result["method"], "nodes": nodes,
        "fast_round_seconds": statistics.median(r["seconds"] for rounds in fast for r in rounds),
        "payload_bytes": statistics.median(r["payload"] for rounds in fast for r in rounds),
        "final_eval_loss": result["final_eval_loss"], "logs": logs,
    }
    if slow:
        own = logs[-1]
        summary.update({
            "slow_resyncs": sum(RESYNC in line for line in own["warnings"]),
            "slow_rounds": len(own["rounds"]),
            "slow_received_bytes": sum(r["received"] for r in own["rounds"]),
            "slow_in_group_share": sum(r["group_size"] == nodes for rounds in fast for r in rounds)
            / max(1, sum(len(rounds) for rounds in fast)),
        })
    return summary


def table(args: argparse.Namespace, alone: dict[str, Any], mixed: dict[str, Any]) -> str:
    ratio = mixed["fast_round_seconds"] / alone["fast_round_seconds"]
    return "\n".join([
        "# A slow link beside fast ones",
        "",
        f"`python benchmarks/slow_link.py --fast {args.fast} --fast-mbit {args.fast_mbit:g} --slow-mbit "
        f"{args.slow_mbit:g} --h {args.h} --rounds {args.rounds} --step-seconds {args.step_seconds:g}`, "
        f"{time.strftime('%Y-%m-%d')}: defaults (sync {FIELDS['sync'].default}, codec "
        f"{FIELDS['compression'].default}), payload "
        f"{mixed['payload_bytes'] / 1e6:.2f} MB.",
        "",
        "| measure | fast only | with a slow node | requirement |",
        "|---|---|---|---|",
        f"| fast nodes' median round (s) | {alone['fast_round_seconds']:.1f} | {mixed['fast_round_seconds']:.1f} "
        f"({ratio:.2f}x) | at most 1.10x |",
        f"| slow node's re-syncs after joining | – | {mixed['slow_resyncs']} | 0 |",
        f"| bytes the slow node received ({mixed['slow_rounds']} rounds) | – | "
        f"{mixed['slow_received_bytes'] / 1e6:.1f} MB | no state again |",
        f"| fast nodes' rounds with the slow node in the group | – | {mixed['slow_in_group_share']:.0%} | "
        "at least 80 % of those it could fit |",
        f"| eval loss at the end | {alone['final_eval_loss']:.3f} | {mixed['final_eval_loss']:.3f} | |",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", type=int, default=2, help="fast nodes")
    parser.add_argument("--fast-mbit", type=float, default=100.0)
    parser.add_argument("--slow-mbit", type=float, default=2.0)
    parser.add_argument("--h", type=int, default=50, help="inner steps per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="every node's paced inner step")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a variant may take")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    unwind_on_sigterm()
    if (problem := require_netns()) is not None:
        sys.exit(f"slow_link: {problem}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slow-link-") as work:
        alone = run(args, False, Path(work) / "alone")
        mixed = run(args, True, Path(work) / "mixed")
    write_results(args.out_dir, NAME, {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(),
                                       "seconds": time.monotonic() - started, "fast_only": alone,
                                       "with_slow": mixed}, table(args, alone, mixed))


if __name__ == "__main__":
    main()
