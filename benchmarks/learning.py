"""Joining pays? Tokens per worker to a target loss for DiLoCo / NoLoCo swarms of M workers against
data-parallel (DDP) and one worker alone, in the learning simulator (harness/simulator.py: the node's
own replica, inner loop, codecs and outer updates, joined in memory; docs/architecture.md §16).

Shape (fixed, so that every row of a log is comparable): `llama-2m` (configs/llama-2m.json, 1.7 M
parameters) with a byte-level BPE of 4,096 trained on the Python standard library's sources
(harness/corpus.stdlib_shards, 16 MB), 4 x 128 tokens per worker step, warmup 50, eval on 8 held-out
batches. The budget is DDP's --steps (800) per worker: DDP's worst final eval loss over the seeds is
the target. At this batch DDP over 4 workers needs 1.80x fewer tokens per worker than one worker
alone whose cosine spans its own run (benchmarks/results/learning.md: G_DDP; deep_batch4.md's 3.36x was
one seed, a 32 MB corpus and a deeper target).

Rows (`--rows`, ';'-separated):
- `ddp:M[:key=value,...]`: M workers, gradients averaged every step (harness.simulator.data_parallel),
  with the NodeConfig fields given (e.g. `inner_lr`); the target is DDP M=4's at the settings that
  make it lowest.
- `alone:F[:key=value,...]`: one worker whose warmup + cosine spans F x the budget (it needs ~3.4x DDP's tokens, so
  a cosine of DDP's length would leave it at the floor long before the target; the report takes the
  best F tried), trained up to F x the budget.
- `M:H:key=value,...`: M simulated nodes, H inner steps, the NodeConfig fields given (e.g.
  `4:30:sync=blocking,compression=none,outer_lr=0.7,outer_momentum=0.9`); they train up to
  --max-token-factor x the budget per worker. `schedule=F` (not a NodeConfig field): the inner
  cosine spans F x the budget (default 1: DDP's, so that the two decay alike). `speeds=4/2/1/1`
  (not a NodeConfig field): the workers' speeds over the slowest's, spent as `spent=steps` (s·H steps
  a round) or `spent=batch` (H steps of s batches), at equal wall-clock: rounds; tokens per worker are
  then the first (fastest) worker's (harness/simulator.py; docs/architecture.md §13). `inner_state=reset`
  (not a NodeConfig field, no node does it): each round starts the inner AdamW's moments afresh
  instead of carrying them over:

    .venv/bin/python benchmarks/learning.py run --rows "4:10:sync=blocking,speeds=4/2/1/1,spent=steps;\
        4:10:sync=blocking,speeds=4/2/1/1,spent=batch" --seeds 0

Every (row, seed) is one job; jobs run --jobs at a time, each in a process of its own on one thread,
and each finished job is appended to --log (a row already there for that seed is not run again), so
a search can be stopped and resumed and several invocations add to one log. `report` reads the log
and writes benchmarks/results/learning.{md,json,png}:

    .venv/bin/python benchmarks/learning.py run --rows "ddp:4;alone;4:30:sync=blocking" --seeds 0,1,2
    .venv/bin/python benchmarks/learning.py report
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_node.config import FIELDS, NodeConfig
from harness.bench import RESULTS_DIR, machine_info, pyplot
from harness.corpus import stdlib_shards
from harness.ddp import ring_all_reduce_bytes
from harness.simulator import Curve, data_parallel, simulate

SHAPE = {"model": "llama-2m", "seq_len": 128, "batch_size": 4, "eval_batches": 8, "warmup_steps": 50}
CORPUS_MB, VOCAB = 16.0, 4096
TARGET_M = 4  # the DDP row whose loss is the target


def peers(workers: int, seed: int) -> list[str]:
    """The simulated workers' peer ids: their data streams (train/shares.data_stream_seed) and order."""
    return [f"sim-{seed}-{index}" for index in range(workers)]


def parse_options(text: str) -> dict[str, Any]:
    """`key=value,...` → NodeConfig fields (and the simulator's own keys), numbers as numbers."""
    options: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        options[key.strip()] = json.loads(value) if value.replace(".", "", 1).lstrip("-").isdigit() else value
    return options


# The settings a row's label names even where the row leaves them to the defaults, so that a label in
# a log keeps naming what ran after a default changes (#39 changed all five).
STEP_KEYS = ("sync", "compression", "inner_lr", "outer_lr", "outer_momentum")


def pinned(options: dict[str, Any], keys: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    """`options` with `keys` added at the values NodeConfig gives them; a wrong key or value fails
    here, before any job runs."""
    flat = NodeConfig.model_validate({**options, **extra}).flat()
    return {**options, **{key: flat[key] for key in keys if key not in options}}


def parse_row(text: str) -> dict[str, Any]:
    """`ddp:M`, `alone` or `M:H:key=value,...` → a job's row."""
    parts = text.strip().split(":")
    options = parse_options(parts[2] if len(parts) > 2 else "")
    if parts[0] in ("ddp", "alone"):
        # `ddp:4:inner_lr=...`, `alone:F:inner_lr=...`: the baselines get their own best settings too,
        # so that a gain is neither over an untuned baseline nor against an untuned target
        options = pinned(options, ("inner_lr",))
    given = "".join(f" {k}={v}" for k, v in sorted(options.items()))
    if parts[0] == "ddp":
        return {"kind": "ddp", "workers": int(parts[1]), "options": options,
                "label": f"DDP M={int(parts[1])}{given}"}
    if parts[0] == "alone":
        factor = float(parts[1]) if len(parts) > 1 else 4.0
        return {"kind": "alone", "workers": 1, "schedule": factor, "options": options,
                "label": f"alone (cosine {factor:g}x{given})"}
    workers, h = int(parts[0]), int(parts[1])
    schedule = float(options.pop("schedule", 1.0))
    speeds = tuple(int(s) for s in str(options.pop("speeds", "")).split("/") if s)
    spent = str(options.pop("spent", "steps"))
    inner_state = str(options.pop("inner_state", "keep"))
    if speeds and len(speeds) != workers or spent not in ("steps", "batch") or inner_state not in ("keep", "reset"):
        raise SystemExit(f"learning: row {text!r}: speeds needs one speed per worker, spent steps or batch, "
                         "inner_state keep or reset")
    if speeds:  # unequal declarations: the weighting decides how they count, so a row names it (the
        # default was tokens until #41, equal since: a log's rows of either never share a label)
        options.setdefault("weighting", FIELDS["weighting"].default)
    options = pinned(options, STEP_KEYS, inner_steps=h)
    text_options = " ".join(f"{k}={v}" for k, v in sorted(options.items()))
    text_options += f" cosine {schedule:g}x" if schedule != 1.0 else ""
    text_options += f" speeds {'/'.join(map(str, speeds))} spent on {spent}" if speeds else ""
    text_options += " inner state reset each round" if inner_state == "reset" else ""
    return {"kind": "diloco", "workers": workers, "h": h, "options": options, "schedule": schedule,
            **({"speeds": list(speeds), "spent": spent} if speeds else {}),
            **({"inner_state": inner_state} if inner_state == "reset" else {}),
            "label": f"M={workers} H={h} {text_options}".strip()}


def shape(batch_size: int) -> dict[str, Any]:
    """SHAPE at a per-worker batch of `batch_size` sequences (--batch-size; a log holds one batch)."""
    return {**SHAPE, "batch_size": batch_size}


def names(batch_size: int) -> str:
    """The stem of a batch's log and report: `learning` at SHAPE's batch, `learning_b2` at 2."""
    return "learning" if batch_size == SHAPE["batch_size"] else f"learning_b{batch_size}"


def config(row: dict[str, Any], seed: int, data: dict[str, Any], batch_size: int, **extra: Any) -> NodeConfig:
    return NodeConfig.model_validate({**shape(batch_size), "tokenizer": data["tokenizer"], "data": data["shards"],
                                      "seed": seed, "threads": 1, "run_id": "learning",
                                      **row.get("options", {}), **extra})


def reached(curve: Curve, target: float | None) -> bool:
    """Every worker's φ at or below the target at the latest evaluation (deep.py's rule for nodes)."""
    return target is not None and max(curve.points[-1][1]) <= target


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One (row, seed): its curve. In a process of its own."""
    row, seed, args = job["row"], job["seed"], job["args"]
    data = stdlib_shards(Path(args["cache_dir"]), CORPUS_MB, VOCAB)
    batch = args["batch_size"]
    budget_tokens = args["steps"] * batch * SHAPE["seq_len"]
    target = job["target"]
    started = time.monotonic()
    if row["kind"] == "ddp":
        curve = data_parallel(config(row, seed, data, batch), peers(row["workers"], seed), args["steps"],
                              args["eval_every"])
    elif row["kind"] == "alone":
        steps = int(row["schedule"] * args["steps"])
        curve = data_parallel(config(row, seed, data, batch), peers(1, seed), steps, args["eval_every"],
                              on_eval=lambda _, c: c.points[-1][0] >= budget_tokens and reached(c, target))
    else:
        # the batches the first worker trains a round (with speeds: the fastest's, s·H either way)
        per_round = row["h"] * (row.get("speeds") or [1])[0]
        rounds = math.ceil(args["max_token_factor"] * args["steps"] / per_round)
        # the schedule's length is H x max_outer_steps (replica.settings_of); the rounds past it train at its floor
        cfg = config(row, seed, data, batch, inner_steps=row["h"],
                     max_outer_steps=max(1, round(row["schedule"] * args["steps"] / per_round)))
        curve = simulate(cfg, peers(row["workers"], seed), rounds,
                         on_round=lambda tokens, c: tokens >= budget_tokens and reached(c, target),
                         speeds=tuple(row.get("speeds", ())), spent=row.get("spent", "steps"),
                         inner_state=row.get("inner_state", "keep"))
    return {"key": key_of(row, seed, args), "row": row, "seed": seed, "curve": curve.as_json(),
            "seconds": time.monotonic() - started, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def key_of(row: dict[str, Any], seed: int, args: dict[str, Any]) -> str:
    return json.dumps([row["label"], seed, args["steps"]])


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def target_of(entries: list[dict[str, Any]], steps: int) -> float | None:
    """DDP M=TARGET_M's worst final eval loss over its seeds, at the settings tried that make it the
    lowest (DDP at its best): every seed of that DDP reaches it in the budget."""
    return min(target_rows(entries, steps).values(), default=None)


def target_rows(entries: list[dict[str, Any]], steps: int) -> dict[str, float]:
    """Each DDP M=TARGET_M label's worst final eval loss over its seeds."""
    finals: dict[str, list[float]] = {}
    for e in entries:
        if e["row"]["kind"] == "ddp" and e["row"]["workers"] == TARGET_M and json.loads(e["key"])[2] == steps:
            finals.setdefault(e["row"]["label"], []).append(e["curve"]["points"][-1][1][0])
    return {label: max(losses) for label, losses in finals.items()}


def run(args: argparse.Namespace) -> None:
    stdlib_shards(args.cache_dir, CORPUS_MB, VOCAB)  # once, before the jobs read it
    shared = {"cache_dir": str(args.cache_dir), "steps": args.steps, "eval_every": args.eval_every,
              "max_token_factor": args.max_token_factor, "batch_size": args.batch_size}
    rows = [parse_row(text) for text in args.rows.split(";") if text.strip()]
    done = {entry["key"] for entry in read_log(args.log)}
    # DDP first: the others stop early once past the budget and at the target it sets
    ddp_first = sorted(rows, key=lambda row: row["kind"] != "ddp")
    pending = [{"row": row, "seed": seed, "args": shared} for row in ddp_first for seed in args.seeds
               if key_of(row, seed, shared) not in done]
    print(f"learning: {len(pending)} jobs, {args.jobs} at a time; log {args.log}", flush=True)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context, max_tasks_per_child=1) as pool:
        running: dict[concurrent.futures.Future[dict[str, Any]], dict[str, Any]] = {}
        while pending or running:
            while pending and len(running) < args.jobs:
                job = pending.pop(0)
                if job["row"]["kind"] != "ddp" and any(j["row"]["kind"] == "ddp" for j in running.values()):
                    pending.insert(0, job)  # the target is not known yet
                    break
                job["target"] = target_of(read_log(args.log), args.steps)
                running[pool.submit(run_job, job)] = job
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                job = running.pop(future)
                result = future.result()
                with args.log.open("a") as log:
                    log.write(json.dumps(result) + "\n")
                last = result["curve"]["points"][-1]
                print(f"  {job['row']['label']} seed {job['seed']}: {result['seconds']:.0f} s, "
                      f"eval {max(last[1]):.4f} at {last[0]:,} tokens per worker", flush=True)


# --- the report -------------------------------------------------------------------------------

def tokens_to(points: list[list[Any]], target: float) -> int | None:
    """Tokens per worker at the first evaluation where every worker is at or below the target."""
    return next((int(tokens) for tokens, losses in points if max(losses) <= target), None)


def loss_at(points: list[list[Any]], tokens: int) -> float | None:
    """The mean over workers of the last evaluation at or before `tokens` per worker."""
    before = [losses for t, losses in points if t <= tokens]
    return statistics.fmean(before[-1]) if before else None


def summarize(entries: list[dict[str, Any]], steps: int, parameters: int, batch: int) -> dict[str, Any]:
    target = target_of(entries, steps)
    if target is None:
        raise SystemExit("learning: no DDP M=4 row in the log yet (run --rows ddp:4 first)")
    step_tokens = batch * SHAPE["seq_len"]
    budget = steps * step_tokens
    by_label: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        if json.loads(entry["key"])[2] == steps:
            by_label.setdefault(entry["row"]["label"], []).append(entry)
    rows = []
    for label, runs in by_label.items():
        row = runs[0]["row"]
        per_seed = [tokens_to(r["curve"]["points"], target) for r in runs]
        equal = [loss_at(r["curve"]["points"], budget) for r in runs]
        averages = None
        if row["kind"] == "diloco" and all(t is not None for t in per_seed):
            averages = max(math.ceil(t / (row["h"] * step_tokens)) for t in per_seed if t)
        sent = None  # payload bytes per worker to the target (the median seed's run)
        if row["kind"] == "diloco" and all(t is not None for t in per_seed):
            sent = statistics.median(_bytes_to(r, target) for r in runs)
        elif row["kind"] == "ddp" and all(t is not None for t in per_seed):
            sent = statistics.median(t / step_tokens * ring_all_reduce_bytes(parameters, row["workers"])
                                     for t in per_seed if t)
        rows.append({"label": label, "row": row, "seeds": [r["seed"] for r in runs], "tokens": per_seed,
                     "tokens_median": statistics.median(t for t in per_seed) if all(per_seed) else None,
                     "loss_at_budget": equal, "averages": averages, "bytes_per_worker": sent,
                     "weight_removed": removed(runs),
                     "seconds": sum(r["seconds"] for r in runs)})
    # the best schedule tried for one worker alone (the one that reaches the target soonest)
    alone = min((r["tokens_median"] for r in rows if r["row"]["kind"] == "alone" and r["tokens_median"]), default=None)
    targets = target_rows(entries, steps)
    ddp = next((r for r in rows if targets.get(r["label"]) == target), None)  # the DDP the target is
    alone_curves: dict[str, list[list[list[Any]]]] = {}  # by schedule, each seed's curve
    for e in entries:
        if e["row"]["kind"] == "alone" and json.loads(e["key"])[2] == steps:
            alone_curves.setdefault(e["row"]["label"], []).append(e["curve"]["points"])
    for r in rows:
        r["gain"] = alone / r["tokens_median"] if alone and r["tokens_median"] else None
        r["gain_at_budget"] = gain_at_budget(r["loss_at_budget"], alone_curves, budget)
    longest = max((int(points[-1][0]) for runs in alone_curves.values() for points in runs), default=None)
    return {"target": target, "target_label": ddp["label"] if ddp else None, "budget_tokens": budget,
            "batch_size": batch, "alone_tokens": alone, "alone_longest": longest,
            "g_ddp": ddp["gain"] if ddp else None, "rows": rows}


def removed(runs: list[dict[str, Any]]) -> float | None:
    """The mean share of a round's declared work the trust bounds took away, over the rounds of every
    seed (harness.simulator.Curve.weight_removed); None for DDP, alone, and logs from before it."""
    shares = [x for r in runs for x in r["curve"].get("weight_removed", [])]
    return statistics.fmean(shares) if shares else None


def gain_at_budget(losses: list[float | None], alone_curves: dict[str, list[list[list[Any]]]],
                   budget: int) -> float | None:
    """How many times the budget one worker alone needs to reach the row's mean eval loss at the
    budget: for each alone schedule the median over its seeds (as the gain over alone takes alone's
    median tokens; a seed that never gets there counts as never), the best schedule's. A gain
    measured where a row misses the target, since every row trains to the budget. None when no
    alone schedule got there."""
    reached = [x for x in losses if x is not None]
    if not reached or not alone_curves:
        return None
    loss = statistics.fmean(reached)
    medians = [statistics.median(t or math.inf for t in (tokens_to(points, loss) for points in runs))
               for runs in alone_curves.values()]
    best = min(medians)
    return best / budget if math.isfinite(best) else None


def _bytes_to(entry: dict[str, Any], target: float) -> float:
    """Payload bytes each worker fetched up to the first evaluation at the target."""
    curve, workers = entry["curve"], entry["row"]["workers"]
    for (_, losses), fetched in zip(curve["points"], curve["payload_bytes"], strict=True):
        if max(losses) <= target:
            return fetched / workers
    return math.inf


def rank(row: dict[str, Any]) -> tuple[float, float]:
    """Best first: fewest tokens to the target, then the lowest mean eval loss at the budget."""
    losses = [x for x in row["loss_at_budget"] if x is not None]
    return (row["tokens_median"] or math.inf, statistics.fmean(losses) if losses else math.inf)


def reach_sentence(summary: dict[str, Any]) -> str:
    """How far one worker alone is from the target: its tokens to it and G_DDP, or, where no alone run
    got there, the bound its longest run sets on G_DDP."""
    if summary["g_ddp"]:
        return f"One worker alone needs {summary['alone_tokens']:,.0f} tokens to it; DDP's gain G_DDP = " \
               f"{summary['g_ddp']:.2f}x."
    ddp = next((r for r in summary["rows"] if r["label"] == summary["target_label"]), None)
    longest = summary["alone_longest"]
    if not (ddp and ddp["tokens_median"] and longest):
        return "No alone run reached it."
    return f"No alone run reached it in up to {longest:,} tokens, so G_DDP > {longest / ddp['tokens_median']:.1f}x."


def markdown(summary: dict[str, Any], steps: int) -> str:
    g_ddp, ddp_bytes = summary["g_ddp"], None
    for r in summary["rows"]:
        if r["label"] == summary["target_label"]:
            ddp_bytes = r["bytes_per_worker"]
    cores = machine_info()["nproc"]
    lines = [f"# Joining pays? The learning simulator ({time.strftime('%Y-%m-%d')}, {cores} CPU cores)",
             "", f"`llama-2m`, BPE 4,096 on the standard library's sources, {summary['batch_size']} x "
             f"{SHAPE['seq_len']} tokens per worker step. Target: {summary['target_label']}'s worst final eval "
             f"loss over its seeds after {steps} steps (DDP at the settings tried that make it lowest) = "
             f"**{summary['target']:.4f}**. " + reach_sentence(summary), "",
             "| row | seeds | tokens per worker to target (each seed) | gain over alone (median) | vs G_DDP | "
             "eval at the budget (each seed) | gain at the budget | averages to target | payload bytes per worker | "
             "fewer than DDP | weight removed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted(summary["rows"], key=rank)
    for r in order:
        tokens = ", ".join(f"{t:,}" if t else "–" for t in r["tokens"])
        equal = ", ".join(f"{x:.4f}" if x is not None else "–" for x in r["loss_at_budget"])
        gain = f"{r['gain']:.2f}x" if r["gain"] else "–"
        vs = f"{r['gain'] / g_ddp:.2f}" if r["gain"] and g_ddp else "–"
        sent = f"{r['bytes_per_worker']:,.0f}" if r["bytes_per_worker"] else "–"
        fewer = f"{ddp_bytes / r['bytes_per_worker']:,.0f}x" if ddp_bytes and r["bytes_per_worker"] else "–"
        at_budget = f"{r['gain_at_budget']:.2f}x" if r.get("gain_at_budget") else "–"
        share = f"{100 * r['weight_removed']:.1f} %" if r.get("weight_removed") is not None else "–"
        lines.append(f"| {r['label']} | {len(r['seeds'])} | {tokens} | {gain} | {vs} | {equal} | {at_budget} | "
                     f"{r['averages'] or '–'} | {sent} | {fewer} | {share} |")
    lines += ["", "Tokens: the first evaluation (one per round for nodes, every --eval-every steps for DDP and "
              "alone) at which every worker's φ is at or below the target. Gain: alone's median tokens over the "
              "row's. Eval at the budget: the workers' mean eval loss at DDP's token budget per worker. Gain at the "
              "budget: the tokens one worker alone needs to reach that loss (the row's mean over seeds; alone's "
              "median over its seeds, its best schedule), over the budget. Bytes: "
              "payloads each worker fetched (the all-gather's; DDP: a ring all-reduce of fp32 gradients, "
              "2(M−1)/M x 4 B x parameters per step). Weight removed: the mean share of a round's declared work "
              "the token cap and the norm clip took away (outer/aggregate.removed_share).", "",
              "Reproduce: `.venv/bin/python benchmarks/learning.py run --rows ROWS --seeds 0,1,2`, then "
              "`.venv/bin/python benchmarks/learning.py report`."]
    return "\n".join(lines) + "\n"


def plot(entries: list[dict[str, Any]], summary: dict[str, Any], labels: list[str], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(9, 5.5))
    for label in labels:
        runs = [e for e in entries if e["row"]["label"] == label]
        if not runs:
            continue
        grid = sorted({int(t) for e in runs for t, _ in e["curve"]["points"]})
        curves = [[loss_at(e["curve"]["points"], t) for t in grid] for e in runs]
        mean = [statistics.fmean(c[i] for c in curves if c[i] is not None) for i in range(len(grid))]
        low = [min(c[i] for c in curves if c[i] is not None) for i in range(len(grid))]
        high = [max(c[i] for c in curves if c[i] is not None) for i in range(len(grid))]
        line, = axis.plot(grid, mean, label=f"{label} ({len(runs)} seeds)")
        axis.fill_between(grid, low, high, color=line.get_color(), alpha=0.2)
    axis.axhline(summary["target"], color="grey", linestyle="--", linewidth=0.8, label="target")
    axis.set_xlabel("tokens per worker")
    axis.set_ylabel("eval loss (mean over workers; band: min–max over seeds)")
    axis.set_ylim(summary["target"] - 0.3, summary["target"] + 1.2)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(args: argparse.Namespace) -> None:
    from diloco_node.train.model import build_model, count_parameters

    entries = read_log(args.log)
    parameters = count_parameters(build_model(SHAPE["model"], 0))
    summary = summarize(entries, args.steps, parameters, args.batch_size)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / names(args.batch_size)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine_info(), "shape": shape(args.batch_size),
                                                     "steps": args.steps, **summary}, indent=1))
    stem.with_suffix(".md").write_text(markdown(summary, args.steps))
    best = [r["label"] for r in sorted(summary["rows"], key=rank)]
    plot(entries, summary, best[:6], stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "report"))
    parser.add_argument("--rows", default="ddp:4;alone;4:30:sync=blocking,compression=none,inner_lr=0.0004,"
                        "outer_lr=0.7,outer_momentum=0.9")
    parser.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--steps", type=int, default=800, help="DDP steps per worker: the token budget")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--max-token-factor", type=float, default=1.5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "diloco_learning_cache")
    parser.add_argument("--batch-size", type=int, default=SHAPE["batch_size"],
                        help="sequences per worker step (a batch's runs have a log and a report of their own)")
    parser.add_argument("--log", type=Path, help="default: benchmarks/results/learning[_bB]_runs.jsonl")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    args.log = args.log or RESULTS_DIR / f"{names(args.batch_size)}_runs.jsonl"
    return args


def main() -> None:
    args = parse_args()
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
