"""NoLoCo under forged records (#28, must-hold 2; docs/architecture.md §9, NoLoCo draws): how many
rounds two honest nodes still average together when k forged records take their share of the draw.

Two honest NoLoCo nodes (`--group-size 2`, `--round-timeout 20`, tiny model on loopback) beside
tests/hostile/forger.py in mode `sybils` with k identities (never ready, exchanged round 10^6); once
the forged records are up, --rounds rounds are counted per node: rounds with a partner (group of 2),
the longest wait, re-syncs and barrier timeouts. Without the spare key an honest node draws its
honest partner with probability 1/(k + 1) and averages alone otherwise.

Run: `.venv/bin/python benchmarks/noloco_sybils.py --sybils 3 10` (~2 minutes per k on 2 cores).
Results: benchmarks/results/noloco_sybils.{json,md}.
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

NAME = "noloco_sybils"
FORGER = Path(__file__).resolve().parents[1] / "tests" / "hostile" / "forger.py"
OPTIONS = ["--inner-steps", "5", "--min-peers", "2", "--run-id", "hostile", "--round-timeout", "20",
           "--algorithm", "noloco", "--group-size", "2", "--checkpoint-dir", ""]


def measure(sybils: int, rounds: int, work: Path) -> dict[str, Any]:
    a = NodeProcess("a", [*FAST, *OPTIONS], work).start()
    b = NodeProcess("b", [*FAST, *OPTIONS, "--peer", a.wait_for_address()], work).start()
    forger = None
    try:
        a.wait_for_round(1), b.wait_for_round(1)
        forger = subprocess.Popen([sys.executable, str(FORGER), a.wait_for_address(), "hostile", "sybils",
                                   str(sybils)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert forger.stdout is not None and forger.stdout.readline().startswith("forging ")
        start = max(max(a.rounds), max(b.rounds)) + 2  # the draws count the forged records from here on
        started = time.monotonic()
        for node in (a, b):
            node.wait_for_round(start + rounds, timeout=600)
        result: dict[str, Any] = {"sybils": sybils, "rounds": rounds, "seconds": time.monotonic() - started}
        for node in (a, b):
            # a round the node skipped (a re-sync past it) averaged with nobody
            counted = [node.rounds[r] for r in range(start, start + rounds) if r in node.rounds]
            result[node.name] = {"together": sum(r.group_size >= 2 for r in counted),
                                 "max_wait": max((r.wait_seconds for r in counted), default=None)}
        log = a.log_text() + b.log_text()
        result.update(spare=log.count("matchmaking once more with"), resyncs=log.count("re-sync"),
                      timeouts=log.count("barrier timed out"))
        return result
    finally:
        a.kill()
        b.kill()
        if forger is not None:
            forger.terminate()
            forger.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sybils", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    results = []
    for sybils in args.sybils:
        with work_dir(f"{NAME}-") as work:
            results.append(measure(sybils, args.rounds, work))
    lines = ["| forged records | rounds with a partner (a, b) | longest wait (a, b) | spare matchmakings | "
             "re-syncs | barrier timeouts |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['sybils']} | {r['a']['together']}, {r['b']['together']} of {r['rounds']} | "
              f"{r['a']['max_wait']:.1f}, {r['b']['max_wait']:.1f} s | {r['spare']} | {r['resyncs']} | "
              f"{r['timeouts']} |" for r in results]
    write_results(args.out, NAME, {"when": dt.datetime.now(dt.UTC).isoformat(), "machine": machine_info(),
                                   "results": results}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
