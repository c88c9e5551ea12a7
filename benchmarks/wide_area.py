"""Overlap on slow links: data-parallel vs blocking / delayed / eager DiLoCo between two islands.

Two network namespaces ("islands") joined through a hub by veth pairs, each island's access line
rate-limited with `tc tbf` (tests/network/islands.py). At each rate, side by side on the same link:

- raw TCP: one bulk connection, the reference for throughput;
- DDP: gloo all-reduce of the gradients every step across the link (a fixed number of steps: its
  time per step, compute utilization and wire bytes; its eval loss at equal tokens does not depend on
  the link and comes from the same training on loopback);
- DiLoCo with --sync blocking, delayed and eager through the real CLI (and two variants that explain
  the defaults: eager with DESIGN §3's literal proxy and momentum 0.9, blocking with momentum 0.6):
  wall time per round, compute utilization, eval loss at equal tokens, wire bytes (veth counters),
  the swarm's throughput while fetching payloads as a fraction of raw TCP, and how far the two
  nodes' φ ended apart.

Run as root: `.venv/bin/python benchmarks/wide_area.py` (about 20 minutes on 2 cores); results go
to benchmarks/results/wide_area.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the island harness lives in tests/network

from common import RESULTS_DIR, WORLD, NodeProcess, final_eval_loss, machine_info, node_args, parse_node_log, pyplot  # noqa: E402
from diloco_vs_ddp import outer_difference, run_ddp  # noqa: E402

from diloco_node.config import NodeConfig  # noqa: E402
from tests.network.islands import Islands, require_netns  # noqa: E402

NAME = "wide_area"
SYNC_MODES = ("blocking", "delayed", "eager")
# DiLoCo runs at each rate: the three modes at their defaults, then the variants that explain the choice
# of defaults (DESIGN §3's literal eager proxy with DiLoCo's momentum; blocking with eager's momentum).
RUNS = {"blocking": ["--sync", "blocking"], "delayed": ["--sync", "delayed"], "eager": ["--sync", "eager"],
        "eager share μ0.9": ["--sync", "eager", "--eager-proxy", "share", "--outer-momentum", "0.9"],
        "blocking μ0.6": ["--sync", "blocking", "--outer-momentum", "0.6"]}


# --- data-parallel across the link ------------------------------------------------------------

def ddp_worker(rank: int, master: str, port: int, steps: int, eval_every: int = 0) -> None:
    """One DDP rank inside an island; prints its timings as JSON. Started by run_ddp_on_link.

    With `eval_every`, rank 0 also evaluates the held-out loss every that many steps and after the
    last: (step, unix time, seconds the evaluation took, eval loss) each."""
    import torch.distributed as dist
    from common import inner_config

    from diloco_node.train.data import ByteDataset, load_corpus
    from diloco_node.train.inner import InnerTrainer, evaluate
    from diloco_node.train.model import build_model

    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    torch.set_num_threads(1)  # like the nodes' --threads 1
    store = dist.TCPStore(master, port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    cfg = NodeConfig()
    dataset = ByteDataset(load_corpus(cfg.data), cfg.seq_len)
    model = build_model(cfg.model, cfg.seed)
    communicating = [0.0]  # seconds spent inside all-reduce during the current step

    def average_gradient(param: torch.Tensor) -> None:
        assert param.grad is not None
        started = time.perf_counter()
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(WORLD)
        communicating[0] += time.perf_counter() - started

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(average_gradient)
    trainer = InnerTrainer(model, inner_config(cfg, steps))
    eval_batches = dataset.eval_batches(cfg.batch_size, cfg.eval_batches) if eval_every and rank == 0 else []
    step_seconds: list[float] = []
    comm_seconds: list[float] = []
    evals: list[tuple[int, float, float, float]] = []
    for step in range(steps):
        x, y = dataset.train_batch(cfg.batch_size, 1000 + rank, step)
        communicating[0] = 0.0
        started = time.perf_counter()
        trainer.train_step(x, y)
        step_seconds.append(time.perf_counter() - started)
        comm_seconds.append(communicating[0])
        if eval_batches and ((step + 1) % eval_every == 0 or step + 1 == steps):
            started = time.perf_counter()
            loss = evaluate(model, eval_batches)
            evals.append((step + 1, time.time(), time.perf_counter() - started, loss))
    dist.destroy_process_group()
    print(json.dumps({"step_seconds": step_seconds, "comm_seconds": comm_seconds, "evals": evals}), flush=True)


def run_ddp_on_link(islands: Islands, steps: int, timeout: float, eval_every: int = 0) -> dict[str, Any]:
    """DDP between islands 0 and 1 for `steps` steps (see ddp_worker for `eval_every`)."""
    a, b = islands[0], islands[1]
    port = 29500
    before = wire_bytes(islands)
    launched = time.time()
    workers = [island.run([sys.executable, __file__, "ddp-worker", str(rank), a.address, str(port), str(steps),
                           str(eval_every)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank, island in enumerate((a, b))]
    outputs = []
    for worker in workers:
        out, err = worker.communicate(timeout=timeout)
        if worker.returncode != 0:
            raise RuntimeError(f"DDP worker failed ({worker.returncode}): {err[-2000:]}")
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    wire = wire_bytes(islands, before)
    timings = outputs[0]
    warm = slice(2, None)  # the first steps include gloo's connection set-up
    step = statistics.mean(timings["step_seconds"][warm])
    comm = statistics.mean(timings["comm_seconds"][warm])
    return {"method": "ddp", "steps": steps, "seconds_per_step": step, "comm_seconds_per_step": comm,
            "utilization": (step - comm) / step, "wire_bytes_per_step": wire / steps, "launched_at": launched,
            "step_seconds": timings["step_seconds"], "comm_seconds": timings["comm_seconds"],
            "evals": timings["evals"]}


# --- DiLoCo across the link -------------------------------------------------------------------

def run_diloco_on_link(islands: Islands, name: str, h: int, rounds: int, work: Path, timeout: float,
                       options: list[str], join_timeout: float | None = None) -> dict[str, Any]:
    """A pair of nodes, one per island, to their last round. With `join_timeout`: raises when they have
    not both joined the run within that many seconds of the launch (e.g. one refused the other)."""
    a, b = islands[0], islands[1]
    run_id = f"wide-{os.getpid()}-{int(time.time())}"
    work.mkdir(parents=True)
    before = wire_bytes(islands)
    started, launched = time.monotonic(), time.time()
    first = NodeProcess("node1", node_args(h, rounds, run_id, work / "ck1", options, host=a.address), work,
                        launcher=a.command)
    nodes = [first]
    try:
        address = first.wait_for("stdout", "peer address:", 60)
        nodes.append(NodeProcess("node2", node_args(h, rounds, run_id, work / "ck2", options, host=b.address)
                                 + ["--peer", address], work, launcher=b.command))
        for node in nodes if join_timeout is not None else []:
            node.wait_joined(max(1.0, started + join_timeout - time.monotonic()))
        for node in nodes:
            node.proc.wait(timeout=max(1.0, started + timeout - time.monotonic()))
    finally:
        for node in nodes:
            node.stop()
    wall = time.monotonic() - started
    for node in nodes:
        if node.proc.returncode != 0:
            raise RuntimeError(f"{name}: {node.name} exited with {node.proc.returncode}\n{node.tail()}")
    logs = [parse_node_log(node) for node in nodes]
    wire = wire_bytes(islands, before)
    return {**summarize(name, h, rounds, logs, wall, wire, outer_difference(run_id, work / "ck1", work / "ck2")),
            "launched_at": launched}


def summarize(name: str, h: int, rounds: int, logs: list[dict[str, Any]], wall: float, wire: int,
              drift: dict[str, Any]) -> dict[str, Any]:
    # Round 0 of each node includes waiting for the other to start; the steady state is what counts.
    steady = [r for log in logs for r in log["rounds"][1:]]
    compute = sum(r["seconds"] * r["utilization"] for r in steady)
    total = sum(r["seconds"] for r in steady)
    transfers = [r for log in logs for r in log["rounds"] if r.get("transfer_seconds", 0) > 0.05]
    return {
        "method": name, "H": h, "rounds": rounds, "logs": logs, "wall_seconds": wall,
        "seconds_per_round": statistics.median(r["seconds"] for r in steady),
        "utilization": compute / total if total else None,
        "final_eval_loss_per_node": [final_eval_loss(log) for log in logs],
        "final_eval_loss": statistics.mean(final_eval_loss(log) for log in logs),
        "wire_bytes_per_round": wire / rounds,
        "transfer_mbit": [8 * r["transfer_bytes"] / r["transfer_seconds"] / 1e6 for r in transfers],
        "outer_params_difference": drift,
    }


def wire_bytes(islands: Islands, since: int = 0) -> int:
    """Bytes on the islands' links (tx of every island), less `since`."""
    return sum(island.tx_bytes() for island in islands) - since


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
    if len(sys.argv) > 1 and sys.argv[1] == "ddp-worker":
        ddp_worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return
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
