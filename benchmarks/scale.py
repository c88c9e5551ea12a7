"""Per-node traffic and round time against the swarm's size (#16): all-gather vs butterfly DiLoCo
and NoLoCo, N = 2, 4, 8, 16 real nodes on this machine's loopback, side by side in one run; then a
small cost model fitted to these points and to the wide-area islands (results/wide_area.json), and
its predictions for 100 and 1,000 peers on 10 and 100 Mbit/s links.

Every node runs blocking rounds of the tiny model; per node-round after the first (which carries
the state download of joiners) we take the payload and state bytes it sent and received (the
node's own counters), the round's seconds and its compute share (utilization). DiLoCo rounds must
end with the same digest on every node (rounds where they do not are counted, not hidden).

The cost model (seconds of a round that are not inner compute):

    each node on its own machine and link (the islands, real swarms):
        exchange = window + a + b·(N − 1) + g·(M − 1) + bytes / link rate
    all N nodes on one machine's loopback, sharing its C cores (every CPU-bound cost stretches by
    s = max(1, k·N / C), and the machine moves everyone's bytes):
        exchange = window + s·(a + b·(N − 1) + g·(M − 1)) + N·bytes / machine rate

`window` is the matchmaking time a DiLoCo group waits for latecomers (--matchmaking-time, 3 s on the
islands); a NoLoCo group stops waiting as soon as it has its target size, so 0. Here it is 2 s up
to 8 nodes and 6 s at 16: with 16 nodes sharing 2 cores, hivemind's matchmaking did not assemble
the whole run within 2 s (groups of 2 to 13, φ split, in both exchanges), so a big swarm on slow
machines needs a longer window.

b is paid per node of the run, not per member of the group: every node looks for its group under
the run's one matchmaking key and hears from every other node there, NoLoCo's pairs included. g is
paid per member M of the group (streams, lookups of their records), and `bytes` is what a node moves
each way: (M−1)·P for all-gather, 2·(M−1)/M·P for butterfly, (M−1)·P for NoLoCo (whose P carries Δ
and φ). k is how many cores a node keeps busy while it exchanges (its main process, the averager
and p2pd: the fit finds 3). a, b, g and the machine rate are fitted by least squares on relative
error for each k from 1 to 8, the k with the least error kept; the link rates are the islands'
measured raw TCP rates.

Run: `.venv/bin/python benchmarks/scale.py` (about 15 minutes on 2 cores, 8 on 16); results go to
benchmarks/results/scale.{json,md}; `--refit` fits the stored points again. The run of record is from a
16-core machine, nodes on its CPU (each node has the cores it would have at home); the 2-core run is
kept as results/scale-2cores.*: there 16 nodes want 48 busy cores of 2, rounds queue behind every
other node's scheduling, and the model misses the 16-node points by about 30 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from harness.bench import RESULTS_DIR, machine_info, run_swarm

NAME = "scale"
KINDS = {
    "allgather": ("DiLoCo all-gather", ["--exchange", "allgather"]),
    "butterfly": ("DiLoCo butterfly", ["--exchange", "butterfly"]),
    "noloco": ("NoLoCo (groups of 2)", ["--algorithm", "noloco", "--group-size", "2"]),
}
NODE_FLAGS = ["--device", "cpu", "--sync", "blocking", "--batch-size", "4", "--seq-len", "64", "--eval-batches", "1",
              "--round-timeout", "180"]
TOLERANCE = 0.20  # the model must come within this of every measured round time
ISLANDS_MATCHMAKING_TIME = 3.0  # the islands ran with the default
# The projection: a 124M-parameter model sent as int4 (0.49 B/param with zstd, docs/configuration.md's codecs table),
# and 150 s of inner compute per round (H = 500 steps at 0.3 s on one consumer GPU).
PROJECTED_PAYLOAD = 124e6 * 0.49
PROJECTED_COMPUTE = 150.0


def matchmaking_time(n: int) -> float:
    """--matchmaking-time for N nodes on this machine (see the module's docstring)."""
    return 2.0 if n <= 8 else 6.0


def window_of(kind: str, matchmaking_time: float) -> float:
    return 0.0 if kind == "noloco" else matchmaking_time


def stretch(n: int, cores: int, k: int) -> float:
    """How much slower CPU-bound work gets with `n` nodes, each keeping `k` cores busy, on `cores` cores."""
    return max(1.0, k * n / cores)


def peers_of(kind: str, n: int) -> int:
    return 1 if kind == "noloco" else n - 1


def bytes_each_way(kind: str, n: int, payload: float) -> float:
    if kind == "allgather" or kind == "noloco":
        return peers_of(kind, n) * payload
    return 2 * (n - 1) / n * payload


def measure(kind: str, n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    label, flags = KINDS[kind]
    rounds = args.noloco_rounds if kind == "noloco" else args.rounds
    logs, wall, _ = run_swarm(f"{kind}-{n}", n, args.h, rounds, f"scale-{kind}-{n}", work / f"{kind}-{n}",
                              args.timeout, checkpoint_dirs=[""] * n,
                              extra=[*NODE_FLAGS, "--matchmaking-time", str(matchmaking_time(n)), *flags])
    rows = [r for log in logs for r in log["rounds"] if r["round"] > 1]
    # DiLoCo under blocking: every node holds the same φ after every round (NoLoCo's differ by design)
    split = [] if kind == "noloco" else [
        round_ for round_ in range(2, rounds + 1)
        if len({r["digest"] for log in logs for r in log["rounds"] if r["round"] == round_}) != 1]
    median = statistics.median
    return {
        "kind": kind, "label": label, "n": n, "rounds": rounds, "node_rounds": len(rows),
        "wall_seconds": round(wall, 1),
        "window": window_of(kind, matchmaking_time(n)),
        "payload": median(r["payload"] for r in rows),
        "sent_ratio": median(r["sent"] / r["payload"] for r in rows),
        "received_ratio": median(r["received"] / r["payload"] for r in rows),
        "bytes": median(max(r["sent"], r["received"]) for r in rows),
        "round_seconds": median(r["seconds"] for r in rows),
        "compute_seconds": median(r["seconds"] * r["utilization"] for r in rows),
        "full_group_rate": sum(r["group_size"] == (2 if kind == "noloco" else n) for r in rows) / len(rows),
        "split_rounds": split,
    }


def islands() -> list[dict[str, Any]]:
    """The wide-area islands' blocking rounds (2 nodes, each behind its own tc-limited link)."""
    path = RESULTS_DIR / "wide_area.json"
    if not path.exists():
        return []
    points = []
    for rate in json.loads(path.read_text())["rates"]:
        for result in rate["results"]:
            if result.get("method") != "blocking":
                continue
            rows = [r for log in result["logs"] for r in log["rounds"] if r["round"] > 1]
            points.append({"kind": "allgather", "label": f"islands {rate['rate_mbit']:.0f} Mbit/s", "n": 2,
                           "window": ISLANDS_MATCHMAKING_TIME,
                           "link_bytes_per_second": rate["raw_tcp_mbit"] * 1e6 / 8,
                           "bytes": statistics.median(max(r["sent"], r["received"]) for r in rows),
                           "round_seconds": statistics.median(r["seconds"] for r in rows),
                           "compute_seconds": statistics.median(r["seconds"] * r["utilization"] for r in rows)})
    return points


def overheads(kind: str, n: int) -> list[float]:
    """The multipliers of a, b and g for a node of an n-node run."""
    return [1.0, n - 1.0, peers_of(kind, n)]


def terms(point: dict[str, Any], cores: int, k: int) -> tuple[list[float], float]:
    """The point's exchange time as row · (a, b, g, seconds per machine byte) + known."""
    known = point["compute_seconds"] + point["window"]
    base = overheads(point["kind"], point["n"])
    if "link_bytes_per_second" in point:  # its own link: the transfer time is known
        return [*base, 0.0], known + point["bytes"] / point["link_bytes_per_second"]
    share = stretch(point["n"], cores, k)
    return [share * value for value in base] + [point["n"] * point["bytes"]], known


def fit(points: list[dict[str, Any]], cores: int) -> dict[str, float]:
    """a, b, g, the machine's seconds per byte and k: non-negative least squares on each point's relative
    error of its round time, for each k; the k with the least squared error wins."""
    best: tuple[float, dict[str, float]] | None = None
    for k in range(1, 9):
        rows, targets = [], []
        for p in points:
            row, known = terms(p, cores, k)
            rows.append([value / p["round_seconds"] for value in row])
            targets.append(1 - known / p["round_seconds"])
        x, residual = nnls(np.array(rows), np.array(targets))
        if best is None or residual < best[0]:
            best = residual, {"a": float(x[0]), "b": float(x[1]), "g": float(x[2]),
                              "machine_seconds_per_byte": float(x[3]), "k": k, "cores": cores}
    assert best is not None
    return best[1]


def predict(model: dict[str, float], point: dict[str, Any]) -> float:
    """A measured point's round time by the model."""
    row, known = terms(point, int(model["cores"]), int(model["k"]))
    return known + float(np.dot(row, [model["a"], model["b"], model["g"], model["machine_seconds_per_byte"]]))


def project(model: dict[str, float], kind: str, n: int, mbit: float) -> dict[str, float]:
    """A round of `n` peers, each on its own `mbit` link, sending the projected payload."""
    moved = bytes_each_way(kind, n, PROJECTED_PAYLOAD * (2 if kind == "noloco" else 1))
    overhead = window_of(kind, ISLANDS_MATCHMAKING_TIME) + float(np.dot(overheads(kind, n),
                                                                        [model["a"], model["b"], model["g"]]))
    seconds = PROJECTED_COMPUTE + overhead + moved / (mbit * 1e6 / 8)
    return {"round_seconds": seconds, "gb_each_way": moved / 1e9, "utilization": PROJECTED_COMPUTE / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--rounds", type=int, default=4, help="rounds per node (the first is not measured)")
    # a NoLoCo round is a few tenths of a second, where one scheduling hiccup is a large share: more
    # of them (they cost little) steady its median
    parser.add_argument("--noloco-rounds", type=int, default=8, help="rounds per NoLoCo node")
    parser.add_argument("--h", type=int, default=5, help="inner steps per round")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--refit", action="store_true", help="fit and tabulate the points of the last run again "
                        "(results/<name>.json, on the machine that measured them) without measuring")
    # the run of record needs a core per node (16); a smaller machine's run is kept beside it, by its size
    cores = os.cpu_count() or 1
    parser.add_argument("--name", default=NAME if cores >= 16 else f"{NAME}-{cores}cores",
                        help="results/<name>.{json,md} (default: scale on 16 cores or more, else scale-<C>cores)")
    args = parser.parse_args()
    if args.refit:
        last = json.loads((RESULTS_DIR / f"{args.name}.json").read_text())
        measured, machine = last["measured"], last["machine"]
    else:
        machine = machine_info()
        measured = []
        with tempfile.TemporaryDirectory() as tmp:
            for n in args.sizes.split(","):
                for kind in args.kinds.split(","):
                    measured.append(measure(kind, int(n), args, Path(tmp)))
                    print(json.dumps(measured[-1]), flush=True)  # a long sweep shows its points as they come
    for point in measured:
        point.setdefault("window", window_of(point["kind"], matchmaking_time(point["n"])))
    wide = islands()
    model = fit(measured + wide, int(machine["nproc"]))
    for point in measured + wide:
        point["predicted_seconds"] = predict(model, point)
        point["model_error"] = point["predicted_seconds"] / point["round_seconds"] - 1
    projection = {f"{kind}:{n}:{mbit:g}": project(model, kind, n, mbit)
                  for kind in KINDS for n in (100, 1000) for mbit in (10.0, 100.0)}
    report = {"machine": machine, "args": vars(args), "measured": measured, "islands": wide,
              "model": model, "projection": projection}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    counted = {p["kind"]: p["node_rounds"] // p["n"] for p in measured}  # measured rounds per node
    lines = [f"# Scale: {counted.get('allgather', '?')} measured rounds per DiLoCo node, "
             f"{counted.get('noloco', '?')} per NoLoCo node, tiny model, H={args.h}, codec none, "
             f"loopback of one machine with {machine['nproc']} cores",
             "", "| N | exchange | sent / payload | received / payload | round s | compute s | model s | model error | "
             "full group | rounds φ split |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in measured:
        lines.append(f"| {p['n']} | {p['label']} | {p['sent_ratio']:.2f} | {p['received_ratio']:.2f} | "
                     f"{p['round_seconds']:.1f} | {p['compute_seconds']:.1f} | {p['predicted_seconds']:.1f} | "
                     f"{100 * p['model_error']:+.0f} % | {100 * p['full_group_rate']:.0f} % | "
                     f"{len(p['split_rounds'])} of {p['node_rounds'] // p['n']} |")
    for p in wide:
        lines.append(f"| 2 | {p['label']} | – | – | {p['round_seconds']:.1f} | {p['compute_seconds']:.1f} | "
                     f"{p['predicted_seconds']:.1f} | {100 * p['model_error']:+.0f} % | – | – |")
    worst = max(abs(p["model_error"]) for p in measured + wide)
    rate = ("not limiting (no byte term fitted)" if model["machine_seconds_per_byte"] <= 0
            else f"{1e-6 / model['machine_seconds_per_byte']:.0f} MB/s")
    lines += ["", f"Model: a = {model['a']:.3f} s, b = {model['b']:.4f} s per node of the run, g = {model['g']:.4f} s "
              f"per group member, k = {model['k']} busy cores per node, machine rate {rate}; worst error "
              f"{100 * worst:.0f} % "
              f"({'within' if worst <= TOLERANCE else 'OUTSIDE'} {100 * TOLERANCE:.0f} %).", "",
              f"Projection: {PROJECTED_PAYLOAD / 1e6:.0f} MB payload (124M parameters, int4), "
              f"{PROJECTED_COMPUTE:.0f} s inner compute per round, each peer on its own link.", "",
              "| peers | link | exchange | GB each way per node | round s | utilization |", "|---|---|---|---|---|---|"]
    for key, value in projection.items():
        kind, n, mbit = key.split(":")
        lines.append(f"| {int(n):,} | {mbit} Mbit/s | {KINDS[kind][0]} | {value['gb_each_way']:.2f} | "
                     f"{value['round_seconds']:,.0f} | {100 * value['utilization']:.1f} % |")
    (RESULTS_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
