"""Headline: time and bytes to a target loss over a 10 Mbit/s link, data-parallel vs DiLoCo vs NoLoCo.

Two network namespaces ("islands", harness/islands.py), each access line shaped to --rate
Mbit/s with `tc tbf`. Side by side in one run on that link, the same model, data and eval batches:

- DDP: 2 gloo ranks, gradients all-reduced across the link every step (harness/ddp.py); rank 0
  evaluates the held-out loss every --eval-every steps. Its eval loss after --steps steps (the token
  budget) is the TARGET every other method has to reach.
- DiLoCo blocking, fp32 (`--sync blocking --compression none --inner-lr 4e-4 --outer-lr 0.7
  --outer-momentum 0.9`): DiLoCo as published, H = --blocking-h.
- Candidates for our best configuration: join flags at a given H, eager unless they say otherwise
  (--candidates "H:FLAGS;...", e.g. `300:--compression int4;300:--sync blocking --compression int4
  --block-size 256 --outer-momentum 0.6`). The best one is chosen from this run's own measurements: the
  candidate, among those that reach the target, closest to both targets (max of
  min(time ratio / 10, bytes ratio / 2000)).
- NoLoCo (`--algorithm noloco`, --noloco-compression, H = --noloco-h).

The nodes are the real CLI (`diloco-node join`), one per island, node 2 pointed at node 1. They may
train up to --max-token-factor x the budget (rounds = ceil(factor x steps / H), the LR schedule over
that many steps): what counts is when they first reach the target.

For each method: wall-clock seconds from launching its processes to the first evaluation at or
below the target (no interpolation; DiLoCo/NoLoCo: the later of the two nodes' round events, and
both nodes' eval loss must be at or below it; DDP's clock leaves out its own evaluations), tokens
(both workers) trained by then, bytes on the wire to that moment (tx counters of both islands'
veth links, sampled every --sample-seconds in a background thread (harness/wire.py); the first sample after the
moment counts), of which the start-up (until both nodes joined: the DHT bootstrap; both nodes build
φ and the momentum from the seed, so node 2 downloads nothing), compute utilization (compute seconds /
wall seconds to the target, start-up included) and the compute time per step.

Run as root: `.venv/bin/python benchmarks/headline.py` (about 20 minutes on 2 cores; --quick: a
smoke test of about 4 minutes). Results: benchmarks/results/headline.{json,md,png}
(--quick: headline_quick.*).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from diloco_node.commands.launch import LaunchError
from diloco_node.config import NodeConfig
from harness.bench import (
    RESULTS_DIR,
    machine_info,
    parse_candidate,
    pyplot,
    run_diloco_on_link,
    unwind_on_sigterm,
    verdict,
    work_dir,
)
from harness.ddp import run_ddp_on_link
from harness.islands import Islands, require_netns
from harness.nodes import PUBLISHED_FP32, WORLD, final_eval_loss
from harness.wire import WireSampler, wire_bytes

NAME = "headline"
TIME_TARGET = 10.0  # our best reaches the target this many times sooner than DDP
BYTES_TARGET = 2000.0  # ... with this many times fewer bytes on the wire
# The run of record's candidates: eager int4 at H = 100 and 300; int4 with one scale per 256 or 512
# values (~10 % fewer bytes), eager at H = 200 and blocking at H = 300, where one round's average
# reaches the target. Blocking takes eager's outer momentum 0.6: with 0.9 the first outer step
# overshoots at H = 300 (2.29 after round 1, 2.33 after round 2).
CANDIDATES = ["100:--compression int4", "300:--compression int4",
              "200:--compression int4 --block-size 256",
              "300:--sync blocking --compression int4 --block-size 256 --outer-momentum 0.6",
              "300:--sync blocking --compression int4 --block-size 512 --outer-momentum 0.6"]
JOIN_TIMEOUT = 180.0  # seconds for both nodes of a method to join (a node refusing the other never does)


# --- the methods ------------------------------------------------------------------------------

def ddp_method(islands: Islands, sampler: WireSampler, args: argparse.Namespace) -> dict[str, Any]:
    _, baseline = sampler.sample()
    result = run_ddp_on_link(islands, args.steps, args.timeout, eval_every=args.eval_every)
    launched, tokens_per_step = result["launched_at"], tokens_per_worker_step()
    compute = [s - c for s, c in zip(result["step_seconds"], result["comm_seconds"], strict=True)]
    points, evaluating = [], 0.0
    for step, at, eval_seconds, loss in result["evals"]:
        evaluating += eval_seconds
        points.append({"seconds": at - launched - evaluating, "tokens": WORLD * step * tokens_per_step,
                       "eval_loss": loss, "bytes": sampler.at_or_after(at) - baseline, "step": step,
                       "compute_seconds": sum(compute[:step])})
    return {"method": "DDP (gloo all-reduce every step)", "kind": "ddp", "H": 1, "steps": args.steps,
            "points": points, "startup_bytes": 0, "compute_seconds_per_step": statistics.mean(compute[2:]),
            "seconds_per_step": result["seconds_per_step"], "final_eval_loss": points[-1]["eval_loss"],
            "run": {k: v for k, v in result.items() if k not in ("step_seconds", "comm_seconds")}}


def node_method(islands: Islands, sampler: WireSampler, args: argparse.Namespace, work: Path, label: str,
                kind: str, h: int, options: list[str]) -> dict[str, Any]:
    rounds = math.ceil(args.max_token_factor * args.steps / h)
    _, baseline = sampler.sample()
    try:
        result = run_diloco_on_link(islands, label, h, rounds, work, args.timeout, options, join_timeout=JOIN_TIMEOUT)
    except (LaunchError, RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"  {label}: FAILED: {str(exc)[:2000]}", flush=True)
        return {"method": label, "kind": kind, "H": h, "rounds": rounds, "options": options, "points": [],
                "failed": str(exc)[:2000]}
    launched, logs, tokens_per_step = result["launched_at"], result["logs"], tokens_per_worker_step()
    joined = max(log["joined"]["time"] for log in logs)
    by_round: dict[int, list[dict[str, Any]]] = {}
    for log in logs:
        for entry in log["rounds"]:
            by_round.setdefault(entry["round"], []).append(entry)
    # the start: both nodes joined, nothing trained yet (what the start-up cost in time and bytes)
    points = [{"seconds": joined - launched, "tokens": 0, "eval_loss": max(log["joined"]["eval_loss"] for log in logs),
               "bytes": sampler.at_or_after(joined) - baseline, "round": 0, "compute_seconds": 0.0, "averaged": 0}]
    for index, round_ in enumerate(sorted(by_round), start=1):
        entries = by_round[round_]
        if len(entries) < WORLD:
            continue  # a round only one node logged: the swarm's loss is unknown there
        at = max(e["time"] for e in entries)
        points.append({"seconds": at - launched, "tokens": WORLD * index * h * tokens_per_step,
                       "eval_loss": max(e["eval_loss"] for e in entries), "bytes": sampler.at_or_after(at) - baseline,
                       "round": round_, "compute_seconds": statistics.mean(
                           sum(r["seconds"] * r["utilization"] for r in log["rounds"] if r["round"] <= round_)
                           for log in logs),
                       # exchanges whose group mean φ holds by then (a round event's group_size is that of
                       # the exchange the round applied: under eager, the previous round's)
                       "averaged": min(sum(1 for r in log["rounds"] if r["round"] <= round_ and r["group_size"] >= 2)
                                       for log in logs)})
    if all(log["settled"] for log in logs):  # delayed / eager apply the last exchange on leaving
        at = max(log["settled"]["time"] for log in logs)
        points.append({**points[-1], "seconds": at - launched, "bytes": sampler.at_or_after(at) - baseline,
                       "eval_loss": max(log["settled"]["eval_loss"] for log in logs), "round": "settled",
                       "averaged": points[-1]["averaged"] + 1})
    compute = sum(r["seconds"] * r["utilization"] for log in logs for r in log["rounds"])
    steps = sum(len(log["rounds"]) * h for log in logs)
    return {"method": label, "kind": kind, "H": h, "rounds": rounds, "options": options, "points": points,
            "startup_bytes": sampler.at_or_after(joined) - baseline, "startup_seconds": joined - launched,
            "compute_seconds_per_step": compute / steps, "final_eval_loss": statistics.mean(
                final_eval_loss(log) for log in logs), "run": result}


def tokens_per_worker_step() -> int:
    cfg = NodeConfig()
    return cfg.inputs.batch_size * cfg.inputs.seq_len


def reach(method: dict[str, Any], target: float, ddp: dict[str, Any] | None) -> None:
    """Add what it took `method` to reach `target` (and its ratios against `ddp`): its first evaluation at or
    below the target of a model that holds at least one average of the nodes' work. The first one at or
    below it at all is kept too (`reached_unaveraged`): under eager a node's φ after round 1 holds only its
    own pseudo-gradient, and on a small budget that alone may reach DDP's loss."""
    method["best_eval_loss"] = min((p["eval_loss"] for p in method["points"]), default=math.inf)
    method["reached_unaveraged"] = next((p for p in method["points"] if p["eval_loss"] <= target), None)
    hit = next((p for p in method["points"] if p["eval_loss"] <= target and p.get("averaged", 1) >= 1), None)
    method["reached"] = hit
    if hit is None:
        return
    hit["utilization"] = hit["compute_seconds"] / hit["seconds"]
    hit["bytes_after_startup"] = hit["bytes"] - method["startup_bytes"]
    if ddp is not None and ddp["reached"] is not None:
        base = ddp["reached"]
        hit["time_ratio"] = base["seconds"] / hit["seconds"]
        hit["bytes_ratio"] = base["bytes"] / hit["bytes"]
        hit["bytes_ratio_after_startup"] = base["bytes"] / max(1, hit["bytes_after_startup"])


def add_payloads(run_: dict[str, Any]) -> None:
    """Payload bytes to the target, beside the wire's: DDP's gradients (ring all-reduce at M = 2: 4 B/param
    per worker per step), the nodes' pseudo-gradients as their round events count them (`sent`)."""
    params = next(m["run"]["logs"][0]["joined"]["parameters"] for m in run_["methods"] if m.get("run", {}).get("logs"))
    ddp = run_["methods"][0]
    for m in run_["methods"]:
        hit = m.get("reached")
        if hit is None:
            continue
        if m["kind"] == "ddp":
            hit["payload_bytes"] = hit["step"] * WORLD * params * 4
            continue
        last = max(r["round"] for log in m["run"]["logs"] for r in log["rounds"]) if hit["round"] == "settled" \
            else hit["round"]
        hit["payload_bytes"] = sum(r["sent"] for log in m["run"]["logs"] for r in log["rounds"] if r["round"] <= last)
        hit["payload_ratio"] = ddp["reached"]["payload_bytes"] / max(1, hit["payload_bytes"])


def score(method: dict[str, Any]) -> float:
    """How close a candidate comes to both targets (≥ 1: both met)."""
    hit = method["reached"]
    return -math.inf if hit is None else min(hit["time_ratio"] / TIME_TARGET, hit["bytes_ratio"] / BYTES_TARGET)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with Islands(count=2, rate_mbit=args.rate) as islands:
        raw = statistics.median(islands.measure_tcp_mbit(islands[0], islands[1]) for _ in range(2))
        print(f"{args.rate:g} Mbit/s link: raw TCP {raw:.2f} Mbit/s", flush=True)
        with WireSampler(lambda: wire_bytes(islands), args.sample_seconds) as sampler:
            load = os.getloadavg()[0]
            ddp = ddp_method(islands, sampler, args)
            ddp["load_average"] = [load, os.getloadavg()[0]]
            target = ddp["final_eval_loss"]
            reach(ddp, target, None)
            reach(ddp, target, ddp)
            print(f"  DDP: {args.steps} steps, {ddp['seconds_per_step']:.2f} s/step, target eval loss {target:.4f} "
                  f"at {ddp['reached']['seconds']:.0f} s, {ddp['reached']['bytes'] / 1e6:.1f} MB", flush=True)
            plan = [("DiLoCo blocking fp32", "blocking", args.blocking_h,
                     list(PUBLISHED_FP32))]
            for candidate in args.candidates.split(";"):
                label, h, options = parse_candidate(candidate)
                plan.append((label, "candidate", h, options))
            plan.append((f"NoLoCo {args.noloco_compression}", "noloco", args.noloco_h,
                         ["--algorithm", "noloco", "--compression", args.noloco_compression]))
            methods = [ddp]
            for index, (label, kind, h, options) in enumerate(plan):
                load = os.getloadavg()[0]
                method = node_method(islands, sampler, args, work / str(index), f"{label} H={h}", kind, h, options)
                method["load_average"] = [load, os.getloadavg()[0]]
                reach(method, target, ddp)
                methods.append(method)
                hit = method["reached"]
                if method.get("failed"):
                    continue
                print(f"  {method['method']}: " + (
                    f"target at {hit['seconds']:.0f} s ({hit['time_ratio']:.1f}x sooner), {hit['bytes']:,} B "
                    f"({hit['bytes_ratio']:.0f}x fewer; {hit['bytes_ratio_after_startup']:.0f}x after start-up)"
                    if hit else f"never reached the target; best {method['best_eval_loss']:.4f}"), flush=True)
    candidates = [m for m in methods if m["kind"] == "candidate"]
    best = max(candidates, key=lambda m: (score(m), -m["best_eval_loss"]))
    best["best"] = True
    return {"rate_mbit": args.rate, "raw_tcp_mbit": raw, "target_eval_loss": target, "methods": methods,
            "best": best["method"]}


# --- report -----------------------------------------------------------------------------------

def markdown(payload: dict[str, Any]) -> str:
    run_, args = payload["run"], payload["args"]
    ddp = run_["methods"][0]
    lines = [f"# Headline: time and bytes to DDP's loss over a {run_['rate_mbit']:g} Mbit/s link "
             f"({payload['date']}, {payload['machine']['nproc']} CPU cores, torch {payload['machine']['torch']})", "",
             f"Target: DDP's eval loss after {args['steps']} steps x {WORLD} workers "
             f"({ddp['reached']['tokens']:,} tokens) = **{run_['target_eval_loss']:.4f}**. "
             f"Link: `tc tbf` {run_['rate_mbit']:g} Mbit/s per island (raw TCP {run_['raw_tcp_mbit']:.2f} Mbit/s).", "",
             "| method | time to target | sooner than DDP | wire bytes to target | fewer than DDP | "
             "of which start-up | fewer than DDP, start-up left out | payload bytes to target | fewer than DDP | "
             "tokens to target | averages in the model | utilization | compute s/step | best eval loss | "
             "final eval loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in run_["methods"]:
        hit = m["reached"]
        name = f"**{m['method']}** (best)" if m.get("best") else m["method"]
        if m.get("failed"):
            lines.append(f"| {name} | failed: {m['failed'].splitlines()[0][:200]} |" + " – |" * 13)
            continue
        tail = f"{m['compute_seconds_per_step']:.3f} | {m['best_eval_loss']:.4f} | {m['final_eval_loss']:.4f} |"
        if hit is None:
            lines.append(f"| {name} | not reached | – | – | – | {m['startup_bytes']:,} | – | – | – | – | – | – | "
                         f"{tail}")
            continue
        is_ddp = m["kind"] == "ddp"
        averaged = "every step" if is_ddp else str(hit["averaged"])
        payload_ratio = "1x" if is_ddp else f"{hit['payload_ratio']:.0f}x"
        time_ratio = "1x" if is_ddp else f"{hit['time_ratio']:.1f}x"
        bytes_ratio = "1x" if is_ddp else f"{hit['bytes_ratio']:.0f}x"
        startup = "–" if is_ddp else f"{m['startup_bytes']:,}"
        after_startup = "–" if is_ddp else f"{hit['bytes_ratio_after_startup']:.0f}x"
        lines.append(f"| {name} | {hit['seconds']:.0f} s | {time_ratio} | {hit['bytes']:,} | {bytes_ratio} | "
                     f"{startup} | {after_startup} | {hit['payload_bytes']:,} | {payload_ratio} | "
                     f"{hit['tokens']:,} | {averaged} | {hit['utilization']:.1%} | "
                     f"{tail}")
    best = next(m for m in run_["methods"] if m.get("best"))
    hit = best["reached"]
    rows = [(f"≥ {TIME_TARGET:g}x sooner than DDP to the target", "time_ratio", TIME_TARGET, "{:.1f}x"),
            (f"≥ {BYTES_TARGET:g}x fewer wire bytes than DDP to the target", "bytes_ratio", BYTES_TARGET, "{:.0f}x"),
            ("(the same, the start-up's DHT bootstrap left out)", "bytes_ratio_after_startup",
             BYTES_TARGET, "{:.0f}x"),
            ("(payload bytes only: gradients vs pseudo-gradients, as the processes count them)", "payload_ratio",
             BYTES_TARGET, "{:.0f}x")]
    lines += ["", f"## Targets (our best configuration: {best['method']})", "", "| target | measured | result |",
              "|---|---|---|"]
    for text, key, goal, fmt in rows:
        measured = None if hit is None else hit[key]
        lines.append(f"| {text} | {'–' if measured is None else fmt.format(measured)} | {verdict(measured, goal)} |")
    return "\n".join(lines)


def notes(payload: dict[str, Any]) -> str:
    run_, args = payload["run"], payload["args"]
    ddp = run_["methods"][0]
    cfg = NodeConfig()
    lines = [
        f"Model `{cfg.inputs.model}` ({ddp['run'].get('parameters', 462336):,} parameters), batch "
        f"{cfg.inputs.batch_size} x seq {cfg.inputs.seq_len} bytes per worker step, embedded corpus, "
        f"{cfg.inputs.eval_batches} held-out eval batches, one torch thread per process, 2 islands (one worker / "
        f"node each). DDP: {args['steps']} steps, the node's AdamW "
        f"and warmup+cosine schedule over them, eval every {args['eval_every']} steps. DiLoCo / NoLoCo: up to "
        f"{args['max_token_factor']:g}x DDP's tokens, the schedule over their own steps.",
        "Time to target: from launching the method's processes (start-up, DHT and joining included) to the "
        "first evaluation at or below the target; DiLoCo / NoLoCo evaluate once per "
        "round (the later node's round event, both nodes at or below the target), DDP every "
        f"{args['eval_every']} steps (its evaluations left out of its clock). Bytes: tx counters of both "
        "islands' veth links (every byte on the link: payloads, DHT, matchmaking, TCP/IP headers, ACKs), "
        f"sampled every {args['sample_seconds']:g} s; the first sample after the moment counts.",
        "Start-up bytes: until both nodes reported `joined`: the DHT bootstrap, presence records and the "
        "reachability check. Both nodes build the same initial φ and momentum from --seed, and a fresh node "
        "skips the state download (fp32 φ + momentum, ~8 B/param) when the run's records agree on that state; "
        "a node joining a run already under way downloads it (3.7 MB for this model).",
        "Utilization: compute seconds / wall seconds to the target (start-up included); compute s/step: "
        "DDP's step less its all-reduce, a node's round seconds x its logged utilization / H.",
        f"Our best configuration is chosen in this run among the candidates ({args['candidates']}): "
        "the one that reaches the target closest to both targets, max of min(time ratio / 10, bytes ratio / 2000).",
    ]
    ddp_hit = ddp["reached"]
    lines.append(f"DDP: {ddp['seconds_per_step']:.2f} s per step on the link, of which compute "
                 f"{ddp['compute_seconds_per_step']:.3f} s; {ddp_hit['bytes'] / args['steps'] / 1e6:.2f} MB on the "
                 "wire per step (both links).")
    lines.append("Averages in the model: how many exchanges (group means of both nodes' pseudo-gradients) the "
                 "nodes' φ held at that evaluation. A point counts as reaching the target only with at least one: "
                 "under eager, a node's φ after round 1 holds only its own work, the first mean landing in round 2.")
    for m in run_["methods"][1:]:
        if m.get("failed"):
            lines.append(f"{m['method']}: failed ({m['failed'].splitlines()[0][:300]}).")
            continue
        early, hit = m["reached_unaveraged"], m["reached"]
        if early is not None and (hit is None or early["seconds"] < hit["seconds"]) and ddp_hit is not None:
            lines.append(f"{m['method']}: at or below the target already at round {early['round']} before any "
                         f"average ({early['eval_loss']:.4f} at {early['seconds']:.0f} s, {early['bytes']:,} B: "
                         f"{ddp_hit['seconds'] / early['seconds']:.1f}x sooner, "
                         f"{ddp_hit['bytes'] / early['bytes']:.0f}x fewer bytes, "
                         f"{ddp_hit['bytes'] / max(1, early['bytes'] - m['startup_bytes']):.0f}x with the start-up "
                         "left out); not counted.")
        r = m["run"]
        lines.append(f"{m['method']}: {r['rounds']} rounds x H={m['H']}, `{' '.join(m['options'])}`, start-up "
                     f"{m['startup_seconds']:.0f} s, median round {r['seconds_per_round']:.1f} s, steady-state "
                     f"utilization {r['utilization']:.1%}, φ max |diff| between the nodes at the end "
                     f"{r['outer_params_difference']['max_abs'] or 0:.2e}, node warnings "
                     f"{sum(len(log['warnings']) for log in r['logs'])}.")
    best = next((m for m in run_["methods"] if m.get("best")), None)
    if best is not None and best["reached"] is not None and ddp_hit is not None:
        hit = best["reached"]
        lines.append(
            f"What limits our best ({best['method']}): time: DDP takes {ddp['seconds_per_step']:.2f} s per step on "
            f"the link; the nodes {best['compute_seconds_per_step']:.3f} s of compute per step, but they needed "
            f"{hit['tokens'] / ddp_hit['tokens']:.1f}x DDP's tokens (the first round whose φ holds an average and is "
            f"at or below the target) and {best['startup_seconds']:.0f} s of start-up. Bytes: the link carried "
            f"{hit['bytes']:,} B to the target, {hit['bytes'] / max(1, hit['payload_bytes']):.1f}x the "
            f"{hit['payload_bytes']:,} B of pseudo-gradient payloads the nodes exchanged; DDP's link carried "
            f"{ddp_hit['bytes'] / ddp_hit['payload_bytes']:.2f}x its gradients. The rest is the nodes' traffic "
            "besides the payloads (DHT, matchmaking, presence, the exchange's requests and TCP framing): on the "
            "small int4 payloads it dominates.")
    lines.append("Machine load (1-minute load average before / after each method; 2 cores, the method itself "
                 "adds about 2 while its nodes train): " + ", ".join(
                     f"{m['method']} {m['load_average'][0]:.1f} / {m['load_average'][1]:.1f}" for m in run_["methods"])
                 + ".")
    return "\n".join(f"- {line}" for line in lines)


def plot(payload: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    run_ = payload["run"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in run_["methods"]:
        style = {"marker": "." if m["kind"] == "ddp" else "o", "markersize": 4,
                 "linewidth": 2.5 if m.get("best") else 1.2}
        label = m["method"] + (" (best)" if m.get("best") else "")
        xs_time = [p["seconds"] for p in m["points"]]
        xs_bytes = [max(p["bytes"], 1) / 1e6 for p in m["points"]]
        ys = [p["eval_loss"] for p in m["points"]]
        axes[0].plot(xs_time, ys, label=label, **style)
        axes[1].plot(xs_bytes, ys, label=label, **style)
    for ax, xlabel in zip(axes, ("wall-clock seconds from launch", "MB on the wire (both links, log)"), strict=True):
        ax.axhline(run_["target_eval_loss"], color="grey", linestyle="--", linewidth=1, label="target (DDP's loss)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out eval loss (nats/byte)")
        ax.grid(alpha=0.3)
        lowest = min(p["eval_loss"] for m in run_["methods"] for p in m["points"])
        ax.set_ylim(lowest - 0.05, run_["target_eval_loss"] + 1.0)  # the approach to the target
    axes[0].set_xscale("log")
    axes[1].set_xscale("log")
    axes[0].set_title(f"eval loss vs time, {run_['rate_mbit']:g} Mbit/s link")
    axes[1].set_title("eval loss vs bytes on the wire")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: a short budget, small H (~4 minutes)")
    parser.add_argument("--rate", type=float, default=10.0, help="link rate in Mbit/s")
    parser.add_argument("--steps", type=int, default=300, help="DDP steps per worker: the token budget")
    parser.add_argument("--eval-every", type=int, default=10, help="DDP evaluates every this many steps")
    parser.add_argument("--max-token-factor", type=float, default=2.0,
                        help="DiLoCo / NoLoCo train up to this many times DDP's tokens")
    parser.add_argument("--blocking-h", type=int, default=100, help="H of DiLoCo blocking fp32")
    parser.add_argument("--candidates", default=";".join(CANDIDATES),
                        help="configurations to choose our best from, H:FLAGS;... (eager unless FLAGS say)")
    parser.add_argument("--noloco-h", type=int, default=100)
    parser.add_argument("--noloco-compression", default="int4")
    parser.add_argument("--sample-seconds", type=float, default=0.5, help="veth counter sampling interval")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed per method")
    parser.add_argument("--report-only", action="store_true", help="rewrite the md and png from the JSON of a run")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.eval_every, args.blocking_h, args.noloco_h = 30, 5, 20, 20
        args.candidates = "20:--compression int4;30:--compression int4;30:--sync blocking --compression int4"
    return args


def write_report(payload: dict[str, Any], out_dir: Path, name: str, quick: bool) -> str:
    add_payloads(payload["run"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
    text = (f"{markdown(payload)}\n\n## Notes\n\n{notes(payload)}\n\nTotal benchmark time: {payload['seconds']:.0f} s. "
            f"Reproduce (root): `.venv/bin/python benchmarks/headline.py{' --quick' if quick else ''}`. "
            f"Plot: `{name}.png`.\n")
    (out_dir / f"{name}.md").write_text(text)
    plot(payload, out_dir / f"{name}.png")
    return text


def main() -> None:
    unwind_on_sigterm()
    args = parse_args()
    name = f"{NAME}_quick" if args.quick else NAME
    if args.report_only:  # the tables, notes and plot again from the run's JSON
        print(write_report(json.loads((args.out_dir / f"{name}.json").read_text()), args.out_dir, name, args.quick))
        return
    if (problem := require_netns()) is not None:
        raise SystemExit(f"{NAME}: {problem}")
    started = time.monotonic()
    with work_dir(f"{NAME}_work_") as work:
        result = run(args, work)
    for method in result["methods"]:
        for log in method.get("run", {}).get("logs", []):
            log["warnings"] = log["warnings"][:20]
    payload = {"benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "machine": machine_info(), "seconds": time.monotonic() - started, "run": result}
    text = write_report(payload, args.out_dir, name, args.quick)
    print(f"\n{text}\nresults in {args.out_dir}")


if __name__ == "__main__":
    main()
