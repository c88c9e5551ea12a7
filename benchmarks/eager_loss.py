"""Eval loss of the overlapped sync modes against blocking at equal tokens, repeated: is eager's loss
cost real, how does it depend on H, and what momentum does delayed need? Loss does not depend on the
link, so this runs on loopback (wide_area.py has the link).

    .venv/bin/python benchmarks/eager_loss.py --h 100 --rounds 6 --repeats 2
    .venv/bin/python benchmarks/eager_loss.py --h 40 --rounds 12 --repeats 2   # the demo's setting
    .venv/bin/python benchmarks/eager_loss.py --modes blocking,delayed:0.9,delayed:0.6,delayed:0.3,delayed:0 --repeats 1

A mode is SYNC or SYNC:MOMENTUM (the outer momentum; without it the node's default for that sync).
Each repeat runs one pair per mode (2 nodes of the real CLI, defaults otherwise), blocking first as
the reference. A node's data order follows its random peer id, so repeats differ; each mode's ratio to
blocking is given per repeat and as a mean. Under delayed and eager the two nodes' φ may differ, so
their eval losses are averaged. Results: benchmarks/results/eager_loss_h<H>[_<syncs compared>].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.bench import RESULTS_DIR, machine_info, run_pair
from harness.nodes import final_eval_loss

DEFAULT_MODES = "blocking,eager"
REFERENCE = "blocking"


def node_flags(mode: str) -> list[str]:
    sync, _, momentum = mode.partition(":")
    return ["--sync", sync] + (["--outer-momentum", momentum] if momentum else [])


def mean_final_eval_loss(h: int, rounds: int, mode: str, work: Path, timeout: float) -> float:
    slug = re.sub(r"\W+", "-", mode)
    run_id = f"bench-sync-loss-{slug}-{os.getpid()}-{int(time.time())}"
    logs, _, _ = run_pair(mode, h, rounds, run_id, work, timeout, checkpoint_dirs=("", ""), extra=node_flags(mode))
    return statistics.fmean(final_eval_loss(log) for log in logs)


def parse_modes(text: str, parser: argparse.ArgumentParser) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for mode in modes:
        sync, _, momentum = mode.partition(":")
        if sync not in ("blocking", "delayed", "eager") or (momentum and not re.fullmatch(r"0?\.\d+|0|1", momentum)):
            parser.error(f"--modes: {mode!r} is not SYNC or SYNC:MOMENTUM (sync: blocking, delayed, eager)")
    if modes[:1] != [REFERENCE] or len(modes) < 2:
        parser.error(f"--modes: start with {REFERENCE} (the reference) and name at least one more mode")
    return modes


def report(args: argparse.Namespace, modes: list[str], repeats: list[dict[str, Any]]) -> str:
    others = modes[1:]
    lines = [f"# Sync modes vs blocking, H={args.h}, {args.rounds} rounds, 2 nodes, loopback", "",
             "| repeat | " + " | ".join(f"{m} eval" for m in modes) + " | "
             + " | ".join(f"{m} / blocking" for m in others) + " |",
             "|---" * (len(modes) + len(others) + 1) + "|"]
    for i, r in enumerate(repeats):
        lines.append(f"| {i + 1} | " + " | ".join(f"{r[m]:.4f}" for m in modes) + " | "
                     + " | ".join(f"{r[m] / r[REFERENCE]:.4f}" for m in others) + " |")
    lines.append("")
    for mode in others:
        ratios = [r[mode] / r[REFERENCE] for r in repeats]
        lines.append(f"Mean ratio {mode} / blocking {statistics.fmean(ratios):.4f}"
                     + (f" (sd {statistics.stdev(ratios):.4f})" if len(ratios) > 1 else "") + "  ")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--h", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated SYNC[:MOMENTUM], blocking first")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    modes = parse_modes(args.modes, parser)
    work = Path(tempfile.mkdtemp(prefix="eager_loss_"))
    repeats: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        losses: dict[str, float] = {}
        for mode in modes:
            losses[mode] = mean_final_eval_loss(args.h, args.rounds, mode, work / f"{repeat}-{mode}", args.timeout)
            print(f"repeat {repeat + 1} {mode}: eval loss {losses[mode]:.4f}", flush=True)
        repeats.append(losses)
    text = report(args, modes, repeats)
    RESULTS_DIR.mkdir(exist_ok=True)
    syncs = sorted({mode.partition(":")[0] for mode in modes[1:]})  # e.g. a momentum sweep of delayed
    suffix = "" if args.modes == DEFAULT_MODES else "_" + "-".join(syncs)
    stem = RESULTS_DIR / f"eager_loss_h{args.h}{suffix}"
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "repeats": repeats,
                                                     "machine": machine_info()}, indent=1))
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
