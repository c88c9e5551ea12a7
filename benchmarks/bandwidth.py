"""Bandwidth caps and fragments on 10 Mbit/s links: no cap against `--upload-limit 2mbit`, P = 1 against
`--fragments 4`, blocking and eager (issue #30, docs/architecture.md §14, §15).

Three real nodes, one per network-namespace island (harness/islands.py: a hub, each island's one
link shaped to 10 Mbit/s both ways by tbf). Each configuration (sync × cap × P) starts a fresh run
on the same islands. P = 1 runs R rounds of H inner steps; P runs P·R rounds (each H/P steps, one
fragment each), so every row trains the same tokens. Each island's egress is its `eth0` tx counter
(harness/wire.py: all it put on its link, DHT, records, IP/TCP headers and ACKs included), sampled
every 0.25 s.

Reported per configuration: peak egress (the largest 1-second window of any node), mean egress (per
node, from the first `joined` to the last round's end), compute utilization (Σ compute / Σ round
seconds over every node's rounds), time per round and per H inner steps (P rounds), eval loss after
the last round (after eager's settle; mean over the nodes), and each figure as a ratio to the
uncapped P = 1 row of the same sync mode.

Defaults, chosen to finish in about 30 minutes on 2 loaded cores: the `small` preset (10.9 M
parameters, the smallest ≥ 10 M), int4 (a 5.5 MB payload), sequences of 32 tokens in batches of 4,
R = 2 rounds of H = 16. Needs root (network namespaces):

    sudo .venv/bin/python benchmarks/bandwidth.py

Results: benchmarks/results/bandwidth.{json,md}. `--rows sync:cap:P,...` runs only those rows (e.g.
`--rows eager:0:1,eager:0:4`) and `--name` writes them to a file of their own.

Median 1-s egress: the median 1-second window of egress between the first join and the last round's end
(DHT, records and matchmaking: what a node sends while no payload moves), per row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from diloco_node.rates import format_rate, parse_rate
from harness.bench import RESULTS_DIR, machine_info, unwind_on_sigterm, work_dir, write_results
from harness.islands import Islands, require_netns
from harness.nodes import final_eval_loss, node_args, parse_node_log, start_node, stop
from harness.wire import WireSampler, windows

NAME = "bandwidth"
SAMPLE_SECONDS = 0.25
NODES = 3
SPREAD_LINE = "serving each payload across the round"


def run(args: argparse.Namespace, islands: Islands, sync: str, cap: str, p: int, work: Path) -> dict[str, Any]:
    rounds = args.rounds * p
    options = ["--sync", sync, "--compression", args.compression, "--model", args.model,
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--eval-batches", "2",
               "--upload-limit", cap, "--fragments", str(p), "--round-timeout", str(args.round_timeout)]
    run_id = f"bandwidth-{sync}-{cap.replace('/', '')}-p{p}-{os.getpid()}-{int(time.time())}"
    folder = work / run_id
    folder.mkdir()
    samplers = [WireSampler(island.tx_bytes, SAMPLE_SECONDS) for island in islands]
    for sampler in samplers:
        sampler.__enter__()
    nodes = []
    try:
        for index, island in enumerate(islands):
            peer = ["--peer", nodes[0].wait_for_address(120)] if nodes else []
            nodes.append(start_node(f"node{index + 1}", node_args(args.inner_steps, rounds, run_id, "", options,
                                                                  host=island.address, min_peers=NODES) + peer,
                                    folder, wrap=island.command))
        for node in nodes:
            node.wait_joined(300)
        for node in nodes:
            node.wait_exit(rounds * (args.round_timeout + 300))
    finally:
        for sampler in samplers:
            sampler.__exit__()
        for node in nodes:
            stop(node)
    logs = [parse_node_log(node) for node in nodes]
    # the pace each node chose (its planning line, once: diloco_node/swarm/spread.py)
    spread = [line.strip() for node in nodes for line in list(node.stderr_lines) if SPREAD_LINE in line]
    start = min(log["joined"]["time"] for log in logs)
    end = max((log["settled"] or log["rounds"][-1])["time"] for log in logs)
    mean = statistics.mean((s.at_or_after(end) - s.at_or_after(start)) / (end - start) for s in samplers)
    during = [rate for s in samplers for rate in windows([x for x in s.samples if start <= x[0] <= end])]
    rounds_logged = [r for log in logs for r in log["rounds"]]
    compute = sum(r["seconds"] * r["utilization"] for r in rounds_logged)
    seconds = sum(r["seconds"] for r in rounds_logged)
    warned = any("cannot finish within a round" in line for log in logs for line in log["warnings"])
    return {"sync": sync, "cap": cap, "cap_bytes_per_second": parse_rate(cap), "fragments": p, "rounds": rounds,
            "peak_egress_bytes_per_second": max(max(windows(s.samples), default=0.0) for s in samplers),
            "mean_egress_bytes_per_second": mean, "utilization": compute / seconds,
            "background_egress_bytes_per_second": statistics.median(during) if during else 0.0,
            "round_seconds": seconds / len(rounds_logged), "h_seconds": seconds / len(rounds_logged) * p,
            "eval_loss": statistics.mean(final_eval_loss(log) for log in logs),
            "eval_loss_per_node": [final_eval_loss(log) for log in logs],
            "peak_payload_bytes": max(r["payload"] for r in rounds_logged),
            "group_sizes": sorted({r["group_size"] for r in rounds_logged}),
            "planning_warning": warned, "spread_lines": spread,
            # where each node's busiest seconds fell, against its rounds: what the peak was
            "busiest": [timed_windows(s.samples, start)[:5] for s in samplers],
            "node_rounds": [[(round(r["time"] - start, 1), r["group_size"], r["seconds"]) for r in log["rounds"]]
                            for log in logs],
            "node_warnings": [[line[:240] for line in log["warnings"][:20]] for log in logs],
            "wall_seconds": end - start}


def timed_windows(samples: list[tuple[float, int]], start: float) -> list[tuple[float, float]]:
    """(seconds since `start`, bytes/s) of every 1-second window, the busiest first."""
    out, j = [], 0
    for i, (at, sent) in enumerate(samples):
        j = max(j, i)
        while j < len(samples) and samples[j][0] - at < 1.0:
            j += 1
        if j == len(samples):
            break
        out.append((round(at - start, 2), (samples[j][1] - sent) / (samples[j][0] - at)))
    return sorted(out, key=lambda window: -window[1])


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| sync | cap | P | peak egress (1-s window) | peak / cap | peak / ref | mean egress per node | "
            "mean / ref | median 1-s egress | utilization | s per round | s per H steps | / ref | eval loss | / ref | "
            "planning line |", "|---" * 16 + "|"]
    for r in results:
        ref = next((b for b in results if b["sync"] == r["sync"] and not b["cap_bytes_per_second"]
                    and b["fragments"] == 1), None)
        cap = r["cap_bytes_per_second"]

        def vs(key: str, ref: dict[str, Any] | None = ref, r: dict[str, Any] = r) -> str:
            return f"{r[key] / ref[key]:.2f}" if ref else "–"

        rows.append(f"| {r['sync']} | {format_rate(cap) if cap else 'no cap'} | {r['fragments']} | "
                    f"{format_rate(r['peak_egress_bytes_per_second'])} | "
                    f"{r['peak_egress_bytes_per_second'] / cap:.2f} |" if cap else
                    f"| {r['sync']} | no cap | {r['fragments']} | "
                    f"{format_rate(r['peak_egress_bytes_per_second'])} | – |")
        rows[-1] += (f" {vs('peak_egress_bytes_per_second')} | {format_rate(r['mean_egress_bytes_per_second'])} | "
                     f"{vs('mean_egress_bytes_per_second')} | "
                     f"{format_rate(r.get('background_egress_bytes_per_second', 0.0))} | "
                     f"{r['utilization']:.0%} | {r['round_seconds']:.1f} | "
                     f"{r['h_seconds']:.1f} | {vs('h_seconds')} | {r['eval_loss']:.4f} | {vs('eval_loss')} | "
                     f"{'yes' if r['planning_warning'] else 'no'} |")
    return "\n".join(rows)


def main() -> None:
    unwind_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of P = 1 (P runs P times as many)")
    parser.add_argument("--inner-steps", type=int, default=16, help="H: inner steps per exchange of a fragment")
    parser.add_argument("--model", default="small")
    parser.add_argument("--compression", default="int4")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--round-timeout", type=float, default=180.0)
    parser.add_argument("--link-mbit", type=float, default=10.0, help="each island's link rate, both ways")
    parser.add_argument("--caps", default="0,2mbit", help="comma-separated --upload-limit values")
    parser.add_argument("--fragments", default="1,4", help="comma-separated --fragments values")
    parser.add_argument("--syncs", default="blocking,eager", help="comma-separated --sync modes")
    parser.add_argument("--rows", default="", help="only these rows, comma-separated sync:cap:P (e.g. eager:0:4); "
                        "default: every sync × cap × P")
    parser.add_argument("--name", default=NAME, help="results file name (without .json/.md)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.rows:
        try:
            rows = [(sync, cap, int(p)) for sync, cap, p in (row.split(":") for row in args.rows.split(","))]
        except ValueError:
            parser.error(f"--rows {args.rows!r}: expected comma-separated sync:cap:P")
    else:
        rows = [(sync, cap, int(p)) for sync in args.syncs.split(",") for cap in args.caps.split(",")
                for p in args.fragments.split(",")]
    if (reason := require_netns()) is not None:
        parser.error(f"network-namespace islands are needed: {reason}")
    results = []
    with work_dir(f"{NAME}_") as work, Islands(count=NODES, rate_mbit=args.link_mbit) as islands:
        for sync, cap, p in rows:
            results.append(run(args, islands, sync, cap, p, work))
            print(table(results[-1:]), flush=True)
    payload = {"benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "machine": machine_info(), "results": results}
    text = (f"# Bandwidth caps and fragments on {args.link_mbit:g} Mbit/s islands ({payload['date']})\n\n"
            f"{table(results)}\n\n{NODES} nodes, one per network-namespace island ({args.link_mbit:g} Mbit/s tbf "
            f"links both ways), model {args.model}, {args.compression}, seq-len {args.seq_len}, batch "
            f"{args.batch_size}, {args.rounds}·P rounds of H = {args.inner_steps} (H/P steps each: equal tokens); "
            "egress = each island's eth0 tx bytes (DHT, records and headers included) sampled every "
            f"{SAMPLE_SECONDS} s; `/ ref` = ratio to the uncapped P = 1 row of the same sync. "
            f"median 1-s egress: the median 1-second window during the run (P = 1: the background, DHT and records). "
            f"Reproduce: `sudo .venv/bin/python benchmarks/bandwidth.py {' '.join(sys.argv[1:])}`.\n")
    write_results(args.out_dir, args.name, payload, text)


if __name__ == "__main__":
    main()
