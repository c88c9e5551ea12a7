"""Deep headline (issue #31): four nodes on 10 Mbit/s islands against data-parallel and one node alone,
a Llama-shaped model, a BPE tokenizer and real text.

Corpus: the Python standard library's own *.py sources (present offline on every machine that runs the
project: harness/corpus.py), training files sorted by path, then held-out files (one in 8 by a hash of
the path) so the node's eval split (the last 5 % of the tokens) is held-out files. A byte-level BPE is
trained on it with the project's CLI (`diloco-node tokenizer train`) and the corpus tokenized into
shards (`diloco-node tokenize`), both cached under --cache-dir (no download, ever).

Model: --model (default llama-2m, configs/llama-2m.json: 1.7 M parameters, vocabulary 4,096). Why not llama-20m:
it takes 3.5 s per step at 8 x 256 tokens on one thread here, and four nodes share 2 cores, so the
~1,000 steps per node a run needs to reach 8 outer averages would take over two hours of compute alone;
llama-2m takes about 0.41 s per step at 16 x 128 tokens on one thread, which puts the whole run near
an hour. The estimate printed before the run (and `--estimate-only`) says how long a preset takes.

A deeper target (results/deep_batch4.*: `--batch-size 4 --steps 800 --eval-every 50`, H 30 to 100): at
4 x 128 tokens a step data-parallel needs 3.36x fewer tokens per worker than one node alone to reach its
800-step eval loss of 5.1774 (358,400 against 1,203,200), where at 16 x 128 it needed only 1.07x fewer;
but no node row reached that loss within 2x DDP's tokens per node (the closest, eager sign at H = 30, 5.184).

Rows (--rows selects; the target needs `ddp` or --target):
- ddp: data-parallel, 4 gloo ranks (harness/ddp.py). Its eval loss against steps is measured on
  loopback (all 4 ranks on this machine, no link); its time and wire bytes per step on the 10 Mbit/s
  islands over --link-steps steps (a step's bytes are fixed: the gradients' ring all-reduce), as issue
  #31 allows. Time to target = steps to target x link seconds per step (evaluations left out).
- alone: one node's training alone: the same model, batch, inner optimizer and schedule, no
  communication (harness/ddp.py at world 1: a plain inner loop), up to --alone-factor x DDP's steps per
  worker, stopped at the target.
- blocking: DiLoCo as published: `--sync blocking --compression none`, outer lr 0.7, momentum 0.9.
- candidates (--candidates "H:FLAGS;..."): our best is chosen in the run among them, as in
  headline.py: the one closest to all three targets (max of min(time ratio / 10, bytes ratio /
  3000, tokens-per-node ratio against alone / 2.5)).
- noloco: `--algorithm noloco`, --noloco-compression.
- mixed: speeds 1x, 1x, 2x, 4x (harness/pace.py: each node's inner steps take a fixed time, 1/speed of
  a pace the fastest node keeps even while the four share the cores; each node's measured steps per
  second are reported beside it) with --round-seconds T (T: --mixed-h of the fastest node's steps).

The nodes are the real CLI (`diloco-node join`), one per island (harness/islands.py). They may train up
to --max-token-factor x DDP's tokens per worker and are stopped once every node has evaluated at or
below the target in a round whose φ holds at least one average. Per row: time to the target (from
launching the row's processes), wire bytes to it (tx counters of the 4 islands' veth links), tokens per
node and outer averages in the model by then, and the ratios against DDP and against alone.

Run as root: `.venv/bin/python benchmarks/deep.py` (see the estimate it prints first; `--rows` and
`--steps` size it); `--add-to benchmarks/results/deep.json --rows candidates --candidates ...` runs
more rows against a run's target and adds them to its report; `--report-only` writes the report
again; `--quick` is a smoke test (a short budget, a smaller batch, ~6 minutes). Results:
benchmarks/results/deep.{json,md,png} (--quick: deep_quick.*).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import os
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_node.commands.launch import LaunchError, NodeProcess
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
from harness.corpus import stdlib_shards
from harness.ddp import run_ddp_local, run_ddp_on_link
from harness.islands import Islands, require_netns
from harness.nodes import PUBLISHED_FP32
from harness.pace import steps_per_second
from harness.wire import WireSampler, wire_bytes

NAME = "deep"
NODES = 4
TIME_TARGET = 10.0  # our best reaches the target this many times sooner than DDP
BYTES_TARGET = 3000.0  # ... with this many times fewer wire bytes
ALONE_TARGET = 2.5  # ... and this many times fewer tokens per node than one node alone
MIN_AVERAGES = 8  # the budget must be large enough that our best needs this many outer averages
ROWS = ("ddp", "alone", "blocking", "candidates", "noloco", "mixed")
SPEEDS = (4, 2, 1, 1)  # the mixed swarm; node 1 (the one the others dial) the fastest
CANDIDATES = ["50:--compression int4", "100:--compression int4",
              "50:--sync blocking --compression int4 --block-size 256 --outer-momentum 0.6"]
PACE_MARGIN = 1.25  # a paced step's slack for the machine's jitter (an overrun is counted and reported)
JOIN_TIMEOUT = 240.0  # seconds for the four nodes of a row to join
NODE_STARTUP = 60.0  # seconds a row of four nodes takes to start and join (for the estimate)


# --- corpus, tokenizer, shards (cached) ------------------------------------------------------

def prepare_data(args: argparse.Namespace) -> dict[str, Any]:
    """The corpus, tokenizer and shards for these arguments, made once and cached under --cache-dir."""
    return stdlib_shards(args.cache_dir, args.corpus_mb, args.vocab_size)


def overrides(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    """The NodeConfig fields every row shares (DDP's ranks, the one node alone and the nodes)."""
    model = Path(args.model)  # a config path relative to here: the nodes run in their log folders
    return {"model": str(model.resolve()) if model.exists() else args.model, "tokenizer": data["tokenizer"],
            "data": data["shards"], "seq_len": args.seq_len,
            "batch_size": args.batch_size, "eval_batches": args.eval_batches, "warmup_steps": args.warmup_steps}


def node_flags(shared: dict[str, Any]) -> list[str]:
    return [flag for key, value in shared.items() for flag in (f"--{key.replace('_', '-')}", str(value))]


# --- the estimate ------------------------------------------------------------------------------

def estimate(args: argparse.Namespace, step_seconds: float, parameters: int, cores: int) -> dict[str, float]:
    """Seconds each selected row should take, from one rank's measured seconds per step alone on a core.
    Four processes share `cores` cores; DDP's link step adds its ring all-reduce at the link's rate."""
    shared = step_seconds * max(1.0, NODES / cores)  # a step when all four compute at once
    ring = 2 * (NODES - 1) / NODES * parameters * 4 * 8 / (args.rate * 1e6)  # seconds per all-reduce
    node_steps = args.max_token_factor * args.steps
    rows = {"ddp": args.steps * shared * 1.1 + args.link_steps * (shared + ring) + 30,
            "alone": args.alone_factor * args.steps * step_seconds + 15,
            "blocking": NODE_STARTUP + node_steps * shared,
            "candidates": len(args.candidates.split(";")) * (NODE_STARTUP + node_steps * shared),
            "noloco": NODE_STARTUP + node_steps * shared,
            "mixed": NODE_STARTUP + mixed_rounds(args) * round_seconds(args, step_seconds, cores)}
    return {row: seconds for row, seconds in rows.items() if row in args.rows}


def mixed_paces(step_seconds: float, cores: int) -> tuple[float, ...]:
    """Each mixed node's step time (harness/pace.py): the fastest's is its step time alone, stretched by
    how much the four oversubscribe the cores (the slower ones use 1/2 + 1/4 + 1/4 of the fastest's
    share) and by PACE_MARGIN, so that every step fits its pace; the others' k times that."""
    busy = sum(speed / SPEEDS[0] for speed in SPEEDS)  # cores the four want at full speed
    fastest = step_seconds * max(1.0, busy / cores) * PACE_MARGIN
    return tuple(fastest * SPEEDS[0] / speed for speed in SPEEDS)


def round_seconds(args: argparse.Namespace, step_seconds: float, cores: int) -> float:
    """T of the mixed swarm: --round-seconds, else the time the fastest node takes for --mixed-h steps."""
    if args.round_seconds:
        return float(args.round_seconds)
    return args.mixed_h * mixed_paces(step_seconds, cores)[0]


def mixed_rounds(args: argparse.Namespace) -> int:
    return math.ceil(args.max_token_factor * args.steps / args.mixed_h)


# --- the rows ----------------------------------------------------------------------------------

def ddp_row(islands: Islands, args: argparse.Namespace, shared: dict[str, Any]) -> dict[str, Any]:
    curve = run_ddp_local(args.steps, args.timeout, eval_every=args.eval_every, world=NODES, overrides=shared)
    link = run_ddp_on_link(islands, args.link_steps, args.timeout, world=NODES, overrides=shared)
    tokens_per_step = args.batch_size * args.seq_len
    points = [{"seconds": step * link["seconds_per_step"], "bytes": round(step * link["wire_bytes_per_step"]),
               "tokens_per_node": step * tokens_per_step, "eval_loss": loss, "step": step, "averaged": step}
              for step, _, _, loss in curve["evals"]]
    return {"method": f"DDP ({NODES} gloo ranks, all-reduce every step)", "kind": "ddp", "points": points,
            "final_eval_loss": points[-1]["eval_loss"], "parameters": curve["parameters"],
            "loopback_seconds_per_step": curve["seconds_per_step"],
            "link": {k: v for k, v in link.items() if k not in ("step_seconds", "comm_seconds", "evals")},
            "measured": f"loss vs steps on loopback ({args.steps} steps); time and wire bytes per step on the "
                        f"{args.rate:g} Mbit/s islands over {args.link_steps} steps"}


def alone_row(args: argparse.Namespace, shared: dict[str, Any], target: float | None) -> dict[str, Any]:
    steps = math.ceil(args.alone_factor * args.steps)
    result = run_ddp_local(steps, args.timeout, eval_every=args.eval_every, world=1, overrides=shared,
                           stop_below=target)
    tokens_per_step = args.batch_size * args.seq_len
    points, evaluating = [], 0.0
    for step, at, eval_seconds, loss in result["evals"]:
        evaluating += eval_seconds
        points.append({"seconds": at - result["launched_at"] - evaluating, "bytes": 0,
                       "tokens_per_node": step * tokens_per_step, "eval_loss": loss, "step": step, "averaged": 0})
    return {"method": "one node alone (no communication)", "kind": "alone", "points": points, "budget_steps": steps,
            "final_eval_loss": points[-1]["eval_loss"], "seconds_per_step": result["seconds_per_step"]}


def reached_in(nodes: list[NodeProcess], target: float) -> bool:
    """Every node has logged a round after its first (so φ holds an average, eager included) whose eval
    loss is at or below the target: the row has its point, the nodes may stop."""
    common = set.intersection(*(set(node.rounds) for node in nodes))
    return any(r >= 2 and all(node.rounds[r].eval_loss <= target for node in nodes) for r in common)


def node_row(islands: Islands, sampler: WireSampler, args: argparse.Namespace, work: Path, shared: dict[str, Any],
             label: str, kind: str, h: int, options: list[str], target: float,
             paces: tuple[float, ...] | None = None, rounds: int | None = None) -> dict[str, Any]:
    rounds = rounds or math.ceil(args.max_token_factor * args.steps / h)
    _, baseline = sampler.sample()
    try:
        result = run_diloco_on_link(islands, label, h, rounds, work, args.timeout, node_flags(shared) + options,
                                    join_timeout=JOIN_TIMEOUT, nodes=NODES, step_seconds=paces,
                                    until=lambda nodes: reached_in(nodes, target))
    except (LaunchError, RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"  {label}: FAILED: {str(exc)[:2000]}", flush=True)
        return {"method": label, "kind": kind, "H": h, "rounds": rounds, "options": options, "points": [],
                "failed": str(exc)[:2000]}
    launched, logs = result["launched_at"], result["logs"]
    joined = max(log["joined"]["time"] for log in logs)
    points = [{"seconds": joined - launched, "bytes": sampler.at_or_after(joined) - baseline, "tokens_per_node": 0,
               "eval_loss": max(log["joined"]["eval_loss"] for log in logs), "round": 0, "averaged": 0}]
    rounds_seen = sorted(set.intersection(*({r["round"] for r in log["rounds"]} for log in logs)))
    for round_ in rounds_seen:
        entries = [next(r for r in log["rounds"] if r["round"] == round_) for log in logs]
        at = max(e["time"] for e in entries)
        points.append({
            "seconds": at - launched, "bytes": sampler.at_or_after(at) - baseline, "round": round_,
            "eval_loss": max(e["eval_loss"] for e in entries),
            "tokens_per_node": statistics.mean(sum(r["tokens"] for r in log["rounds"] if r["round"] <= round_)
                                               for log in logs),
            # exchanges whose group mean φ holds by then (under eager the previous round's exchange)
            "averaged": min(sum(1 for r in log["rounds"] if r["round"] <= round_ and r["group_size"] >= 2)
                            for log in logs)})
    return {"method": label, "kind": kind, "H": h, "rounds": rounds, "options": options, "points": points,
            "startup_seconds": joined - launched, "startup_bytes": points[0]["bytes"],
            "final_eval_loss": points[-1]["eval_loss"],
            "run": {k: v for k, v in result.items() if k != "logs"},
            "tokens_per_node_total": [sum(r["tokens"] for r in log["rounds"]) for log in logs],
            # the emulated speeds as they came out: each node's measured steps per second and its pace's
            # overruns (harness/pace.py; paced rows only)
            "steps_per_second": [steps_per_second(log["rounds"]) for log in logs],
            "pace": [log["pace"] for log in logs] if paces else None,
            "warnings": [w for log in logs for w in log["warnings"]][:20]}


def labelled_candidate(text: str) -> tuple[str, int, list[str]]:
    """`H:FLAGS` → (label naming H, H, join options): rows of several H side by side."""
    label, h, options = parse_candidate(text)
    return f"{label} H={h}", h, options


def paced_speeds(row: dict[str, Any]) -> str:
    """A paced row's speeds as they came out: steps per second each node measured against its pace."""
    if not row.get("pace"):
        return ""
    parts = []
    for speed, reports in zip(row.get("steps_per_second") or [], row["pace"], strict=False):
        pace = reports[0]["step_seconds"] if reports else None
        overran = sum(r["overran"] for r in reports)
        steps = sum(r["steps"] for r in reports)
        parts.append(f"{speed:.2f}" + (f" (pace {1 / pace:.2f}, {overran} of {steps} steps over)" if pace else "")
                     if speed else "–")
    return " Measured steps per second per node: " + ", ".join(parts) + "."


# --- to the target -----------------------------------------------------------------------------

def reach(row: dict[str, Any], target: float, ddp: dict[str, Any] | None, alone: dict[str, Any] | None) -> None:
    """What it took `row` to reach `target`: its first point at or below it whose model holds an average
    (DDP: every step; alone: none needed), with the ratios against DDP and against one node alone."""
    row["best_eval_loss"] = min((p["eval_loss"] for p in row["points"]), default=math.inf)
    needs_average = row["kind"] not in ("ddp", "alone")
    hit = next((p for p in row["points"] if p["eval_loss"] <= target and (p["averaged"] >= 1 or not needs_average)),
               None)
    row["reached"] = hit
    if hit is None:
        return
    for key in ("time_ratio", "bytes_ratio", "alone_ratio", "alone_ratio_at_least"):
        hit.pop(key, None)  # judged afresh (a report written again from a run's json)
    base = ddp["reached"] if ddp is not None else None
    # alone's time (a core of its own) and bytes (none) say nothing against DDP's: its tokens are its figure
    if base is not None and row["kind"] not in ("ddp", "alone"):
        hit["time_ratio"] = base["seconds"] / max(hit["seconds"], 1e-9)
        hit["bytes_ratio"] = base["bytes"] / max(1, hit["bytes"])
    if alone is not None and row is not alone:
        if alone["reached"] is not None:
            hit["alone_ratio"] = alone["reached"]["tokens_per_node"] / max(1.0, hit["tokens_per_node"])
        else:  # alone never got there in its budget: a lower bound
            hit["alone_ratio_at_least"] = alone["points"][-1]["tokens_per_node"] / max(1.0, hit["tokens_per_node"])


def score(row: dict[str, Any]) -> float:
    """How close a candidate comes to the three targets (≥ 1: all met)."""
    hit = row.get("reached")
    if hit is None:
        return -math.inf
    alone = hit.get("alone_ratio", hit.get("alone_ratio_at_least", math.inf))
    return min(hit.get("time_ratio", math.inf) / TIME_TARGET, hit.get("bytes_ratio", math.inf) / BYTES_TARGET,
               alone / ALONE_TARGET)


def run(args: argparse.Namespace, work: Path, shared: dict[str, Any], estimated: dict[str, float]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    target, ddp, alone = args.target, None, None
    with Islands(count=NODES, rate_mbit=args.rate) as islands:
        raw = islands.measure_tcp_mbit(islands[0], islands[1])
        print(f"{args.rate:g} Mbit/s islands: raw TCP {raw:.2f} Mbit/s", flush=True)
        with WireSampler(lambda: wire_bytes(islands), args.sample_seconds) as sampler:
            def timed(name: str, make: Any) -> dict[str, Any]:
                load, started = os.getloadavg()[0], time.monotonic()
                row: dict[str, Any] = make()
                row["load_average"] = [load, os.getloadavg()[0]]
                row["row_seconds"] = time.monotonic() - started
                row["estimated_seconds"] = estimated.get(name)
                rows.append(row)
                return row

            if "ddp" in args.rows:
                ddp = timed("ddp", lambda: ddp_row(islands, args, shared))
                target = ddp["final_eval_loss"] if target is None else target
                reach(ddp, target, ddp, None)  # the later rows' ratios need its point
                print(f"  DDP: target eval loss {target:.4f} after {args.steps} steps; link "
                      f"{ddp['link']['seconds_per_step']:.2f} s/step, {ddp['link']['wire_bytes_per_step'] / 1e6:.1f} MB"
                      "/step", flush=True)
            assert target is not None
            if "alone" in args.rows:
                alone = timed("alone", lambda: alone_row(args, shared, target))
                reach(alone, target, ddp, None)
                last = alone["points"][-1]
                print(f"  alone: {alone['seconds_per_step']:.2f} s/step, eval loss {last['eval_loss']:.4f} after "
                      f"{last['step']} steps" + (" (the target)" if last["eval_loss"] <= target else ""), flush=True)
            plan: list[tuple[str, str, str, int, list[str], tuple[float, ...] | None, int | None]] = []
            if "blocking" in args.rows:
                plan.append(("blocking", f"DiLoCo blocking fp32 H={args.blocking_h}", "blocking", args.blocking_h,
                             list(PUBLISHED_FP32), None, None))
            if "candidates" in args.rows:
                for candidate in args.candidates.split(";"):
                    label, h, options = labelled_candidate(candidate)
                    plan.append(("candidates", label, "candidate", h, options, None, None))
            if "noloco" in args.rows:
                plan.append(("noloco", f"NoLoCo {args.noloco_compression} H={args.noloco_h}", "noloco", args.noloco_h,
                             ["--algorithm", "noloco", "--compression", args.noloco_compression], None, None))
            if "mixed" in args.rows:
                seconds = round_seconds(args, args.step_seconds, os.cpu_count() or 1)
                label = (f"mixed speeds {'/'.join(f'{s}x' for s in sorted(SPEEDS))} --round-seconds {seconds:.1f} "
                         f"`{args.mixed_options}`")
                plan.append(("mixed", label, "mixed", 0, ["--sync", "eager", "--round-seconds", f"{seconds:.2f}",
                                                          *shlex.split(args.mixed_options)],
                             mixed_paces(args.step_seconds, os.cpu_count() or 1), mixed_rounds(args)))
            for index, (name, label, kind, h, options, paces, rounds) in enumerate(plan):
                row = timed(name, functools.partial(node_row, islands, sampler, args, work / str(index), shared,
                                                    label, kind, h, options, target, paces, rounds))
                reach(row, target, ddp, alone)
                hit = row["reached"]
                print(f"  {label}: " + ("FAILED" if row.get("failed") else
                                        f"target at {hit['seconds']:.0f} s, {hit['bytes']:,} B, "
                                        f"{hit['tokens_per_node']:,.0f} tokens/node, {hit['averaged']} averages"
                                        if hit else f"not reached; best {row['best_eval_loss']:.4f}"), flush=True)
    judge(rows, target)
    return {"rate_mbit": args.rate, "raw_tcp_mbit": raw, "target_eval_loss": target, "rows": rows}


def judge(rows: list[dict[str, Any]], target: float) -> None:
    """Every row's point at the target and ratios, and the best candidate marked."""
    ddp = next((r for r in rows if r["kind"] == "ddp"), None)
    alone = next((r for r in rows if r["kind"] == "alone"), None)
    for base in filter(None, (ddp, alone)):  # first: the others' ratios need their points
        reach(base, target, ddp, None)
    for row in rows:
        reach(row, target, ddp, alone)
    candidates = [r for r in rows if r["kind"] == "candidate"]
    for row in candidates:
        row.pop("best", None)
    if candidates:
        best = max(candidates, key=lambda r: (score(r), -r["best_eval_loss"]))
        best["best"] = True


# --- report ------------------------------------------------------------------------------------

def ratio(value: float | None, fmt: str, lower_bound: bool = False) -> str:
    return "–" if value is None else ("≥ " if lower_bound else "") + fmt.format(value)


def markdown(payload: dict[str, Any]) -> str:
    run_, args = payload["run"], payload["args"]
    data, machine = payload["data"], payload["machine"]
    kinds = {row["kind"] for row in run_["rows"]}

    def against(kind: str, measured: float | None, target: float) -> str:
        return verdict(measured, target) if kind in kinds else f"not measured (no {kind} row in this run)"

    lines = [f"# Deep headline: four nodes on {run_['rate_mbit']:g} Mbit/s islands ({payload['date']}, "
             f"{machine['nproc']} CPU cores, torch {machine['torch']})", "",
             f"Model `{args['model']}` ({payload.get('parameters') or 0:,} parameters), BPE vocabulary "
             f"{args['vocab_size']:,} trained on the Python standard library's sources "
             f"({data['corpus']['train_files']:,} training files, {data['corpus']['held_out_files']:,} held out), "
             f"batch {args['batch_size']} x {args['seq_len']} tokens per node step. Target: " +
             (f"DDP's eval loss after {args['steps']} steps x {NODES} workers" if "ddp" in kinds else
              "given with --target (no DDP row in this run)") +
             f" = **{run_['target_eval_loss']:.4f}**. Link: `tc tbf` "
             f"{run_['rate_mbit']:g} Mbit/s per island (raw TCP {run_['raw_tcp_mbit']:.2f} Mbit/s).", "",
             "| row | time to target | sooner than DDP | wire bytes to target | fewer than DDP | tokens per node to "
             "target | fewer than alone | outer averages in the model | best eval loss | row wall s (estimate) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in run_["rows"]:
        name = f"**{row['method']}** (best)" if row.get("best") else row["method"]
        took = f"{row['row_seconds']:.0f} ({row['estimated_seconds'] or 0:.0f})"
        if row.get("failed"):
            lines.append(f"| {name} | failed: {row['failed'].splitlines()[0][:200]} |" + " – |" * 7 + f" {took} |")
            continue
        hit = row["reached"]
        if hit is None:
            lines.append(f"| {name} | not reached |" + " – |" * 6 + f" {row['best_eval_loss']:.4f} | {took} |")
            continue
        averaged = {"ddp": "every step", "alone": "–"}.get(row["kind"], str(hit["averaged"]))
        alone = ratio(hit.get("alone_ratio"), "{:.2f}x") if "alone_ratio_at_least" not in hit else \
            ratio(hit["alone_ratio_at_least"], "{:.2f}x", lower_bound=True)
        lines.append(f"| {name} | {hit['seconds']:.0f} s | {ratio(hit.get('time_ratio'), '{:.1f}x')} | "
                     f"{hit['bytes']:,} | {ratio(hit.get('bytes_ratio'), '{:.0f}x')} | {hit['tokens_per_node']:,.0f} | "
                     f"{alone} | {averaged} | {row['best_eval_loss']:.4f} | {took} |")
    best = next((r for r in run_["rows"] if r.get("best")), None)
    if best is not None:
        hit = best["reached"] or {}
        alone_value = hit.get("alone_ratio", hit.get("alone_ratio_at_least"))
        lines += ["", f"## Targets (our best configuration: {best['method']})", "", "| target | measured | result |",
                  "|---|---|---|",
                  f"| ≥ {TIME_TARGET:g}x sooner than DDP | {ratio(hit.get('time_ratio'), '{:.1f}x')} | "
                  f"{against('ddp', hit.get('time_ratio'), TIME_TARGET)} |",
                  f"| ≥ {BYTES_TARGET:g}x fewer wire bytes than DDP | {ratio(hit.get('bytes_ratio'), '{:.0f}x')} | "
                  f"{against('ddp', hit.get('bytes_ratio'), BYTES_TARGET)} |",
                  f"| ≥ {ALONE_TARGET:g}x fewer tokens per node than one node alone | "
                  f"{ratio(alone_value, '{:.2f}x', 'alone_ratio_at_least' in hit)} | "
                  f"{against('alone', alone_value, ALONE_TARGET)} |",
                  f"| ≥ {MIN_AVERAGES} outer averages to the target (the budget is deep enough) | "
                  f"{hit.get('averaged', '–')} | {verdict(hit.get('averaged'), MIN_AVERAGES)} |"]
    return "\n".join(lines)


def notes(payload: dict[str, Any]) -> str:
    run_, args = payload["run"], payload["args"]
    lines = []
    for row in run_["rows"]:
        if row["kind"] == "ddp":
            link = row["link"]
            lines.append(f"DDP: {row['measured']}: {link['seconds_per_step']:.2f} s/step on the link (of which "
                         f"all-reduce {link['comm_seconds_per_step']:.2f} s), {link['wire_bytes_per_step']:,.0f} wire "
                         f"B/step; {row['loopback_seconds_per_step']:.2f} s/step on loopback.")
        elif row["kind"] == "alone":
            lines.append(f"One node alone: up to {row['budget_steps']} steps, {row['seconds_per_step']:.2f} s/step "
                         "with a core of its own (its time is not comparable with the four-node rows', which share "
                         "the cores: compare its tokens).")
        elif not row.get("failed"):
            lines.append(f"{row['method']}: `{' '.join(row['options'])}`, up to {row['rounds']} rounds, start-up "
                         f"{row['startup_seconds']:.0f} s ({row['startup_bytes']:,} B), tokens per node trained "
                         f"{', '.join(f'{t:,.0f}' for t in row['tokens_per_node_total'])}, node warnings "
                         f"{len(row['warnings'])}." + paced_speeds(row))
    lines.append("Time to target: from launching the row's processes to the first evaluation at or below the target "
                 "(no interpolation); node rows evaluate once per round (the latest node's round event; every node "
                 "at or below it, and φ holding at least one average). Bytes: tx counters of the four islands' veth "
                 f"links, sampled every {args['sample_seconds']:g} s. Tokens per node: the mean over the nodes of "
                 "the tokens their round records say they trained.")
    for added in payload.get("added", []):
        lines.append(f"Added by a later invocation on the same machine ({added['date']}, raw TCP "
                     f"{added['raw_tcp_mbit']:.2f} Mbit/s, {added['seconds']:.0f} s): {', '.join(added['rows'])}; "
                     f"`.venv/bin/python {added['reproduce']}`.")
    lines.append("Machine load (1-minute load average before / after each row): " + ", ".join(
        f"{r['method']} {r['load_average'][0]:.1f} / {r['load_average'][1]:.1f}" for r in run_["rows"]) + ".")
    return "\n".join(f"- {line}" for line in lines)


def plot(payload: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    run_ = payload["run"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    keys = (("seconds", "wall-clock seconds from launch (log)", 1.0),
            ("bytes", "MB on the wire, four links (log)", 1e6),
            ("tokens_per_node", "thousand tokens per node", 1e3))
    for index, row in enumerate(run_["rows"]):
        if not row["points"]:
            continue
        # one colour per row in every panel (alone has no place on the bytes panel's log axis)
        style = {"marker": "." if row["kind"] in ("ddp", "alone") else "o", "markersize": 3,
                 "linewidth": 2.5 if row.get("best") else 1.2, "color": f"C{index % 10}"}
        label = row["method"] + (" (best)" if row.get("best") else "")
        for ax, (key, _, scale) in zip(axes, keys, strict=True):
            if key == "bytes" and row["kind"] == "alone":
                continue  # no bytes: nothing to place on a log axis
            ax.plot([max(p[key], 1) / scale for p in row["points"]], [p["eval_loss"] for p in row["points"]],
                    label=label, **style)
    lowest = min((p["eval_loss"] for r in run_["rows"] for p in r["points"]), default=0.0)
    for ax, (key, xlabel, _) in zip(axes, keys, strict=True):
        ax.axhline(run_["target_eval_loss"], color="grey", linestyle="--", linewidth=1, label="target (DDP's loss)")
        if key != "tokens_per_node":  # tokens: every row within a few times of the others, on a linear axis
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out eval loss (nats/token)")
        ax.set_ylim(lowest - 0.1, run_["target_eval_loss"] + 2.0)
        ax.grid(alpha=0.3)
    axes[0].set_title("eval loss vs wall-clock")
    axes[1].set_title("eval loss vs wire bytes")
    axes[2].set_title("eval loss vs tokens per node")
    axes[2].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reproduce(args: dict[str, Any]) -> str:
    """The command line that ran `args`: the flags whose values differ from the defaults."""
    if args.get("quick"):
        return "benchmarks/deep.py --quick"
    defaults = vars(parse_args([]))
    flags = []
    for key, value in args.items():
        unset = str(value) == str(defaults.get(key))  # a json's paths are strings
        if unset or key in ("quick", "estimate_only", "out_dir", "report_only", "step_seconds", "target"):
            continue
        shown = ",".join(value) if isinstance(value, list) else str(value)
        flags.append(f"--{key.replace('_', '-')} {shlex.quote(shown)}")
    if args.get("target") is not None and args.get("add_to") is None:
        flags.append(f"--target {args['target']}")
    return " ".join(["benchmarks/deep.py", *flags])


def write_report(payload: dict[str, Any], out_dir: Path, name: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
    text = (f"{markdown(payload)}\n\n## Notes\n\n{notes(payload)}\n\nTotal benchmark time: {payload['seconds']:.0f} s "
            f"(estimated {sum(payload['estimate'].values()):.0f} s). Reproduce (root): `.venv/bin/python "
            f"{reproduce(payload['args'])}`. Plot: `{name}.png`.\n")
    (out_dir / f"{name}.md").write_text(text)
    plot(payload, out_dir / f"{name}.png")
    return text


# --- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: a short budget, a smaller batch (~6 min)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"',' separated, of {', '.join(ROWS)}")
    parser.add_argument("--model", default="llama-2m", help="a --model of join: a preset or a Llama config.json")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (at most the model's)")
    parser.add_argument("--corpus-mb", type=float, default=32.0, help="most MB of training files in the corpus")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "diloco_deep_cache",
                        help="where the corpus, tokenizer and shards are kept between runs")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--rate", type=float, default=10.0, help="link rate in Mbit/s")
    parser.add_argument("--steps", type=int, default=400, help="DDP steps per worker: the token budget")
    parser.add_argument("--eval-every", type=int, default=20, help="DDP and alone evaluate every this many steps")
    parser.add_argument("--link-steps", type=int, default=30, help="DDP steps timed on the link")
    parser.add_argument("--target", type=float, default=None, help="the target eval loss when the ddp row is not run")
    parser.add_argument("--alone-factor", type=float, default=5.0, help="alone trains up to this x DDP's steps")
    parser.add_argument("--max-token-factor", type=float, default=2.0,
                        help="node rows train up to this x DDP's tokens per worker")
    parser.add_argument("--blocking-h", type=int, default=50)
    parser.add_argument("--candidates", default=";".join(CANDIDATES), help="H:FLAGS;... (eager unless FLAGS say)")
    parser.add_argument("--noloco-h", type=int, default=50)
    parser.add_argument("--noloco-compression", default="int4")
    parser.add_argument("--mixed-h", type=int, default=50, help="steps the fastest node trains per mixed round")
    parser.add_argument("--round-seconds", type=float, default=0.0, help="T of the mixed row (0: from --mixed-h)")
    parser.add_argument("--mixed-options", default="--compression int4")
    parser.add_argument("--sample-seconds", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per row")
    parser.add_argument("--estimate-only", action="store_true", help="prepare the data, time a step, print the "
                                                                     "estimate and exit")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--report-only", action="store_true", help="rewrite the md and png from the JSON of a run")
    parser.add_argument("--add-to", type=Path, default=None,
                        help="run --rows against that run's json (its data, model, budget and target) and add them "
                             "to its report")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.link_steps, args.corpus_mb = 24, 4, 4, 4.0
        args.seq_len, args.batch_size, args.eval_batches, args.warmup_steps = 64, 8, 4, 4
        args.blocking_h = args.noloco_h = args.mixed_h = 6
        args.alone_factor, args.timeout = 4.0, 600.0
        args.candidates = "6:--compression int4"
    unknown = set(filter(None, args.rows.split(","))) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {', '.join(sorted(unknown))} (known: {', '.join(ROWS)})")
    args.rows = [row for row in ROWS if row in args.rows.split(",")]
    if args.add_to is not None and {"ddp", "alone"} & set(args.rows):
        parser.error("--add-to adds node rows to a run that has its ddp and alone rows")
    if "ddp" not in args.rows and args.target is None and args.add_to is None:
        parser.error("without the ddp row, give the target loss (--target)")
    return args


# what a run's rows are measured on: an added row takes these from the run it is added to
SHAPE = ("model", "vocab_size", "corpus_mb", "seq_len", "batch_size", "eval_batches", "warmup_steps", "rate", "steps",
         "max_token_factor", "sample_seconds")


def json_args(args: argparse.Namespace) -> dict[str, Any]:
    """`args` as a run's json keeps them (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def add_rows(base: dict[str, Any], added: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`base` (a run's payload) with the rows of `added` (a later run against its target) among its
    own, judged again, and a note of the addition."""
    rows = base["run"]["rows"] + added["rows"]
    judge(rows, base["run"]["target_eval_loss"])
    base["run"]["rows"] = rows
    base.setdefault("added", []).append({
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "rows": [r["method"] for r in added["rows"]],
        "reproduce": reproduce({k: v for k, v in json_args(args).items() if k not in SHAPE}),
        "raw_tcp_mbit": added["raw_tcp_mbit"], "seconds": added["seconds"]})
    return base


def main() -> None:
    unwind_on_sigterm()
    args = parse_args()
    name = f"{NAME}_quick" if args.quick else NAME
    if args.report_only:  # judged again, the tables, notes and plot again from the run's JSON
        payload = json.loads((args.out_dir / f"{name}.json").read_text())
        judge(payload["run"]["rows"], payload["run"]["target_eval_loss"])
        print(write_report(payload, args.out_dir, name))
        return
    base = None
    if args.add_to is not None:
        base = json.loads(args.add_to.read_text())
        name, args.target = args.add_to.stem, base["run"]["target_eval_loss"]
        for key in SHAPE:
            setattr(args, key, base["args"][key])
    if not args.estimate_only and (problem := require_netns()) is not None:
        raise SystemExit(f"{NAME}: {problem}")
    started = time.monotonic()
    data = prepare_data(args)
    shared = overrides(args, data)
    calibration = run_ddp_local(8, args.timeout, world=1, overrides=shared)
    args.step_seconds = calibration["seconds_per_step"]
    cores = os.cpu_count() or 1
    estimated = estimate(args, args.step_seconds, calibration["parameters"], cores)
    print(f"{args.model}: {calibration['parameters']:,} parameters, {args.step_seconds:.3f} s/step alone on one "
          f"thread ({args.batch_size} x {args.seq_len} tokens), {cores} cores. Estimate: "
          + ", ".join(f"{row} {seconds / 60:.1f} min" for row, seconds in estimated.items())
          + f"; total {sum(estimated.values()) / 60:.1f} min", flush=True)
    if args.estimate_only:
        return
    with work_dir(f"{NAME}_work_") as work:
        result = run(args, work, shared, estimated)
    if base is not None:
        result["seconds"] = time.monotonic() - started
        payload = add_rows(base, result, args)
    else:
        payload = {"benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                   "args": json_args(args), "machine": machine_info(), "data": data,
                   "parameters": calibration["parameters"], "step_seconds_alone": args.step_seconds,
                   "estimate": estimated, "seconds": time.monotonic() - started, "run": result}
    text = write_report(payload, args.out_dir, name)
    print(f"\n{text}\nresults in {args.out_dir}")


if __name__ == "__main__":
    main()
