"""--fragments P against P = 1 at equal tokens (docs/architecture.md §15): eval loss, and the bytes a node
sends per round (its peak round and its mean). Two nodes of the real CLI on loopback; P = 1 runs R
rounds of H inner steps, P runs P·R rounds of H/P, so both train R·H steps. The bytes are each
round record's `bytes_sent` (the node's payloads and parts, state and protocol bytes of the round's
streams; DHT traffic is not in it): what one round puts on the uplink at once. The peak egress
over 1-second windows on a capped link is `benchmarks/bandwidth.py`'s (issue #30, branch uplink).

    .venv/bin/python benchmarks/fragments.py --h 40 --rounds 4 --fragments 1,4
    .venv/bin/python benchmarks/fragments.py --h 40 --rounds 4 --fragments 1,4 --extra "--compression int4"

Results: benchmarks/results/fragments[_<tag>].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.bench import RESULTS_DIR, machine_info, run_pair
from harness.nodes import final_eval_loss


def run(p: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_id = f"bench-fragments-{p}-{os.getpid()}-{int(time.time())}"
    extra = ["--fragments", str(p), "--sync", args.sync, *shlex.split(args.extra)]
    logs, wall, _ = run_pair(f"P={p}", args.h, args.rounds * p, run_id, work / f"p{p}", args.timeout,
                             checkpoint_dirs=("", ""), extra=extra)
    sent = [r["sent"] for log in logs for r in log["rounds"]]
    payloads = [r["payload"] for log in logs for r in log["rounds"]]
    return {"fragments": p, "rounds": args.rounds * p, "inner_steps_per_round": args.h / p,
            "eval_loss": statistics.fmean(final_eval_loss(log) for log in logs),
            "peak_round_bytes_sent": max(sent), "mean_round_bytes_sent": statistics.fmean(sent),
            "total_bytes_sent_per_node": sum(sent) / len(logs), "peak_payload_bytes": max(payloads),
            "wall_seconds": wall}


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = [f"# Fragments at equal tokens: H={args.h}, {args.rounds}·P rounds, 2 nodes, loopback, sync {args.sync}"
             + (f", `{args.extra}`" if args.extra else ""), "",
             "| P | rounds | eval loss | vs P=1 | peak round bytes sent | vs P=1 | mean round bytes | "
             "bytes per node | peak payload | wall s |", "|---" * 10 + "|"]
    for row in rows:
        lines.append(f"| {row['fragments']} | {row['rounds']} | {row['eval_loss']:.4f} | "
                     f"{row['eval_loss'] / base['eval_loss'] - 1:+.2%} | {row['peak_round_bytes_sent']:,} | "
                     f"{row['peak_round_bytes_sent'] / base['peak_round_bytes_sent']:.3f} | "
                     f"{row['mean_round_bytes_sent']:,.0f} | {row['total_bytes_sent_per_node']:,.0f} | "
                     f"{row['peak_payload_bytes']:,} | {row['wall_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--h", type=int, default=40, help="inner steps between two exchanges of a fragment")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of P = 1 (P runs P times as many)")
    parser.add_argument("--fragments", default="1,4", help="comma-separated P values, 1 first (the reference)")
    parser.add_argument("--sync", default="blocking", choices=("blocking", "delayed", "eager"))
    parser.add_argument("--extra", default="", help="more join flags for every node, e.g. \"--compression int4\"")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    counts = [int(p) for p in args.fragments.split(",")]
    if counts[:1] != [1] or len(counts) < 2:
        parser.error("--fragments: start with 1 (the reference) and name at least one more P")
    work = Path(tempfile.mkdtemp(prefix="fragments_"))
    rows = []
    for p in counts:
        rows.append(run(p, args, work))
        print(f"P={p}: {rows[-1]}", flush=True)
    text = report(args, rows)
    RESULTS_DIR.mkdir(exist_ok=True)
    stem = RESULTS_DIR / ("fragments" + (f"_{args.tag}" if args.tag else ""))
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows, "machine": machine_info()},
                                                    indent=1))
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
