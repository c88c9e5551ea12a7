"""What a cut link costs the swarm: three islands, one of them cut off for a while, against an uncut run.

Three nodes in three network-namespace islands (harness/islands.py, 100 Mbit/s links), blocking
DiLoCo, H = 20, a fixed number of rounds. In the "cut" run island c's link is cut after
--cut-at rounds for --cut seconds: c pauses (swarm/isolation.py), a and b go on as a pair, and when
the link is back c re-syncs and trains with them again. Side by side with an uncut run:

- the swarm's eval loss at the end (all three hold one φ under blocking) at equal rounds, and at
  equal tokens (the uncut run's loss interpolated at the tokens the cut run trained);
- tokens the swarm trained (every node's trained rounds × H × batch × sequence);
- rounds and seconds from the link's return until all three agree.

Run as root: `.venv/bin/python benchmarks/partition.py` (about 6 minutes on 2 cores); results go to
benchmarks/results/partition.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.bench import RESULTS_DIR, machine_info, pyplot, unwind_on_sigterm
from harness.islands import IslandNode, Islands, node_options, require_netns
from harness.nodes import agreed_round

NAME = "partition"
BATCH, SEQ = 8, 64  # harness/nodes.py FAST


def run(label: str, args: argparse.Namespace, cut: float, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True)
    options = ["--sync", "blocking", "--inner-steps", str(args.h), "--round-timeout", "20", "--min-peers", "3",
               "--max-outer-steps", str(args.rounds)]
    with Islands(count=3, rate_mbit=args.rate) as islands:
        nodes: list[IslandNode] = []
        for name, island in zip("abc", islands, strict=True):
            peer = ["--peer", nodes[0].wait_for_address()] if nodes else []
            # our --max-outer-steps comes after node_options' 0 (run until stopped), and the last one wins
            run_options = [*node_options(island, f"partition-{label.split()[0]}"), *options, *peer]
            nodes.append(IslandNode(name, run_options, work, island=island).start())
        a, _, c = nodes
        healed_at_round = agreed = None
        heal_seconds = None
        if cut:
            a.wait_for_round(args.cut_at, timeout=300)
            islands[2].cut()
            time.sleep(cut)
            healed_at_round, healed = max(a.rounds), time.monotonic()
            islands[2].heal()
            a.wait_until(lambda: agreed_round(nodes, healed_at_round) is not None, 300, "agreement")
            heal_seconds = time.monotonic() - healed
            agreed = agreed_round(nodes, healed_at_round)
        for node in nodes:
            assert node.process is not None
            if node.process.wait(timeout=600) != 0:
                raise RuntimeError(f"{label}: {node.name} failed\n{node.log_text()[-3000:]}")
    trained = {node.name: len(node.rounds) for node in nodes}
    return {"label": label, "cut_seconds": cut, "trained_rounds": trained,
            "tokens": sum(trained.values()) * args.h * BATCH * SEQ,
            "eval_loss_by_round": {r: log.eval_loss for r, log in sorted(a.rounds.items())},
            "final_eval_loss": a.rounds[max(a.rounds)].eval_loss,
            "final_digests_equal": len({node.rounds[max(node.rounds)].digest for node in nodes}) == 1,
            "healed_at_round": healed_at_round, "agreed_at_round": agreed, "seconds_to_agree": heal_seconds,
            "c_isolated_log_lines": c.log_text().count("isolated: no peer")}


def loss_at_tokens(result: dict[str, Any], tokens: float, tokens_per_round: float) -> float:
    """The run's eval loss interpolated at `tokens` (the swarm trains tokens_per_round each round)."""
    points = sorted((int(r) * tokens_per_round, loss) for r, loss in result["eval_loss_by_round"].items())
    for (t0, l0), (t1, l1) in zip(points, points[1:], strict=False):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return points[-1][1] if tokens > points[-1][0] else points[0][1]


def markdown(payload: dict[str, Any]) -> str:
    args, (uncut, cut) = payload["args"], payload["results"]
    lines = [f"3 islands at {args['rate']:g} Mbit/s, tiny model, blocking, H={args['h']}, {args['rounds']} rounds; "
             f"island c cut off after round {args['cut_at']} for {args['cut']:g} s.", "",
             "| run | rounds trained (a/b/c) | swarm tokens | eval loss at the end | vs uncut, equal rounds | "
             "vs uncut, equal tokens | agreed again after |", "|---|---|---|---|---|---|---|"]
    for r in (uncut, cut):
        trained = "/".join(str(v) for v in r["trained_rounds"].values())
        equal_tokens = r["final_eval_loss"] / payload["uncut_loss_at_cut_tokens"] if r is cut else 1.0
        agree = "–" if r["agreed_at_round"] is None else \
            f"{r['agreed_at_round'] - r['healed_at_round']} round(s), {r['seconds_to_agree']:.1f} s"
        lines.append(f"| {r['label']} | {trained} | {r['tokens']:,} | {r['final_eval_loss']:.4f} | "
                     f"{r['final_eval_loss'] / uncut['final_eval_loss']:.3f}× | {equal_tokens:.3f}× | {agree} |")
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in payload["results"]:
        rounds = sorted(int(k) for k in r["eval_loss_by_round"])
        ax.plot(rounds, [r["eval_loss_by_round"][str(k)] for k in rounds], label=r["label"])
    ax.set_xlabel("outer round (node a)")
    ax.set_ylabel("eval loss of φ")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    unwind_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--h", type=int, default=20)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--cut", type=float, default=60.0, help="seconds island c is cut off")
    parser.add_argument("--cut-at", type=int, default=10, help="node a's round at which the cut starts")
    args = parser.parse_args()
    if (reason := require_netns()) is not None:
        sys.exit(f"needs network namespaces (run as root): {reason}")
    with tempfile.TemporaryDirectory() as tmp:
        results = [run("uncut", args, 0.0, Path(tmp) / "uncut"), run(f"cut {args.cut:g} s", args, args.cut,
                                                                      Path(tmp) / "cut")]
    for result in results:
        result["eval_loss_by_round"] = {str(k): v for k, v in result["eval_loss_by_round"].items()}
    uncut_rate = results[0]["tokens"] / args.rounds
    payload = {"args": vars(args), "machine": machine_info(), "results": results,
               "uncut_loss_at_cut_tokens": loss_at_tokens(results[0], results[1]["tokens"], uncut_rate)}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{NAME}.json").write_text(json.dumps(payload, indent=2))
    table = markdown(payload)
    (RESULTS_DIR / f"{NAME}.md").write_text(table + "\n")
    plot(payload, RESULTS_DIR / f"{NAME}.png")
    print(table)


if __name__ == "__main__":
    main()
