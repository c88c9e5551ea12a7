"""DiLoCo vs data-parallel training at an equal number of training tokens, side by side in one run.

    .venv/bin/python benchmarks/diloco_vs_ddp.py            # ~10 min on 2 CPU cores
    .venv/bin/python benchmarks/diloco_vs_ddp.py --quick    # smoke test, ~1-2 min

(a) DDP (harness/ddp.py): 2 worker processes joined by torch.distributed (gloo, TCP store on
    127.0.0.1). Every step each rank backpropagates its own batch, the gradients are all-reduced (averaged) and the
    package's own InnerTrainer clips and takes the AdamW step, with the same hyperparameters and
    warmup+cosine schedule as a node whose R*H equals the DDP step count.
(b) DiLoCo: 2 nodes of the real CLI (`diloco-node join`) on loopback, for each H in --h-values,
    with R = ddp_steps / H rounds so each node trains the same number of inner steps as one DDP rank.

Both use the package's model, data, inner optimizer and held-out eval batches. Bytes:
  - DDP: the gradient bytes each rank all-reduces per step are measured (numel * 4, fp32), and the
    wire bytes per node are reported with the standard ring all-reduce cost 2*(M-1)/M * numel*4 per
    step (reduce-scatter + all-gather; gloo's ring algorithm; any all-reduce needs this much at M=2).
  - DiLoCo: the per-round sent/received bytes the nodes log (the fp32 pseudo-gradient payloads the
    nodes all-gather, (M-1) * (numel*4 + header) per round, which equals the ring cost at M=2, plus
    the state a late joiner downloads).
  - Both: the loopback interface's byte counter before/after each run, halved per node. It counts
    every packet on `lo` on this machine (headers, DHT, state download, anything else running), so it
    is an upper bound, not a measurement of the training traffic alone.

Node 2 is started as soon as node 1 prints its peer address. Both run with --min-peers 2, so node 1
does not train rounds alone while node 2 starts up; node 2 downloads node 1's round-0 state. Tokens
are counted from the logs (rounds logged x H x batch x seq per node) and reported, not assumed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_node.config import NodeConfig
from harness.bench import RESULTS_DIR, machine_info, outer_difference, pair, pyplot, run_pair
from harness.ddp import run_ddp
from harness.nodes import PUBLISHED_FP32, WORLD

NAME = "diloco_vs_ddp"

# --- (a) data-parallel: harness/ddp.py's run_ddp ----------------------------------------------

# --- (b) DiLoCo through the real CLI ----------------------------------------------------------

def run_diloco(h: int, rounds: int, cfg: NodeConfig, work: Path, timeout: float) -> dict[str, Any]:
    run_id = f"bench-h{h}-{os.getpid()}-{int(time.time())}"
    logs, wall, lo_node = run_pair(f"H={h}", h, rounds, run_id, work, timeout, extra=list(PUBLISHED_FP32))
    result = summarize_diloco(h, rounds, cfg, logs, wall, lo_node)
    result["outer_params_difference"] = outer_difference(run_id, work / "ck1", work / "ck2")
    return result


def summarize_diloco(h: int, rounds: int, cfg: NodeConfig, logs: list[dict[str, Any]], wall: float,
                     lo_node: int | None) -> dict[str, Any]:
    tokens_per_step = cfg.inputs.batch_size * cfg.inputs.seq_len
    params = logs[0]["joined"]["parameters"]
    final = [log["rounds"][-1] for log in logs]
    sent = [sum(r["sent"] for r in log["rounds"]) for log in logs]
    exchanges = [sum(1 for r in log["rounds"] if r["group_size"] > 1) for log in logs]
    # Swarm-wide tokens behind φ after round r: every round line of every node up to r is H steps.
    ends = sorted({r["round"] for log in logs for r in log["rounds"]})
    by_round = {r["round"]: r["eval_loss"] for r in logs[0]["rounds"]}
    curve = [{"tokens": 0, "eval_loss": logs[0]["joined"]["eval_loss"]}] + [
        {"tokens": h * tokens_per_step * sum(1 for log in logs for r in log["rounds"] if r["round"] <= end),
         "eval_loss": by_round[end]} for end in ends if end in by_round]
    return {
        "method": "diloco", "H": h, "rounds": rounds, "logs": logs, "curve": curve,
        "tokens_per_node": [len(log["rounds"]) * h * tokens_per_step for log in logs],
        "rounds_per_node": [len(log["rounds"]) for log in logs],
        "final_eval_loss": final[0]["eval_loss"], "final_eval_loss_per_node": [f["eval_loss"] for f in final],
        "replicas_identical": len({f["digest"] for f in final}) == 1,
        "bytes_sent_per_node": sent, "bytes_received_per_node": [sum(r["received"] for r in log["rounds"])
                                                                 for log in logs],
        "exchanges_per_node": exchanges,
        # The typical round (the median) leaves out the state node 1 serves node 2 once, at join.
        "bytes_per_param_per_exchange": statistics.median(
            [r["sent"] for log in logs for r in log["rounds"] if r["group_size"] > 1] or [0]) / params,
        "lo_bytes_per_node_upper_bound": lo_node, "wall_seconds": wall,
        "warnings": sum(len(log["warnings"]) for log in logs),
    }


# --- report -----------------------------------------------------------------------------------

def markdown(results: list[dict[str, Any]]) -> str:
    ddp = results[0]
    ddp_bytes = sum(ddp["bytes_sent_per_node"]) / WORLD
    rows = ["| method | H | tokens per node | final eval loss | eval loss ratio vs DDP | bytes sent per node | "
            "bytes/param/exchange | traffic reduction vs DDP | lo bytes per node (upper bound) | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        mean_sent = sum(res["bytes_sent_per_node"]) / WORLD
        reduction = f"{ddp_bytes / mean_sent:.1f}x" if mean_sent else "n/a"
        lo = res["lo_bytes_per_node_upper_bound"]
        rows.append(f"| {res['method']} | {res['H']} | {pair(res['tokens_per_node'])} | {res['final_eval_loss']:.4f} | "
                    f"{res['final_eval_loss'] / ddp['final_eval_loss']:.3f} | {pair(res['bytes_sent_per_node'])} | "
                    f"{res['bytes_per_param_per_exchange']:.2f} | {reduction} | "
                    f"{'n/a' if lo is None else f'{lo:,}'} | {res['wall_seconds']:.0f} |")
    return "\n".join(rows)


def notes(results: list[dict[str, Any]], cfg: NodeConfig) -> str:
    ddp = results[0]
    lines = [
        f"Model `{cfg.inputs.model}` ({ddp['parameters']:,} parameters), batch {cfg.inputs.batch_size} x seq "
        f"{cfg.inputs.seq_len} bytes, {WORLD} workers/nodes, embedded corpus, eval on the nodes' "
        f"{cfg.inputs.eval_batches} held-out batches.",
        f"DDP: {ddp['steps_per_worker']} steps per worker, gradients all-reduced every step; bytes sent are the "
        "standard ring all-reduce cost 2(M-1)/M x numel x 4 B per step (measured gradient payload: "
        f"{ddp['grad_bytes_per_step'][0]:,} B per rank per step). DiLoCo: bytes from the nodes' per-round logs (fp32 "
        "pseudo-gradient payloads with their wire header, plus the φ and momentum node 2 downloads at join); "
        "bytes/param/exchange is the median round.",
        "\"exchange\" = one DDP step or one DiLoCo round that averaged with a peer. `lo` = machine-wide loopback "
        "transmit counter delta / 2 (TCP/IP headers, DHT, state download and any unrelated traffic included): "
        "an upper bound on the mean bytes a node sent.",
    ]
    for res in results[1:]:
        diff = res["outer_params_difference"]
        slowest = max(r["seconds"] for log in res["logs"] for r in log["rounds"])
        lines.append(f"DiLoCo H={res['H']}: {res['rounds']} rounds, rounds per node {pair(res['rounds_per_node'])}, "
                     f"exchanges per node {pair(res['exchanges_per_node'])}, final eval loss per node "
                     f"{pair(res['final_eval_loss_per_node'], '{:.4f}')}, final φ bit-identical on both nodes: "
                     f"{res['replicas_identical']} (max |φ1-φ2| = {diff['max_abs']:.3g}, "
                     f"{diff['elements_differing']:,} elements differ), node warnings: {res['warnings']}, "
                     f"slowest round {slowest:.1f} s.")
    lines.append(f"DDP replicas identical at the end: {ddp['replicas_identical']}. Wall times include process "
                 "start-up (~5-8 s); a DiLoCo round also waits matchmaking_time (3 s) for its group.")
    return "\n".join(f"- {line}" for line in lines)


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        label = "DDP (all-reduce every step)" if res["method"] == "ddp" else f"DiLoCo H={res['H']}"
        ax.plot([p["tokens"] / 1e6 for p in res["curve"]], [p["eval_loss"] for p in res["curve"]],
                marker="." if res["method"] == "ddp" else "o", markersize=4, label=label)
    ax.set_xlabel(f"training tokens, summed over the {WORLD} workers (millions)")
    ax.set_ylabel("held-out eval loss (nats/byte)")
    ax.set_title("DiLoCo vs data-parallel at equal tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(results: list[dict[str, Any]], args: argparse.Namespace, cfg: NodeConfig, out: Path,
                  total_seconds: float) -> str:
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": NAME, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "total_seconds": total_seconds,
        "config": {key: value for key, value in cfg.flat().items() if key in {
            "model", "seq_len", "batch_size", "eval_batches", "seed", "inner_lr", "warmup_steps", "weight_decay",
            "grad_clip", "outer_lr", "outer_momentum", "matchmaking_time"}},
        "machine": machine_info(),
        "results": results,
    }
    (out / f"{NAME}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return write_report(payload, cfg, out)


def write_report(payload: dict[str, Any], cfg: NodeConfig, out: Path) -> str:
    """The markdown table and the plot, from the JSON's numbers alone (see --report-only)."""
    results, total_seconds = payload["results"], payload["total_seconds"]
    table = markdown(results)
    machine = payload["machine"]
    (out / f"{NAME}.md").write_text(
        f"# DiLoCo vs data-parallel ({payload['date']}, {machine['nproc']} CPU cores, torch {machine['torch']})\n\n"
        f"{table}\n\n{notes(results, cfg)}\n\nTotal benchmark time: {total_seconds:.0f} s. "
        f"Reproduce: `.venv/bin/python benchmarks/{NAME}.py`. Plot: `{NAME}.png`.\n")
    plot(results, out / f"{NAME}.png")
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp-steps", type=int, help="DDP steps per worker = inner steps per node (default 400)")
    parser.add_argument("--h-values", type=str, help="comma-separated DiLoCo H values, each dividing --ddp-steps "
                        "(default 20,50)")
    parser.add_argument("--ddp-eval-every", type=int, help="DDP eval interval in steps (default 20)")
    parser.add_argument("--quick", action="store_true", help="small smoke run (60 steps, H=10,30), ~1-2 min")
    parser.add_argument("--out-dir", type=Path, help=f"results folder (default {RESULTS_DIR}; "
                        "--quick: a fresh temp folder)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per configuration")
    parser.add_argument("--keep-logs", action="store_true", help="keep the nodes' logs and checkpoints")
    parser.add_argument("--report-only", action="store_true", help="rewrite the markdown and plot from the "
                        "JSON in --out-dir without training")
    args = parser.parse_args()
    args.ddp_steps = args.ddp_steps or (60 if args.quick else 400)
    args.h_values = [int(v) for v in (args.h_values or ("10,30" if args.quick else "20,50")).split(",")]
    args.ddp_eval_every = args.ddp_eval_every or (10 if args.quick else 20)
    if args.out_dir is None:
        args.out_dir = Path(tempfile.mkdtemp(prefix=f"{NAME}_quick_")) if args.quick else RESULTS_DIR
    for h in args.h_values:
        if h <= 0 or args.ddp_steps % h:
            parser.error(f"H={h} does not divide --ddp-steps {args.ddp_steps}: tokens would not be equal")
    return args


def main() -> None:
    args = parse_args()
    cfg = NodeConfig(sync="blocking")
    if args.report_only:
        payload = json.loads((args.out_dir / f"{NAME}.json").read_text())
        print(write_report(payload, cfg, args.out_dir))
        return
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"{NAME}_work_"))
    keep = args.keep_logs
    try:
        print(f"DDP: {WORLD} workers x {args.ddp_steps} steps ...", flush=True)
        results = [run_ddp(args.ddp_steps, args.ddp_eval_every, cfg, args.timeout)]
        print(f"  eval loss {results[0]['final_eval_loss']:.4f} in {results[0]['wall_seconds']:.0f}s", flush=True)
        for h in args.h_values:
            rounds = args.ddp_steps // h
            print(f"DiLoCo: {WORLD} nodes, H={h}, {rounds} rounds ...", flush=True)
            res = run_diloco(h, rounds, cfg, work / f"h{h}", args.timeout)
            results.append(res)
            print(f"  eval loss {res['final_eval_loss']:.4f} in {res['wall_seconds']:.0f}s", flush=True)
    except BaseException:
        keep = True  # the logs are what explains a failure
        raise
    finally:
        if keep:
            print(f"node logs and checkpoints kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for res in results[1:]:
        for log in res["logs"]:  # raw per-round numbers stay in the JSON; the full log lines do not
            log["warnings"] = log["warnings"][:20]
    table = write_results(results, args, cfg, args.out_dir, time.monotonic() - started)
    print(f"\nresults in {args.out_dir}\n\n{table}\n\ntotal {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
