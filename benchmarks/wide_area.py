"""Overlap on slow links: data-parallel vs blocking / delayed / eager DiLoCo between two islands.

Two network namespaces ("islands") joined through a hub by veth pairs, each island's access line
rate-limited with `tc tbf` (harness/islands.py). At each rate, side by side on the same link:

- raw TCP: one bulk connection, the reference for throughput;
- DDP (harness/ddp.py): gloo all-reduce of the gradients every step across the link (a fixed number of steps: its
  time per step, compute utilization and wire bytes; its eval loss at equal tokens does not depend on
  the link and comes from the same training on loopback);
- DiLoCo with --sync blocking, delayed and eager through the real CLI (and two variants that explain
  the defaults: eager with docs/architecture.md §3's literal proxy and momentum 0.9, blocking with momentum 0.6):
  wall time per round, compute utilization, eval loss at equal tokens, wire bytes (veth counters),
  the swarm's throughput while fetching payloads as a fraction of raw TCP, and how far the two
  nodes' φ ended apart.

Run as root: `.venv/bin/python benchmarks/wide_area.py` (about 20 minutes on 2 cores); results go
to benchmarks/results/wide_area.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_node.config import NodeConfig
from harness.bench import RESULTS_DIR, machine_info, pyplot, run_diloco_on_link, unwind_on_sigterm
from harness.ddp import run_ddp, run_ddp_on_link
from harness.islands import Islands, require_netns
from harness.nodes import WORLD

NAME = "wide_area"
SYNC_MODES = ("blocking", "delayed", "eager")
# DiLoCo runs at each rate: the three modes at their defaults, then the variants that explain the choice
# of defaults (docs/architecture.md §3's literal eager proxy with DiLoCo's momentum; blocking with eager's momentum).
RUNS = {"blocking": ["--sync", "blocking"], "delayed": ["--sync", "delayed"], "eager": ["--sync", "eager"],
        "eager share μ0.9": ["--sync", "eager", "--eager-proxy", "share", "--outer-momentum", "0.9"],
        "blocking μ0.6": ["--sync", "blocking", "--outer-momentum", "0.6"]}


# --- one rate ---------------------------------------------------------------------------------

def run_rate(rate: float, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with Islands(count=2, rate_mbit=rate) as islands:
        a, b = islands[0], islands[1]
        raw = statistics.median(islands.measure_tcp_mbit(a, b) for _ in range(2))
        print(f"{rate:g} Mbit/s: raw TCP {raw:.2f} Mbit/s", flush=True)
        results: list[dict[str, Any]] = [run_ddp_on_link(islands, args.ddp_steps, args.timeout)]
        print(f"  ddp: {results[-1]['seconds_per_step']:.2f} s/step, utilization {results[-1]['utilization']:.3f}",
              flush=True)
        for index, (name, options) in enumerate(RUNS.items()):
            result = run_diloco_on_link(islands, name, args.h, args.rounds, work / f"{rate:g}-{index}", args.timeout,
                                        [*options, "--compression", args.compression])
            results.append(result)
            mbit = statistics.median(result["transfer_mbit"]) if result["transfer_mbit"] else float("nan")
            print(f"  {name}: {result['seconds_per_round']:.1f} s/round, utilization {result['utilization']:.3f}, "
                  f"eval {result['final_eval_loss']:.4f}, transfer {mbit:.2f} Mbit/s "
                  f"({mbit / raw:.0%} of raw TCP), φ max |diff| {result['outer_params_difference']['max_abs']}",
                  flush=True)
        for result in results[1:]:
            result["transfer_fraction_of_raw"] = (statistics.median(result["transfer_mbit"]) / raw
                                                  if result["transfer_mbit"] else None)
    return {"rate_mbit": rate, "raw_tcp_mbit": raw, "results": results}


# --- report -----------------------------------------------------------------------------------

def markdown(payload: dict[str, Any]) -> str:
    h, rounds = payload["args"]["h"], payload["args"]["rounds"]
    ddp_loss = payload["ddp_reference"]["final_eval_loss"]
    lines = [f"2 islands, tiny model, H={h}, {rounds} rounds per node (equal tokens), codec "
             f"`{payload['args']['compression']}`; DDP: {payload['args']['ddp_steps']} steps on the link.", "",
             "| link | method | s/round | utilization | eval loss | vs blocking | wire MB/round | "
             "transfer / raw TCP | φ max abs diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rate in payload["rates"]:
        blocking = next(r for r in rate["results"] if r["method"] == "blocking")
        label = f"{rate['rate_mbit']:g} Mbit/s (raw TCP {rate['raw_tcp_mbit']:.2f})"
        for r in rate["results"]:
            if r["method"] == "ddp":
                lines.append(f"| {label} | DDP (all-reduce every step) | {r['seconds_per_step'] * h:.1f} | "
                             f"{r['utilization']:.1%} | {ddp_loss:.4f} (loopback) | "
                             f"{ddp_loss / blocking['final_eval_loss']:.3f}× | "
                             f"{r['wire_bytes_per_step'] * h / 1e6:.1f} | – | 0 |")
                continue
            fraction = r.get("transfer_fraction_of_raw")
            lines.append(
                f"| {label} | DiLoCo {r['method']} | {r['seconds_per_round']:.1f} | {r['utilization']:.1%} | "
                f"{r['final_eval_loss']:.4f} | {r['final_eval_loss'] / blocking['final_eval_loss']:.3f}× | "
                f"{r['wire_bytes_per_round'] / 1e6:.2f} | {'–' if fraction is None else f'{fraction:.0%}'} | "
                f"{r['outer_params_difference']['max_abs'] or 0:.2e} |")
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    methods = ["ddp", *SYNC_MODES]
    width = 0.8 / len(payload["rates"])
    for i, rate in enumerate(payload["rates"]):
        by_method = {r["method"]: r for r in rate["results"]}
        xs = [m + i * width for m in range(len(methods))]
        axes[0].bar(xs, [100 * by_method[m]["utilization"] for m in methods], width,
                    label=f"{rate['rate_mbit']:g} Mbit/s")
        seconds = [by_method["ddp"]["seconds_per_step"] * payload["args"]["h"]] + [
            by_method[m]["seconds_per_round"] for m in SYNC_MODES]
        axes[1].bar(xs, seconds, width, label=f"{rate['rate_mbit']:g} Mbit/s")
    for ax, title in zip(axes, ("compute utilization (%)", "wall seconds per round (H steps)"), strict=True):
        ax.set_xticks([m + width * (len(payload["rates"]) - 1) / 2 for m in range(len(methods))],
                      ["DDP", *SYNC_MODES])
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(97, color="grey", linestyle=":", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- main -------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10,100", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--h", type=int, default=100, help="inner steps per round (long enough for eager to hide "
                        "a 10 Mbit/s exchange of the fp32 tiny model)")
    parser.add_argument("--rounds", type=int, default=6, help="outer rounds per node")
    parser.add_argument("--ddp-steps", type=int, default=20, help="DDP steps timed on each link")
    parser.add_argument("--compression", default="none", help="pseudo-gradient codec of the DiLoCo runs")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per configuration")
    return parser.parse_args()


def main() -> None:
    unwind_on_sigterm()
    args = parse_args()
    if (problem := require_netns()) is not None:
        raise SystemExit(f"wide_area: {problem}")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"{NAME}_work_"))
    try:
        steps = args.h * args.rounds
        print(f"DDP eval-loss reference on loopback: {WORLD} workers x {steps} steps ...", flush=True)
        reference = run_ddp(steps, steps, NodeConfig(), args.timeout)
        rates = [run_rate(float(rate), args, work) for rate in args.rates.split(",")]
    except BaseException:
        print(f"node logs kept in {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    for rate in rates:
        for result in rate["results"]:
            for log in result.get("logs", []):
                log["warnings"] = log["warnings"][:20]
    payload = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "machine": machine_info(), "seconds": time.monotonic() - started,
               "ddp_reference": {"steps": steps, "final_eval_loss": reference["final_eval_loss"]}, "rates": rates}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{NAME}.json").write_text(json.dumps(payload, indent=1))
    table = markdown(payload)
    (args.out_dir / f"{NAME}.md").write_text(f"# Overlap on slow links\n\n{table}\n")
    plot(payload, args.out_dir / f"{NAME}.png")
    print(f"\n{table}\n\nresults in {args.out_dir}; total {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
