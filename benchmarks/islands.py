"""Blocking vs eager on docker/compose.yaml's islands: eu (2 nodes, 50 Mbit/s uplink), us (20 Mbit/s),
ap (10 Mbit/s), on a real Docker engine, one after the other in one run.

For each sync mode the islands come up fresh (new volumes), train --rounds rounds, and we read:
- round time and compute utilization per node, from its round log lines (rounds 2..N: the first
  round includes start-up);
- bytes each region sent to the others per round, from its gateway's wide-area interface counters
  (the host's end of the veth: true wire bytes, headers included).

Run as root: `.venv/bin/python benchmarks/islands.py` (about 8 minutes on 2 cores with images
built); results go to benchmarks/results/islands.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from harness.bench import RESULTS_DIR, machine_info, unwind_on_sigterm
from harness.docker import (
    GATEWAYS,
    NODES,
    RATES_MBIT,
    WAN_ADDRESS,
    Islands,
    counters,
    ensure_base_image,
    ensure_engine,
    host_veth,
    stage_build_inputs,
)

NAME = "islands"


def measure(sync: str, args: argparse.Namespace) -> dict[str, Any]:
    islands = Islands(f"dilocobench{sync}", env={"SYNC": sync, "INNER_STEPS": str(args.h),
                                                  "COMPRESSION": args.compression, "PROMETHEUS_PORT": "19091"})
    try:
        islands.up()
        gateways = {region: host_veth(islands.container(gw), WAN_ADDRESS[gw]) for region, gw in GATEWAYS.items()}
        deadline = time.monotonic() + 900
        while min(max(islands.rounds(s), default=0) for s in NODES) < 1:
            assert time.monotonic() < deadline, "the islands never finished a round"
            time.sleep(1)
        start = {region: counters(veth)[0] for region, veth in gateways.items()}
        first = {s: max(islands.rounds(s)) for s in NODES}
        while min(max(islands.rounds(s)) - first[s] for s in NODES) < args.rounds:
            assert time.monotonic() < deadline, "the islands stalled"
            time.sleep(1)
        sent = {region: counters(veth)[0] - start[region] for region, veth in gateways.items()}
        counted = {s: max(islands.rounds(s)) - first[s] for s in NODES}
        per_node = {}
        for service in NODES:
            lines = [line for r, line in islands.rounds(service).items() if r > first[service]]
            per_node[service] = {"round_seconds": statistics.mean(line.seconds for line in lines),
                                 "utilization": statistics.mean(line.utilization for line in lines),
                                 "full_group_rounds": sum(line.group_size == len(NODES) for line in lines),
                                 "rounds": len(lines)}
        rounds = statistics.mean(counted.values())
        return {"sync": sync, "nodes": per_node,
                "round_seconds": statistics.mean(n["round_seconds"] for n in per_node.values()),
                "utilization": statistics.mean(n["utilization"] for n in per_node.values()),
                "region_bytes_per_round": {region: sent[region] / rounds for region in sent}}
    finally:
        islands.down()


def main() -> None:
    unwind_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--h", type=int, default=20, help="inner steps per round")
    parser.add_argument("--compression", default="int8")
    args = parser.parse_args()
    ensure_engine()
    ensure_base_image()
    stage_build_inputs()
    builder = Islands("dilocobenchbuild")
    builder.build()
    results = [measure(sync, args) for sync in ("blocking", "eager")]
    blocking, eager = results
    report = {"machine": machine_info(), "rates_mbit": RATES_MBIT, "h": args.h, "compression": args.compression,
              "rounds": args.rounds, "build_seconds": builder.build_seconds, "results": results,
              "eager_vs_blocking": {"round_seconds": eager["round_seconds"] / blocking["round_seconds"],
                                    "utilization": eager["utilization"] / blocking["utilization"]}}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{NAME}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"Islands (docker/compose.yaml): eu 2 nodes @ {RATES_MBIT['eu']:.0f} Mbit/s, us @ {RATES_MBIT['us']:.0f}, "
             f"ap @ {RATES_MBIT['ap']:.0f}; H = {args.h}, {args.compression}, {args.rounds} rounds per mode",
             "", "| sync | round s | utilization | eu B/round | us B/round | ap B/round | full-group rounds |",
             "|---|---|---|---|---|---|---|"]
    for result in results:
        regions = result["region_bytes_per_round"]
        full = sum(n["full_group_rounds"] for n in result["nodes"].values())
        total = sum(n["rounds"] for n in result["nodes"].values())
        lines.append(f"| {result['sync']} | {result['round_seconds']:.1f} | {result['utilization']:.2f} | "
                     f"{regions['eu']:,.0f} | {regions['us']:,.0f} | {regions['ap']:,.0f} | {full}/{total} |")
    ratio = report["eager_vs_blocking"]
    lines += ["", f"eager / blocking: round time {ratio['round_seconds']:.2f}x, "
                  f"utilization {ratio['utilization']:.2f}x"]
    (RESULTS_DIR / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
