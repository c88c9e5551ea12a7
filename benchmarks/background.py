"""Background traffic: bytes on the wire while two nodes only train, beside one round's payload.

What a volunteer pays for being in a run when no pseudo-gradient is moving: presence heartbeats
(signed records stored in and read from the DHT), DHT upkeep and libp2p keep-alives. Two nodes, one
per network-namespace island (harness/islands.py, `tc tbf` at --rate Mbit/s), run a long inner
phase (H = --inner-steps, eager int4); once both have joined and --settle seconds have passed, both
islands' veth tx counters are read --window seconds apart. Reported per node: bytes per second, MB per
day, and the seconds of such traffic that weigh as much as one int4 payload of the tiny model.

Run as root: `.venv/bin/python benchmarks/background.py` (~2 minutes). Results:
benchmarks/results/background.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path

from diloco_node.commands.launch import NodeProcess
from harness.bench import RESULTS_DIR, machine_info, unwind_on_sigterm, work_dir, write_results
from harness.islands import Islands, require_netns
from harness.nodes import WORLD, node_args, start_node, stop
from harness.wire import wire_bytes

NAME = "background"


def measure(args: argparse.Namespace, work: Path) -> dict[str, float]:
    options = ["--sync", "eager", "--compression", "int4"]
    with Islands(count=WORLD, rate_mbit=args.rate) as islands:
        run_id = f"background-{int(time.time())}"
        nodes: list[NodeProcess] = [start_node("node1", node_args(args.inner_steps, 1, run_id, work / "ck1", options,
                                                                  host=islands[0].address), work,
                                               wrap=islands[0].command)]
        try:
            address = nodes[0].wait_for_address(60)
            nodes.append(start_node("node2", node_args(args.inner_steps, 1, run_id, work / "ck2", options,
                                                       host=islands[1].address) + ["--peer", address],
                                    work, wrap=islands[1].command))
            for node in nodes:
                node.wait_joined(120)
            time.sleep(args.settle)
            before, started = wire_bytes(islands), time.monotonic()
            time.sleep(args.window)
            moved, seconds = wire_bytes(islands, before), time.monotonic() - started
            if any(node.events_of("round") for node in nodes):
                raise RuntimeError("a round ended inside the window: raise --inner-steps")
        finally:
            for node in nodes:
                stop(node)
    per_node = moved / seconds / WORLD
    return {"bytes_per_second_per_node": per_node, "mb_per_day_per_node": per_node * 86400 / 1e6,
            "window_seconds": seconds}


def main() -> None:
    unwind_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="link rate in Mbit/s")
    parser.add_argument("--inner-steps", type=int, default=3000, help="long enough to outlast the window")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after both joined before measuring")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured")
    parser.add_argument("--payload-bytes", type=int, default=213_000, help="one int4 payload of the tiny model")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if (problem := require_netns()) is not None:
        raise SystemExit(f"{NAME}: {problem}")
    with work_dir(f"{NAME}_") as work:
        result = measure(args, work)
    result["payload_equivalent_seconds"] = args.payload_bytes / result["bytes_per_second_per_node"]
    payload = {"benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "machine": machine_info(), "result": result}
    text = (f"# Background traffic of an idle pair ({payload['date']})\n\n"
            "| per node | bytes/s | MB/day | seconds that weigh one int4 payload |\n|---|---|---|---|\n"
            f"| while training, nothing to exchange | {result['bytes_per_second_per_node']:,.0f} | "
            f"{result['mb_per_day_per_node']:,.0f} | {result['payload_equivalent_seconds']:.0f} |\n\n"
            f"Both islands' veth tx over {result['window_seconds']:.0f} s, {args.rate:g} Mbit/s links, eager int4, "
            "H long enough that no round ends in the window. Reproduce (root): "
            "`.venv/bin/python benchmarks/background.py`.\n")
    write_results(args.out_dir, NAME, payload, text)


if __name__ == "__main__":
    main()
