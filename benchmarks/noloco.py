"""NoLoCo against DiLoCo through the real CLI, side by side in one run.

    .venv/bin/python benchmarks/noloco.py            # ~14 min on 2 CPU cores
    .venv/bin/python benchmarks/noloco.py --quick    # smoke test, ~3 min, results in a temp folder

Every run is a swarm of `diloco-node join` processes on loopback (`--threads 1`, no checkpoints,
`--min-peers N`, a run id of its own, `--seq-len 64 --batch-size 8 --eval-batches 4`, the tiny
model), started by harness.bench.run_swarm; everything is read from the nodes' events (`round`, JSON).

(A) Equal tokens, 4 nodes: `--algorithm diloco` and `--algorithm noloco` (random groups of at most
    `--group-size 2`) with the same H and number of rounds, under `--compression none` and `int8`.
    Per configuration: eval loss after every round on every node (NoLoCo's replicas differ by
    design, so mean, min and max over the nodes), bytes a node sent per round (`sent`: everything it
    put on the swarm; `payload`: its own encoded contribution — under NoLoCo Δ through the codec plus
    φ, fp32 under `none` and fp16 otherwise), round seconds, the seconds of each round spent waiting
    on the swarm (seconds × (1 − utilization)), and NoLoCo's consensus distance ‖φ − φ̄‖ / ‖φ̄‖.
(B) Synchronization time versus swarm size: both algorithms at 2, 4 and 8 nodes, a short run each
    (codec `none`), interleaved so that the machine's state drifts alike for both. The figure is the
    mean wait per node per round, round 1 left out (it also absorbs the nodes' start-up skew). A third
    series, DiLoCo with `--matchmaking-time 1` (default 3 s), shows how much of DiLoCo's wait is the
    matchmaking window: a DiLoCo node matchmakes with no target group size, so its group closes
    when the window ends; a NoLoCo group closes as soon as its members are in.

Caveat: all nodes share one machine (2 CPU cores on the reference box), so with 4 or 8 nodes they
compete for CPU: round time is dominated by compute, and wait time includes waiting for partners
that were descheduled, not only for the network. Wait time is still the figure that separates the
algorithms — a DiLoCo node waits for the slowest node of the swarm, a NoLoCo node for its group.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_node.commands.launch import read_events
from diloco_node.swarm.groups import random_groups
from harness.bench import RESULTS_DIR, StartupStalled, machine_info, pyplot, run_swarm
from harness.nodes import BLOCKING_FLAGS, PUBLISHED_OUTER

NAME = "noloco"
ALGORITHMS = ("diloco", "noloco")
# Small settings so that 8 single-threaded node processes fit on 2 cores.
NODE_FLAGS = ["--seq-len", "64", "--batch-size", "8", "--eval-batches", "4"]
TOKENS_PER_STEP = 8 * 64  # NODE_FLAGS' batch size × sequence length
GROUP_SIZE = 2
START_ATTEMPTS = 2  # a swarm that never joins is stopped and started again, once
# hivemind's own log lines (its format: `Mon DD HH:MM:SS.mmm [LEVEL] [module...] message`) and ours
OTHER_WARNING_RE = re.compile(r"\[(WARN|WARNING|ERROR|CRITICAL)\] \[([\w.]+)")


def join_timeout(n: int) -> float:
    """Seconds for all n nodes to log `joined`; 2-4 nodes take 10-30 s on 2 cores, 8 nodes longer."""
    return 60.0 + 15.0 * n


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


# --- running ----------------------------------------------------------------------------------

def read_extras(work: Path, n: int) -> dict[str, Any]:
    """What parse_node_log does not keep: peer ids (from the `joined` events), NoLoCo's consensus
    distance and group per round (from the `round` events), and hivemind's warnings and errors (log
    lines, which parse_node_log's warning pattern does not match)."""
    peer_ids, gossip, hivemind = [], [], []
    for i in range(1, n + 1):
        events = read_events(work / f"node{i}.stdout.log")
        joined = next((e for e in events if e["event"] == "joined"), None)
        peer_ids.append(joined["peer_id"] if joined else None)
        gossip.append({str(e["round"]): {"consensus_distance": e.get("consensus_distance"), "group": list(e["group"])}
                       for e in events if e["event"] == "round" and "group" in e})
        lines = [line for line in (work / f"node{i}.stderr.log").read_text().splitlines()
                 if OTHER_WARNING_RE.search(line)]
        hivemind.append({"count": len(lines), "first": lines[:10]})
    return {"peer_ids": peer_ids, "gossip": gossip, "hivemind": hivemind}


def run_config(label: str, series: str, algorithm: str, codec: str, n: int, h: int, rounds: int, work: Path,
               timeout: float, flags: list[str]) -> dict[str, Any]:
    """One n-node run; a swarm that stalls before joining is recorded and started once more."""
    stalled = []
    # Both blocking, at DiLoCo's published step: the wait is then the synchronization itself (eager
    # would hide it behind the next round, and NoLoCo has no overlapped mode).
    extra = ["--algorithm", algorithm, "--compression", codec, *BLOCKING_FLAGS, *PUBLISHED_OUTER, *NODE_FLAGS, *flags]
    if algorithm == "noloco":
        extra += ["--group-size", str(GROUP_SIZE)]
    for attempt in range(1, START_ATTEMPTS + 1):
        slug = re.sub(r"[^\w-]+", "-", label).strip("-")
        run_id = f"bench-noloco-{slug}-{os.getpid()}-{int(time.time())}"
        folder = work / slug / f"attempt{attempt}"
        try:
            logs, wall, lo_node = run_swarm(label, n, h, rounds, run_id, folder, timeout,
                                            checkpoint_dirs=[""] * n, extra=extra, join_timeout=join_timeout(n))
        except StartupStalled as exc:
            print(f"  {label}: the nodes did not all join within {join_timeout(n):.0f}s (attempt {attempt}); "
                  f"logs in {folder}", file=sys.stderr, flush=True)
            stalled.append({"attempt": attempt, "run_id": run_id, "error": str(exc).splitlines()[0],
                            "stdout": {p.stem.split(".")[0]: p.read_text().splitlines()[-3:]
                                       for p in sorted(folder.glob("*.stdout.log"))}})
            if attempt == START_ATTEMPTS:
                raise
            continue
        extras = read_extras(folder, n)
        for log, gossip in zip(logs, extras["gossip"], strict=True):
            for r in log["rounds"]:
                r.update(gossip.get(str(r["round"]), {}))
        raw = {"label": label, "series": series, "algorithm": algorithm, "codec": codec, "flags": flags,
               "nodes": n, "H": h, "rounds": rounds, "run_id": run_id, "wall_seconds": wall,
               "lo_bytes_per_node_upper_bound": lo_node,
               "peer_ids": extras["peer_ids"], "hivemind_warnings": extras["hivemind"], "stalled_starts": stalled,
               "logs": logs}
        return summarize(raw)
    raise AssertionError("unreachable")


# --- numbers ----------------------------------------------------------------------------------

def group_mismatches(res: dict[str, Any]) -> list[str]:
    """NoLoCo: rounds where two nodes disagree on their group (A lists B, B's group differs)."""
    ids = res["peer_ids"]
    by_round: dict[int, dict[str, set[str]]] = {}
    for pid, log in zip(ids, res["logs"], strict=True):
        for r in log["rounds"]:
            if pid is not None and "group" in r:
                by_round.setdefault(r["round"], {})[pid] = set(r["group"])
    out = []
    for rnd, groups in sorted(by_round.items()):
        for pid, group in groups.items():
            for other in group - {pid}:
                if other in groups and groups[other] != group:
                    out.append(f"round {rnd}: node{ids.index(pid) + 1} has group of {len(group)}, "
                               f"node{ids.index(other) + 1} (in it) has one of {len(groups[other])}")
    return out


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Derived numbers of one run, from its raw parsed logs alone (so --report-only can redo them)."""
    logs, n = raw["logs"], raw["nodes"]
    params = logs[0]["joined"]["parameters"]
    steady = [r for log in logs for r in log["rounds"] if r["round"] >= 2] or \
        [r for log in logs for r in log["rounds"]]
    every = [r for log in logs for r in log["rounds"]]
    final = [log["rounds"][-1] for log in logs]
    max_round = max(r["round"] for r in every)
    curve = []
    for rnd in range(1, max_round + 1):
        values = [r["eval_loss"] for log in logs for r in log["rounds"] if r["round"] == rnd]
        distances = [r["consensus_distance"] for log in logs for r in log["rounds"]
                     if r["round"] == rnd and r.get("consensus_distance") is not None]
        if values:
            curve.append({"round": rnd, "eval_loss_mean": mean(values), "eval_loss_min": min(values),
                          "eval_loss_max": max(values),
                          "consensus_distance_mean": mean(distances) if distances else None})
    for r in every:
        r["wait_seconds"] = r["seconds"] * (1 - r.get("utilization", 1.0))
    distances = [r["consensus_distance"] for r in every if r.get("consensus_distance") is not None]
    last_distances = [f["consensus_distance"] for f in final if f.get("consensus_distance") is not None]
    expected_group = n if raw["algorithm"] == "diloco" else min(GROUP_SIZE, n)
    group_sizes: dict[str, int] = {}
    for r in every:
        group_sizes[str(r["group_size"])] = group_sizes.get(str(r["group_size"]), 0) + 1
    tokens_per_step = TOKENS_PER_STEP
    return {
        **raw, "parameters": params,
        "rounds_per_node": [len(log["rounds"]) for log in logs],
        "tokens_per_node": [len(log["rounds"]) * raw["H"] * tokens_per_step for log in logs],
        "initial_eval_loss": logs[0]["joined"]["eval_loss"],
        "final_eval_loss_per_node": [f["eval_loss"] for f in final],
        "final_eval_loss_mean": mean([f["eval_loss"] for f in final]),
        "final_eval_loss_min": min(f["eval_loss"] for f in final),
        "final_eval_loss_max": max(f["eval_loss"] for f in final),
        "final_digests": len({f["digest"] for f in final}),
        "curve": curve,
        # Round 1 is left out of the per-round byte and time figures: a joiner's state download (φ and the
        # outer state, served by node 1) lands in round 1's `sent`, and round 1's wait absorbs start-up skew.
        "sent_per_node_round": mean([r["sent"] for r in steady]),
        "received_per_node_round": mean([r["received"] for r in steady]),
        "payload_per_node_round": mean([r.get("payload", 0) for r in steady]),
        "bytes_per_param": statistics.median(r.get("bytes_per_param", 0.0) for r in steady),
        "sent_per_param": mean([r["sent"] for r in steady]) / params,
        "sent_total_per_node": [sum(r["sent"] for r in log["rounds"]) for log in logs],
        "round_seconds": mean([r["seconds"] for r in steady]),
        "wait_seconds": mean([r["wait_seconds"] for r in steady]),
        "wait_seconds_max": max((r["wait_seconds"] for r in steady), default=float("nan")),
        "compute_seconds": mean([r["seconds"] - r["wait_seconds"] for r in steady]),
        "transfer_seconds": mean([r.get("transfer_seconds", 0.0) for r in steady]),
        "group_sizes": group_sizes,
        "short_group_rounds": sum(1 for r in every if r["group_size"] < expected_group),
        "lonely_rounds": sum(1 for r in every if r["group_size"] <= 1),
        "consensus_distance_max": max(distances) if distances else None,
        "consensus_distance_last": mean(last_distances) if last_distances else None,
        "group_mismatches": group_mismatches(raw) if raw["algorithm"] == "noloco" else [],
        "warnings": sum(len(log["warnings"]) for log in logs),
        "hivemind_warning_count": sum(h["count"] for h in raw["hivemind_warnings"]),
    }


# --- report -----------------------------------------------------------------------------------

def fmt_distance(value: float | None) -> str:
    return "–" if value is None else f"{value:.2e}"


def part_a_markdown(payload: dict[str, Any]) -> str:
    results = payload["part_a"]
    base = {res["codec"]: res for res in results if res["algorithm"] == "diloco"}
    rows = ["| config | final eval loss (mean over nodes) | min / max over nodes | vs diloco, same codec "
            "| sent B/node/round | received B/node/round | payload B/param | sent B/param | round s | wait s "
            "| consensus distance max / last |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        ref = base.get(res["codec"])
        ratio = f"{res['final_eval_loss_mean'] / ref['final_eval_loss_mean']:.4f}" if ref else "–"
        rows.append(
            f"| {res['label']} | {res['final_eval_loss_mean']:.4f} | {res['final_eval_loss_min']:.4f} / "
            f"{res['final_eval_loss_max']:.4f} | {ratio} | {res['sent_per_node_round']:,.0f} | "
            f"{res['received_per_node_round']:,.0f} | {res['bytes_per_param']:.3f} | {res['sent_per_param']:.3f} | "
            f"{res['round_seconds']:.2f} | {res['wait_seconds']:.2f} | "
            f"{fmt_distance(res['consensus_distance_max'])} / {fmt_distance(res['consensus_distance_last'])} |")
    return "\n".join(rows)


def part_b_markdown(payload: dict[str, Any]) -> str:
    series = list(dict.fromkeys(res["series"] for res in payload["part_b"]))
    by = {(res["series"], res["nodes"]): res for res in payload["part_b"]}
    sizes = sorted({res["nodes"] for res in payload["part_b"]})
    rows = ["| nodes | " + " | ".join(f"{s} wait s/round" for s in series) + " | noloco / diloco wait | "
            + " | ".join(f"{s} max wait s" for s in series) + " | "
            + " | ".join(f"{s} round s" for s in series) + " | "
            + " | ".join(f"{s} group sizes" for s in series) + " |",
            "|---" * (2 + 4 * len(series)) + "|"]
    for n in sizes:
        runs = [by.get((s, n)) for s in series]

        def cells(key: str, runs: list[dict[str, Any] | None] = runs) -> str:
            return " | ".join(f"{res[key]:.2f}" if res else "–" for res in runs)

        d, g = by.get(("diloco", n)), by.get(("noloco", n))
        ratio = f"{g['wait_seconds'] / d['wait_seconds']:.2f}" if d and g and d["wait_seconds"] > 0 else "–"
        groups = " | ".join(", ".join(f"{k}×{v}" for k, v in sorted(res["group_sizes"].items())) if res else "–"
                            for res in runs)
        rows.append(f"| {n} | {cells('wait_seconds')} | {ratio} | {cells('wait_seconds_max')} | "
                    f"{cells('round_seconds')} | {groups} |")
    return "\n".join(rows)


def warning_kinds(messages: Any) -> str:
    """Distinct messages with their counts, round numbers and peer ids blanked: `msg` ×k; ..."""
    counts: dict[str, int] = {}
    for message in messages:
        kind = re.sub(r"\b(round|peer)=\S+", r"\1=…", message.strip())
        counts[kind] = counts.get(kind, 0) + 1
    return "; ".join(f"`{kind}` ×{k}" for kind, k in counts.items())


def short_group_details(res: dict[str, Any]) -> list[str]:
    """Per round with a short group: who, how long they and the rest waited, the next round's longest wait,
    and under NoLoCo the partner each lonely node was drawn with from the full swarm (random_groups over
    every node's peer id, the node's 0-based round) and whom that partner averaged with instead."""
    ids, n = res["peer_ids"], res["nodes"]
    expected = n if res["algorithm"] == "diloco" else min(GROUP_SIZE, n)
    rounds: dict[int, dict[int, dict[str, Any]]] = {}
    for i, log in enumerate(res["logs"], start=1):
        for r in log["rounds"]:
            rounds.setdefault(r["round"], {})[i] = r
    out = []
    for rnd, by_node in sorted(rounds.items()):
        short = {i: r for i, r in by_node.items() if r["group_size"] < expected}
        if not short:
            continue
        nxt = rounds.get(rnd + 1, {})
        text = (f"round {rnd}: " + ", ".join(f"node{i} in a group of {r['group_size']} (waited "
                                               f"{r['wait_seconds']:.1f} s)" for i, r in short.items())
                + f"; longest wait of the round {max(r['wait_seconds'] for r in by_node.values()):.1f} s"
                + (f", of the next round {max(r['wait_seconds'] for r in nxt.values()):.1f} s" if nxt else ""))
        if res["algorithm"] == "noloco" and None not in ids:
            drawn = random_groups(ids, res["run_id"], rnd - 1, GROUP_SIZE)
            for i in short:
                mates = [ids.index(p) + 1 for g in drawn if ids[i - 1] in g for p in g if p != ids[i - 1]]
                for mate in mates:
                    actual = by_node.get(mate, {}).get("group")
                    got = "did not log the round" if actual is None else "averaged with " + (
                        ", ".join(f"node{ids.index(p) + 1}" for p in actual if p != ids[mate - 1] and p in ids)
                        or "nobody")
                    text += f"; node{i} was drawn with node{mate} (all {n} nodes in view), which {got}"
        out.append(text)
    return out


def problems(payload: dict[str, Any]) -> str:
    """What the nodes did that a healthy run would not: stalls, short or lonely groups, warnings."""
    lines = []
    for res in payload["part_a"] + payload["part_b"]:
        label = res["label"]
        for stall in res.get("stalled_starts", []):
            last = "; ".join(f"{node} '{(out or ['(nothing)'])[-1]}'" for node, out in stall["stdout"].items())
            lines.append(f"{label}: start attempt {stall['attempt']} stalled ({stall['error']}); last stdout lines: "
                         f"{last} (the swarm was stopped and started again).")
        if any(k != res["rounds"] for k in res["rounds_per_node"]):
            lines.append(f"{label}: rounds logged per node {res['rounds_per_node']}, not {res['rounds']}.")
        if res["algorithm"] == "diloco" and res["final_digests"] != 1:
            lines.append(f"{label}: the nodes ended with {res['final_digests']} different φ (DiLoCo should have one).")
        if res["short_group_rounds"]:
            expected = res["nodes"] if res["algorithm"] == "diloco" else min(GROUP_SIZE, res["nodes"])
            sizes = ", ".join(f"size {k}: {v}" for k, v in sorted(res["group_sizes"].items()))
            alone = [r["wait_seconds"] for log in res["logs"] for r in log["rounds"] if r["group_size"] <= 1]
            odd = " — N is odd, so one node per round is drawn alone by design" \
                if res["algorithm"] == "noloco" and res["nodes"] % GROUP_SIZE else ""
            lines.append(f"{label}: {res['short_group_rounds']} of {sum(res['rounds_per_node'])} node-rounds had "
                         f"a group smaller than {expected} ({sizes}; {res['lonely_rounds']} alone{odd})"
                         + (f"; a round alone waited {mean(alone):.1f} s on average." if alone else ".")
                         + "".join(f"\n  - {line}" for line in short_group_details(res)))
        if res["group_mismatches"]:
            lines.append(f"{label}: nodes disagreed on their group in {len(res['group_mismatches'])} case(s), e.g. "
                         f"{'; '.join(res['group_mismatches'][:3])}.")
        if res["warnings"]:
            kinds = warning_kinds(w.split(" WARN", 1)[-1] for log in res["logs"] for w in log["warnings"])
            lines.append(f"{label}: {res['warnings']} diloco_node warning(s): {kinds}")
        if res["hivemind_warning_count"]:
            kinds = warning_kinds(line.split("] ", 1)[-1] for h in res["hivemind_warnings"] for line in h["first"])
            lines.append(f"{label}: {res['hivemind_warning_count']} hivemind warning/error line(s): {kinds}")
    return "\n".join(f"- {line}" for line in lines) if lines else "None seen: every swarm joined, every round " \
        "formed full groups, no warnings, DiLoCo's replicas ended bit-identical."


def notes(payload: dict[str, Any]) -> str:
    cfg, a = payload["config"], payload["part_a"]
    params = a[0]["parameters"] if a else payload["part_b"][0]["parameters"]
    lines = [
        f"Model `tiny` ({params:,} parameters), seq len 64, batch 8, eval on 4 held-out batches, `--threads 1`, "
        f"all nodes of the real CLI on loopback on one machine ({payload['machine']['nproc']} CPU cores).",
        f"Part A: {cfg['part_a']['nodes']} nodes, H = {cfg['part_a']['H']}, {cfg['part_a']['rounds']} rounds: "
        f"{cfg['part_a']['H'] * cfg['part_a']['rounds'] * TOKENS_PER_STEP:,} tokens per node in every configuration "
        f"(equal tokens: {cfg['part_a']['equal_tokens']}). NoLoCo: `--group-size {GROUP_SIZE}`, α/β/γ at their "
        "defaults; DiLoCo: outer lr 0.7, Nesterov momentum 0.9. Both with `--sync blocking`, so the wait is the "
        "synchronization itself (eager would overlap it with the next round).",
        "`sent` / `received` are all the bytes a node put on / took from the swarm in a round; `payload` is its own "
        "encoded contribution (NoLoCo: Δ through the codec, then φ in fp32 under `none` and fp16 otherwise). Under "
        "DiLoCo the group's payloads are all-gathered, so a node sends its payload to each of the N − 1 others; "
        "under NoLoCo only to its partner. Per-round bytes and times leave out round 1 (a joiner's state download "
        "and start-up skew land there).",
        "Wait = seconds × (1 − utilization), per node per round: time a node spent on the exchange (matchmaking, "
        "waiting for the group, transfer) instead of computing.",
        f"Part B: H = {cfg['part_b']['H']}, {cfg['part_b']['rounds']} rounds, codec `none`, rounds 2.. only. "
        "Caveat: every node shares the same CPU cores, so at 4 and 8 nodes compute slows down with N and a node's "
        "wait includes time its partners were descheduled; on separate machines the compute would not grow with N. "
        "The comparison between the algorithms at the same N is the meaningful figure, not the absolute seconds.",
        "A DiLoCo exchange waits at least `--matchmaking-time` (3 s by default): the node matchmakes through "
        "hivemind with no target group size (swarm/member.py), so the group closes only when "
        "the window ends; NoLoCo passes its group size as the target, so a pair closes as soon as both members are "
        "in. The `diloco mm=…` series of part B shows how much of DiLoCo's wait is that window.",
        "NoLoCo's replicas differ by design: its eval loss is given as the mean over nodes with min / max; the "
        "consensus distance is ‖φ − φ̄‖ / ‖φ̄‖ against the node's last group, as the node logs it.",
    ]
    for res in payload["part_a"] + payload["part_b"]:
        lines.append(f"{res['label']}: wall {res['wall_seconds']:.0f} s, rounds per node {res['rounds_per_node']}, "
                     f"compute {res['compute_seconds']:.2f} s/round, transfer {res['transfer_seconds']:.3f} s/round, "
                     f"final φ digests {res['final_digests']}, group sizes {res['group_sizes']}.")
    return "\n".join(f"- {line}" for line in lines)


def plot(payload: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for res in payload["part_a"]:
        rounds = [0] + [p["round"] for p in res["curve"]]
        style = {"linestyle": "--"} if res["codec"] != "none" else {}
        line, = left.plot(rounds, [res["initial_eval_loss"]] + [p["eval_loss_mean"] for p in res["curve"]],
                          marker="o", markersize=3, label=res["label"], **style)
        if res["algorithm"] == "noloco":
            left.fill_between(rounds[1:], [p["eval_loss_min"] for p in res["curve"]],
                              [p["eval_loss_max"] for p in res["curve"]], color=line.get_color(), alpha=0.2)
    a = payload["config"]["part_a"]
    left.set_xlabel(f"outer round (H = {a['H']} inner steps, {a['nodes']} nodes; equal tokens per round)")
    left.set_ylabel("held-out eval loss (nats/byte)")
    left.set_title(f"(A) eval loss vs round, {a['nodes']} nodes (NoLoCo: mean, band = min–max over nodes)")
    left.xaxis.get_major_locator().set_params(integer=True)
    left.legend()
    for series in dict.fromkeys(r["series"] for r in payload["part_b"]):
        runs = sorted((r for r in payload["part_b"] if r["series"] == series), key=lambda r: r["nodes"])
        right.errorbar([r["nodes"] for r in runs], [r["wait_seconds"] for r in runs],
                       yerr=[[0] * len(runs), [r["wait_seconds_max"] - r["wait_seconds"] for r in runs]],
                       marker="o", capsize=3, label=f"{series} (mean; bar to max)",
                       linestyle="--" if series not in ALGORITHMS else "-")
    right.set_xscale("log", base=2)
    right.set_yscale("log")  # a stalled round (tens of seconds) would flatten the sub-second figures
    right.set_xticks(sorted({r["nodes"] for r in payload["part_b"]}))
    right.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    right.set_xlabel("nodes in the swarm (all on one 2-core machine: CPU contention grows with N)")
    right.set_ylabel("wait seconds per node per round (rounds 2.., log scale)")
    right.set_title(f"(B) synchronization time vs swarm size (H = {payload['config']['part_b']['H']})")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(payload: dict[str, Any], out: Path) -> str:
    """The markdown (tables, problems, notes) and the plot, from the JSON's numbers alone."""
    machine = payload["machine"]
    a, b = part_a_markdown(payload), part_b_markdown(payload)
    cfg = payload["config"]
    (out / f"{NAME}.md").write_text(
        f"# NoLoCo vs DiLoCo ({payload['date']}, {machine['nproc']} CPU cores, torch {machine['torch']}, "
        f"hivemind {machine['hivemind']})\n\n"
        f"## (A) Equal tokens, {cfg['part_a']['nodes']} nodes (H = {cfg['part_a']['H']}, "
        f"{cfg['part_a']['rounds']} rounds)\n\n{a}\n\n"
        f"## (B) Synchronization time vs swarm size (H = {cfg['part_b']['H']}, {cfg['part_b']['rounds']} rounds, "
        f"codec none, rounds 2.. only)\n\n{b}\n\n"
        "All nodes run on one machine: round time is dominated by compute, which slows with N as the nodes "
        "compete for the same cores; the wait (synchronization) seconds are the figure to compare.\n\n"
        f"## Node problems\n\n{problems(payload)}\n\n## Notes\n\n{notes(payload)}\n\n"
        f"Total benchmark time: {payload['total_seconds']:.0f} s. "
        f"Reproduce: `.venv/bin/python benchmarks/{NAME}.py`. Plot: `{NAME}.png`.\n")
    plot(payload, out / f"{NAME}.png")
    return a + "\n\n" + b


def rewrite_report(out: Path) -> str:
    """--report-only: recompute every derived number from the raw logs in the JSON, rewrite all outputs."""
    payload = json.loads((out / f"{NAME}.json").read_text())
    for part in ("part_a", "part_b"):
        payload[part] = [summarize(res) for res in payload[part]]
    (out / f"{NAME}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return write_report(payload, out)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inner-steps", type=int, help="part A: H (default 30; --quick 5)")
    parser.add_argument("--rounds", type=int, help="part A: outer rounds (default 10; --quick 2)")
    parser.add_argument("--nodes", type=int, default=4, help="part A: nodes per swarm (default 4)")
    parser.add_argument("--codecs", type=str, help="part A: comma-separated codecs (default none,int8; "
                        "--quick none)")
    parser.add_argument("--sizes", type=str, help="part B: comma-separated swarm sizes (default 2,4,8; "
                        "--quick 2,4)")
    parser.add_argument("--scale-inner-steps", type=int, help="part B: H (default 10; --quick 5)")
    parser.add_argument("--scale-rounds", type=int, help="part B: outer rounds, round 1 not timed "
                        "(default 5; --quick 3)")
    parser.add_argument("--matchmaking-variant", type=float, help="part B: also run DiLoCo with this "
                        "--matchmaking-time (the default is 3 s), to show how much of its wait is the matchmaking "
                        "window; 0 = skip (default 1)")
    parser.add_argument("--quick", action="store_true", help="small smoke run, ~3 min")
    parser.add_argument("--out-dir", type=Path, help=f"results folder (default {RESULTS_DIR}; "
                        "--quick: a fresh temp folder)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per swarm run")
    parser.add_argument("--keep-logs", action="store_true", help="keep the nodes' logs")
    parser.add_argument("--report-only", action="store_true", help="rewrite the markdown and plot from the "
                        "JSON in --out-dir without running anything")
    args = parser.parse_args()
    args.inner_steps = args.inner_steps or (5 if args.quick else 30)
    args.rounds = args.rounds or (2 if args.quick else 10)
    args.codecs = [c.strip() for c in (args.codecs or ("none" if args.quick else "none,int8")).split(",") if c]
    args.sizes = [int(s) for s in (args.sizes or ("2,3" if args.quick else "2,4,8")).split(",") if s.strip()]
    args.matchmaking_variant = 1.0 if args.matchmaking_variant is None else args.matchmaking_variant
    args.scale_inner_steps = args.scale_inner_steps or (5 if args.quick else 10)
    args.scale_rounds = args.scale_rounds or (3 if args.quick else 5)
    if args.scale_rounds < 2:
        parser.error("--scale-rounds must be at least 2 (round 1 is not timed)")
    if min(args.sizes + [args.nodes]) < 2:
        parser.error("a swarm needs at least 2 nodes")
    if args.out_dir is None:
        args.out_dir = Path(tempfile.mkdtemp(prefix=f"{NAME}_quick_")) if args.quick else RESULTS_DIR
    return args


def main() -> None:
    args = parse_args()
    if args.report_only:
        print(rewrite_report(args.out_dir))
        return
    started = time.monotonic()
    series: list[tuple[str, str, list[str]]] = [(a, a, []) for a in ALGORITHMS]
    if args.matchmaking_variant:
        mm = f"{args.matchmaking_variant:g}"
        series.append((f"diloco mm={mm}s", "diloco", ["--matchmaking-time", mm]))
    runs = [("part_a", f"{algorithm} {codec}", algorithm, algorithm, codec, args.nodes, args.inner_steps,
             args.rounds, []) for codec in args.codecs for algorithm in ALGORITHMS]
    runs += [("part_b", f"{name} N={n}", name, algorithm, "none", n, args.scale_inner_steps, args.scale_rounds,
              flags) for n in args.sizes for name, algorithm, flags in series]
    work = Path(tempfile.mkdtemp(prefix=f"{NAME}_work_"))
    keep, results = args.keep_logs, {"part_a": [], "part_b": []}
    try:
        for part, label, name, algorithm, codec, n, h, rounds, flags in runs:
            print(f"{label}: {n} nodes, H={h}, {rounds} rounds, codec {codec} {' '.join(flags)}...", flush=True)
            res = run_config(label, name, algorithm, codec, n, h, rounds, work / part, args.timeout, flags)
            results[part].append(res)
            keep = keep or bool(res["stalled_starts"])  # their logs are the evidence
            print(f"  eval loss {res['final_eval_loss_mean']:.4f} ({res['final_eval_loss_min']:.4f}-"
                  f"{res['final_eval_loss_max']:.4f}), sent {res['sent_per_node_round']:,.0f} B/node/round, "
                  f"round {res['round_seconds']:.2f}s, wait {res['wait_seconds']:.2f}s, groups {res['group_sizes']}, "
                  f"warnings {res['warnings']}+{res['hivemind_warning_count']}, {res['wall_seconds']:.0f}s", flush=True)
    except BaseException:
        keep = True  # the logs are what explains a failure
        raise
    finally:
        if keep:
            print(f"node logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for res in results["part_a"] + results["part_b"]:
        for log in res["logs"]:  # raw per-round numbers stay in the JSON; the full log lines do not
            log["warnings"] = log["warnings"][:20]
    tokens = {t for res in results["part_a"] for t in res["tokens_per_node"]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "total_seconds": time.monotonic() - started,
        "config": {"node_flags": NODE_FLAGS, "group_size": GROUP_SIZE,
                   "part_a": {"nodes": args.nodes, "H": args.inner_steps, "rounds": args.rounds,
                              "codecs": args.codecs, "equal_tokens": len(tokens) == 1},
                   "part_b": {"sizes": args.sizes, "H": args.scale_inner_steps, "rounds": args.scale_rounds,
                              "series": {name: flags for name, _, flags in series}}},
        "machine": machine_info(), **results,
    }
    (args.out_dir / f"{NAME}.json").write_text(json.dumps(payload, indent=1) + "\n")
    report = write_report(payload, args.out_dir)
    print(f"\nresults in {args.out_dir}\n\n{report}\n\ntotal {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
