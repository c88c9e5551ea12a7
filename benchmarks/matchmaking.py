"""How often a round forms the full group on a loaded machine (#16): two nodes sharing this
machine's cores at torch's default threads (each node tries to use every core), tiny model.

For each sync mode, one run of --rounds rounds per node; per node-round, whether the exchange the
round applied had the whole run in its group (`group_size` of the round event), and how often
hivemind's matchmaking failed (`no group formed`), a node then joined its group anyway through the
missed-group recovery (`our matchmaking failed but`), or averaged alone (`no peer averaged with us`).

Run: `.venv/bin/python benchmarks/matchmaking.py` (about 12 minutes on 2 cores); results go to
benchmarks/results/matchmaking.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from harness.bench import RESULTS_DIR, machine_info, run_pair
from harness.nodes import WORLD

NAME = "matchmaking"
SIGNS = {"failed": re.compile(r"no group formed"), "recovered": re.compile(r"our matchmaking failed but"),
         "alone": re.compile(r"no peer averaged with us")}


def measure(sync: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    extra = ["--sync", sync, "--threads", "0"]  # after node_args' --threads 1: the last one wins
    logs, wall, _ = run_pair(sync, args.h, args.rounds, f"mm-{sync}", work / sync, args.timeout, ("", ""), extra)
    # under eager and delayed a round applies an earlier round's exchange; its first has none yet
    first = 1 if sync in ("eager", "delayed") else 0
    rounds = [r for log in logs for r in log["rounds"] if r["round"] > log["joined"]["round"] + first]
    full = sum(r["group_size"] == WORLD for r in rounds)
    result = {"sync": sync, "node_rounds": len(rounds), "full_group": full,
              "full_rate": full / max(len(rounds), 1), "wall_seconds": round(wall, 1)}
    logged = [(work / sync / f"node{i}.stderr.log").read_text() for i in range(1, WORLD + 1)]
    lines = [line for text in logged for line in text.splitlines()]
    for sign, pattern in SIGNS.items():
        result[sign] = sum(bool(pattern.search(line)) for line in lines)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100, help="rounds per node (two nodes: twice the node-rounds)")
    parser.add_argument("--h", type=int, default=20, help="inner steps per round")
    parser.add_argument("--syncs", default="eager,blocking")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(sync, args, Path(tmp)) for sync in args.syncs.split(",")]
    report = {"machine": machine_info(), "rounds": args.rounds, "h": args.h, "results": results}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{NAME}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["| sync | node-rounds | full group | rate | matchmaking failed | recovered | averaged alone | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['sync']} | {r['node_rounds']} | {r['full_group']} | {100 * r['full_rate']:.1f} % | "
                     f"{r['failed']} | {r['recovered']} | {r['alone']} | {r['wall_seconds']} |")
    (RESULTS_DIR / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
