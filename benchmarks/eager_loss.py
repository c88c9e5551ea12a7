"""Eager vs blocking eval loss at equal tokens, repeated: is eager's loss cost real, and how does it
depend on H? Loss does not depend on the link, so this runs on loopback (wide_area.py has the link).

    .venv/bin/python benchmarks/eager_loss.py --h 100 --rounds 6 --repeats 2
    .venv/bin/python benchmarks/eager_loss.py --h 40 --rounds 12 --repeats 2   # the demo's setting

Each repeat runs a blocking pair, then an eager pair (2 nodes of the real CLI, defaults otherwise).
A node's data order follows its random peer id, so repeats differ; the ratio eager / blocking is
given per repeat and as a mean. Under eager the two nodes' φ differ, so their eval losses are averaged.
Results: benchmarks/results/eager_loss_h<H>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, final_eval_loss, machine_info, run_pair

MODES = {"blocking": ["--sync", "blocking"], "eager": ["--sync", "eager"]}


def mean_final_eval_loss(h: int, rounds: int, mode: str, work: Path, timeout: float) -> float:
    run_id = f"bench-eager-loss-{mode}-{os.getpid()}-{int(time.time())}"
    logs, _, _ = run_pair(mode, h, rounds, run_id, work, timeout, checkpoint_dirs=("", ""), extra=MODES[mode])
    return statistics.fmean(final_eval_loss(log) for log in logs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--h", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eager_loss_"))
    repeats: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        losses = {mode: mean_final_eval_loss(args.h, args.rounds, mode, work / f"{repeat}-{mode}", args.timeout)
                  for mode in MODES}
        repeats.append({**losses, "ratio": losses["eager"] / losses["blocking"]})
        print(json.dumps(repeats[-1]), flush=True)
    ratios = [r["ratio"] for r in repeats]
    lines = [f"# Eager vs blocking, H={args.h}, {args.rounds} rounds, 2 nodes, loopback", "",
             "| repeat | blocking eval | eager eval | eager / blocking |", "|---|---|---|---|"]
    lines += [f"| {i + 1} | {r['blocking']:.4f} | {r['eager']:.4f} | {r['ratio']:.4f} |" for i, r in enumerate(repeats)]
    lines += ["", f"Mean ratio {statistics.fmean(ratios):.4f}"
              + (f" (sd {statistics.stdev(ratios):.4f})" if len(ratios) > 1 else "")]
    RESULTS_DIR.mkdir(exist_ok=True)
    stem = RESULTS_DIR / f"eager_loss_h{args.h}"
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "repeats": repeats,
                                                     "machine": machine_info()}, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
