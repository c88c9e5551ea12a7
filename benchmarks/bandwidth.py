"""Bandwidth caps: three nodes with no cap against the same three at `--upload-limit 2mbit`.

Each configuration (cap × sync mode) starts a fresh swarm of --nodes real nodes on loopback, runs
--rounds rounds of H = --inner-steps, and samples every node's wire egress (the kernel's TCP
counters of each node's libp2p daemon, DHT and headers included: telemetry/wire.py) every 0.2 s.
Reported per configuration: peak egress (the largest 1-second window of any node), mean egress
(per node, over the run from the first node's join to the last exit), compute utilization and time
per round (the nodes' round events, mean over nodes), and eval loss after the last round (mean over
nodes; every configuration trains the same tokens).

Loopback, not network-namespace islands: the caps are the node's own, so they hold on any link,
and loopback needs no root; what a 10 Mbit/s link would add (a round's exchange slower when
uncapped) is not shown. Run: `.venv/bin/python benchmarks/bandwidth.py` (defaults: the tiny model,
int8, 3 nodes, 4 rounds of H = 20; about 5 minutes on 2 cores). Results:
benchmarks/results/bandwidth.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from diloco_node.rates import format_rate, parse_rate
from diloco_node.telemetry.wire import WireMeter
from harness.bench import RESULTS_DIR, machine_info, work_dir, write_results
from harness.nodes import final_eval_loss, parse_node_log, start_swarm, stop
from harness.wire import windows

NAME = "bandwidth"
SAMPLE_SECONDS = 0.2


def run(args: argparse.Namespace, sync: str, cap: str, work: Path) -> dict[str, Any]:
    options = ["--sync", sync, "--compression", args.compression, "--model", args.model,
               "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2", "--upload-limit", cap]
    run_id = f"bandwidth-{sync}-{cap.replace('/', '')}-{int(time.time())}"
    (work / run_id).mkdir()
    nodes = start_swarm(args.nodes, args.inner_steps, args.rounds, run_id, work / run_id, 120, extra=options)
    samples: dict[str, list[tuple[float, int]]] = {node.name: [] for node in nodes}
    meters = {node.name: WireMeter(node.process.pid) for node in nodes}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for name, meter in meters.items():
                meter.sample()
                totals = meter.totals()
                if totals is not None:
                    samples[name].append((time.monotonic(), totals[0]))
            done.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for node in nodes:
            node.wait_joined(180)
        for node in nodes:
            node.wait_exit(args.rounds * 300)
    finally:
        done.set()
        sampler.join(timeout=5)
        for node in nodes:
            stop(node)
    logs = [parse_node_log(node) for node in nodes]
    peak = max(max(windows(s), default=0.0) for s in samples.values())
    mean = statistics.mean((s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]) for s in samples.values() if len(s) > 1)
    rounds = [r for log in logs for r in log["rounds"]]
    warned = any("cannot finish within a round" in line for log in logs for line in log["warnings"])
    return {"sync": sync, "cap": cap, "cap_bytes_per_second": parse_rate(cap),
            "peak_egress_bytes_per_second": peak, "mean_egress_bytes_per_second": mean,
            "utilization": statistics.mean(log["rounds"][-1]["utilization"] for log in logs),
            "round_seconds": statistics.mean(r["seconds"] for r in rounds),
            "eval_loss": statistics.mean(final_eval_loss(log) for log in logs),
            "payload_bytes": statistics.mean(r["payload"] for r in rounds),
            "planning_warning": warned}


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| sync | upload cap | peak egress (1-s window) | peak / cap | mean egress per node | utilization | "
            "s per round | eval loss | planning line |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cap = r["cap_bytes_per_second"]
        rows.append(f"| {r['sync']} | {format_rate(cap)} | {format_rate(r['peak_egress_bytes_per_second'])} | "
                    f"{r['peak_egress_bytes_per_second'] / cap:.2f} |" if cap else
                    f"| {r['sync']} | no cap | {format_rate(r['peak_egress_bytes_per_second'])} | – |")
        rows[-1] += (f" {format_rate(r['mean_egress_bytes_per_second'])} | {r['utilization']:.0%} | "
                     f"{r['round_seconds']:.1f} | {r['eval_loss']:.4f} | {'yes' if r['planning_warning'] else 'no'} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--compression", default="int8")
    parser.add_argument("--caps", default="0,2mbit", help="comma-separated --upload-limit values")
    parser.add_argument("--syncs", default="blocking,eager", help="comma-separated --sync modes")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    results = []
    with work_dir(f"{NAME}_") as work:
        for sync in args.syncs.split(","):
            for cap in args.caps.split(","):
                results.append(run(args, sync, cap, work))
                print(table(results[-1:]), flush=True)
    payload = {"benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "machine": machine_info(), "results": results}
    text = (f"# Bandwidth caps: no cap against --upload-limit ({payload['date']})\n\n{table(results)}\n\n"
            f"{args.nodes} nodes on loopback, model {args.model}, {args.compression}, {args.rounds} rounds of "
            f"H = {args.inner_steps}; egress = each node's wire bytes (kernel TCP counters of its libp2p daemon, "
            "DHT and headers included) sampled every 0.2 s. Reproduce: `.venv/bin/python benchmarks/bandwidth.py`.\n")
    write_results(args.out_dir, NAME, payload, text)


if __name__ == "__main__":
    main()
