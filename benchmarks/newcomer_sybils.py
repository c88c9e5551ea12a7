"""Fresh identities taking a node's state (#28, must-hold 2 (b); docs/architecture.md §9): each is
a newcomer the barrier may wait for, and one that never gets ready used to buy a newcomer grace
(half the round timeout) per identity.

Two honest DiLoCo nodes (`--round-timeout 20`, tiny model on loopback) beside
tests/hostile/forger.py in mode `sybils` with k identities (never ready, exchanged round 10^6), of
which t take a's state, one every `--spacing` seconds (rounds apart); for `--seconds` after the
forged records are up, per node: rounds, newcomer graces waited out, rounds that waited longer
than a matchmaking window, the longest wait, re-syncs and barrier timeouts.

Run: `.venv/bin/python benchmarks/newcomer_sybils.py --sybils 3 --takers 3` (~2 minutes on 2 cores).
Results: benchmarks/results/newcomer_sybils.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from diloco_node.commands.launch import NodeProcess
from harness.bench import RESULTS_DIR, machine_info, work_dir, write_results
from harness.nodes import FAST

NAME = "newcomer_sybils"
FORGER = Path(__file__).resolve().parents[1] / "tests" / "hostile" / "forger.py"
OPTIONS = ["--inner-steps", "5", "--min-peers", "2", "--run-id", "hostile", "--round-timeout", "20",
           "--checkpoint-dir", ""]
WINDOW = 4 * 3.0  # 4 default matchmaking windows: a round waiting longer held for someone


def measure(sybils: int, takers: int, spacing: float, seconds: float, work: Path) -> dict[str, Any]:
    a = NodeProcess("a", [*FAST, *OPTIONS], work).start()
    b = NodeProcess("b", [*FAST, *OPTIONS, "--peer", a.wait_for_address()], work).start()
    forger = None
    try:
        a.wait_for_round(1), b.wait_for_round(1)
        since = {node.name: (len(node.stderr_lines), max(node.rounds)) for node in (a, b)}
        forger = subprocess.Popen([sys.executable, str(FORGER), a.wait_for_address(), "hostile", "sybils",
                                   str(sybils), str(takers), str(spacing)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert forger.stdout is not None and forger.stdout.readline().startswith("forging ")
        time.sleep(seconds)
        result: dict[str, Any] = {"sybils": sybils, "takers": takers, "spacing": spacing, "seconds": seconds}
        for node in (a, b):
            lines, first = since[node.name]
            log = "".join(node.stderr_lines[lines:])
            waits = [r.wait_seconds for r in node.rounds.values() if r.round > first]
            result[node.name] = {"rounds": len(waits), "graces": log.count("not waiting longer for newcomer"),
                                 "long": sum(w > WINDOW for w in waits), "max_wait": max(waits, default=0.0),
                                 "resyncs": log.count("re-sync"), "timeouts": log.count("barrier timed out")}
        return result
    finally:
        a.kill()
        b.kill()
        if forger is not None:
            forger.terminate()
            forger.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sybils", type=int, default=3)
    parser.add_argument("--takers", type=int, default=3)
    parser.add_argument("--spacing", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    with work_dir(f"{NAME}-") as work:
        result = measure(args.sybils, args.takers, args.spacing, args.seconds, work)
    lines = ["| node | rounds | newcomer graces waited out | rounds waiting > 12 s | longest wait | re-syncs | "
             "barrier timeouts |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {name} | {r['rounds']} | {r['graces']} | {r['long']} | {r['max_wait']:.1f} s | {r['resyncs']} | "
              f"{r['timeouts']} |" for name, r in ((n, result[n]) for n in ("a", "b"))]
    print("\n".join(lines))
    write_results(args.out, NAME, {"when": dt.datetime.now(dt.UTC).isoformat(), "machine": machine_info(),
                                   "result": result}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
