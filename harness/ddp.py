"""The data-parallel baseline of the benchmarks: DDP with the node's own model, data, inner optimizer
and held-out eval batches, 2 gloo ranks that all-reduce (average) the gradients every step, then the
package's InnerTrainer clips and takes the AdamW step with the hyperparameters and warmup+cosine
schedule of a node whose R*H equals the DDP step count.

- `run_ddp`: both ranks on loopback (torch.multiprocessing, TCP store on 127.0.0.1): eval loss per
  step count, gradient bytes, whether the replicas end identical (benchmarks/diloco_vs_ddp.py).
- `run_ddp_on_link`: one rank in each of two (or `world`) islands (harness/islands.py): time per step
  and inside all-reduce, wire bytes per step, evaluations with their time (wide_area.py, headline.py,
  deep.py). Each rank is `python -m harness.ddp RANK MASTER PORT STEPS EVAL_EVERY` inside its island.
- `run_ddp_local`: the same rank processes on loopback, any world (1: one node alone, a plain
  training loop), optionally on another model and data (`overrides`: NodeConfig fields; deep.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diloco_node.config import NodeConfig
from diloco_node.train.bytedata import ByteDataset
from diloco_node.train.data import open_data
from diloco_node.train.inner import InnerTrainer, evaluate
from diloco_node.train.model import build_model, count_parameters, logits_of
from diloco_node.train.sources import load_corpus
from harness import wire
from harness.bench import free_port, inner_config
from harness.islands import Islands
from harness.nodes import WORLD


def ring_all_reduce_bytes(parameters: int, world: int) -> float:
    """What each worker sends per step in a ring all-reduce of fp32 gradients: 2 (M − 1) / M of them."""
    return 2 * (world - 1) / world * 4 * parameters


# --- on loopback ------------------------------------------------------------------------------

def ddp_worker(rank: int, port: int, steps: int, eval_every: int, queue: Any) -> None:
    """One DDP rank: own batches, gradients averaged every step, then the node's AdamW step."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)  # like the nodes' --threads 1
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    cfg = NodeConfig.model_validate({"sync": "blocking"})
    dataset = ByteDataset(load_corpus(cfg.inputs.data), cfg.inputs.seq_len)
    eval_batches = dataset.eval_batches(cfg.inputs.batch_size, cfg.inputs.eval_batches)
    model = build_model(cfg.inputs.model, cfg.inputs.seed)
    reduced = [0]  # elements all-reduced during the current step

    def average_gradient(param: torch.Tensor) -> None:
        # Fires once per parameter when its gradient is complete (the tied embedding included,
        # after both uses are summed), so the clip inside train_step sees the averaged gradient.
        assert param.grad is not None
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(WORLD)
        reduced[0] += param.grad.numel()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(average_gradient)
    trainer = InnerTrainer(model, inner_config(cfg, steps))
    evals = [(0, evaluate(model, eval_batches))] if rank == 0 else []
    losses, grad_bytes = [], []
    started = time.monotonic()
    for step in range(steps):
        x, y = dataset.train_batch(cfg.inputs.batch_size, 1000 + rank, step)
        reduced[0] = 0
        losses.append(trainer.train_step(x, y))
        grad_bytes.append(reduced[0] * 4)  # fp32 gradients
        if rank == 0 and ((step + 1) % eval_every == 0 or step + 1 == steps):
            evals.append((step + 1, evaluate(model, eval_batches)))
    seconds = time.monotonic() - started
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    checksums = [torch.zeros(2, dtype=torch.float64) for _ in range(WORLD)]
    dist.all_gather(checksums, torch.stack([flat.double().sum(), flat.double().square().sum()]))
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"evals": evals, "losses": losses, "grad_bytes_per_step": grad_bytes, "train_seconds": seconds,
                   "parameters": count_parameters(model),
                   "replicas_identical": all(torch.equal(checksums[0], c) for c in checksums)})


def run_ddp(steps: int, eval_every: int, cfg: NodeConfig, timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    lo_before, started = wire.loopback_bytes(), time.monotonic()
    workers = [ctx.Process(target=ddp_worker, args=(rank, port, steps, eval_every, queue)) for rank in range(WORLD)]
    for worker in workers:
        worker.start()
    try:
        result = queue.get(timeout=timeout)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
    wall, lo_after = time.monotonic() - started, wire.loopback_bytes()
    if any(worker.exitcode != 0 for worker in workers):
        raise RuntimeError(f"DDP worker failed: exit codes {[w.exitcode for w in workers]}")
    params = result["parameters"]
    ring_per_step = ring_all_reduce_bytes(params, WORLD)
    tokens_per_step = cfg.inputs.batch_size * cfg.inputs.seq_len
    return {
        "method": "ddp", "H": 1, "steps_per_worker": steps, **result,
        "tokens_per_node": [steps * tokens_per_step] * WORLD,
        "curve": [{"tokens": WORLD * s * tokens_per_step, "eval_loss": loss} for s, loss in result["evals"]],
        "final_eval_loss": result["evals"][-1][1],
        "exchanges": steps, "ring_bytes_per_step_per_node": ring_per_step,
        "bytes_sent_per_node": [round(ring_per_step * steps)] * WORLD,
        "bytes_per_param_per_exchange": ring_per_step / params,
        "lo_bytes_per_node_upper_bound": wire.per_node(lo_before, lo_after, WORLD), "wall_seconds": wall,
    }


# --- across a link between islands (or on loopback, one process per rank) -------------------

def worker_data(overrides: dict[str, Any]) -> tuple[NodeConfig, Any, Any]:
    """(config, train batch of (rank seed, step), eval batches) of a rank. Without overrides: the node's
    defaults on the byte dataset the headline's figures were measured with; with them (model, data,
    tokenizer, seq_len, batch_size, ... as NodeConfig fields): the node's own data path (train/data.py)."""
    cfg = NodeConfig.model_validate(overrides)
    if not overrides:
        dataset = ByteDataset(load_corpus(cfg.inputs.data), cfg.inputs.seq_len)
        return (cfg, lambda seed, step: dataset.train_batch(cfg.inputs.batch_size, seed, step),
                lambda: dataset.eval_batches(cfg.inputs.batch_size, cfg.inputs.eval_batches))
    data = open_data(cfg.inputs.data, cfg.inputs.tokenizer, cfg.inputs.seq_len, cfg.inputs.text_column)
    return (cfg, lambda seed, step: data.train_batch(cfg.inputs.batch_size, seed, step),
            lambda: data.eval_batches(cfg.inputs.batch_size, cfg.inputs.eval_batches))


def link_worker(rank: int, master: str, port: int, steps: int, eval_every: int = 0, world: int = WORLD,
                overrides: dict[str, Any] | None = None, iface: str = "eth0", stop_below: float | None = None) -> None:
    """One DDP rank (inside an island, or on loopback with iface 'lo'); prints its timings as JSON.
    Started by run_ddp_on_link / run_ddp_local (`python -m harness.ddp RANK MASTER PORT STEPS EVAL_EVERY
    [--world N] [--config JSON] [--iface NAME]`). World 1 is a plain training loop: no communication.

    With `eval_every`, rank 0 also evaluates the held-out loss every that many steps and after the
    last: (step, unix time, seconds the evaluation took, eval loss) each. With `stop_below` (world 1 only:
    the other ranks would wait for its all-reduce), it stops after the first evaluation at or below it."""
    if stop_below is not None and world != 1:
        raise ValueError("stop_below needs world 1")
    os.environ["GLOO_SOCKET_IFNAME"] = iface
    torch.set_num_threads(1)  # like the nodes' --threads 1
    store = dist.TCPStore(master, port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    cfg, train_batch, make_eval = worker_data(overrides or {})
    model = build_model(cfg.inputs.model, cfg.inputs.seed)
    forward = logits_of(model)
    communicating = [0.0]  # seconds spent inside all-reduce during the current step

    def average_gradient(param: torch.Tensor) -> None:
        assert param.grad is not None
        started = time.perf_counter()
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(world)
        communicating[0] += time.perf_counter() - started

    if world > 1:
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(average_gradient)
    trainer = InnerTrainer(model, inner_config(cfg, steps), forward)
    eval_batches = make_eval() if eval_every and rank == 0 else []
    step_seconds: list[float] = []
    comm_seconds: list[float] = []
    evals: list[tuple[int, float, float, float]] = []
    for step in range(steps):
        x, y = train_batch(1000 + rank, step)
        communicating[0] = 0.0
        started = time.perf_counter()
        trainer.train_step(x, y)
        step_seconds.append(time.perf_counter() - started)
        comm_seconds.append(communicating[0])
        if eval_batches and ((step + 1) % eval_every == 0 or step + 1 == steps):
            started = time.perf_counter()
            loss = evaluate(model, eval_batches, forward=forward)
            evals.append((step + 1, time.time(), time.perf_counter() - started, loss))
            if stop_below is not None and loss <= stop_below:
                break
    dist.destroy_process_group()
    print(json.dumps({"step_seconds": step_seconds, "comm_seconds": comm_seconds, "evals": evals,
                      "parameters": count_parameters(model)}), flush=True)


def worker_command(rank: int, master: str, port: int, steps: int, eval_every: int, world: int,
                   overrides: dict[str, Any] | None, iface: str, stop_below: float | None = None) -> list[str]:
    command = [sys.executable, "-m", "harness.ddp", str(rank), master, str(port), str(steps), str(eval_every)]
    if world != WORLD:
        command += ["--world", str(world)]
    if overrides:
        command += ["--config", json.dumps(overrides)]
    if stop_below is not None:
        command += ["--stop-below", repr(stop_below)]
    return [*command, "--iface", iface]


def collect(workers: list[subprocess.Popen[str]], steps: int, timeout: float, launched: float) -> dict[str, Any]:
    """Rank 0's timings (and evaluations) once every rank has finished."""
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=timeout)
            if worker.returncode != 0:
                raise RuntimeError(f"DDP worker failed ({worker.returncode}): {err[-2000:]}")
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=10)
    timings = outputs[0]
    warm = slice(2, None) if steps > 2 else slice(None)  # the first steps include gloo's connection set-up
    step = statistics.mean(timings["step_seconds"][warm])
    comm = statistics.mean(timings["comm_seconds"][warm])
    return {"method": "ddp", "steps": steps, "seconds_per_step": step, "comm_seconds_per_step": comm,
            "utilization": (step - comm) / step, "launched_at": launched,
            "step_seconds": timings["step_seconds"], "comm_seconds": timings["comm_seconds"],
            "evals": timings["evals"], "parameters": timings.get("parameters")}


def run_ddp_on_link(islands: Islands, steps: int, timeout: float, eval_every: int = 0, world: int = WORLD,
                    overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """DDP between islands 0..world-1 (one rank each) for `steps` steps (see link_worker for `eval_every`
    and `overrides`)."""
    ranks = islands.islands[:world]
    if len(ranks) < world:
        raise ValueError(f"{world} ranks need {world} islands, not {len(islands)}")
    port = 29500
    before = wire.wire_bytes(islands)
    launched = time.time()
    workers = [island.run(worker_command(rank, ranks[0].address, port, steps, eval_every, world, overrides, "eth0"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank, island in enumerate(ranks)]
    result = collect(workers, steps, timeout, launched)
    return {**result, "wire_bytes_per_step": wire.wire_bytes(islands, before) / steps}


def run_ddp_local(steps: int, timeout: float, eval_every: int = 0, world: int = WORLD,
                  overrides: dict[str, Any] | None = None, stop_below: float | None = None) -> dict[str, Any]:
    """The same ranks on loopback (no link): the loss against steps; world 1 is one node alone (which may
    stop at a target: `stop_below`)."""
    port = free_port()
    launched = time.time()
    workers = [subprocess.Popen(worker_command(rank, "127.0.0.1", port, steps, eval_every, world, overrides, "lo",
                                               stop_below),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank in range(world)]
    return collect(workers, steps, timeout, launched)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.ddp")
    for name in ("rank", "master", "port", "steps", "eval_every"):
        parser.add_argument(name, type=str if name == "master" else int)
    parser.add_argument("--world", type=int, default=WORLD)
    parser.add_argument("--config", type=json.loads, default=None, help="NodeConfig fields as JSON")
    parser.add_argument("--iface", default="eth0")
    parser.add_argument("--stop-below", type=float, default=None, help="world 1: stop at this eval loss")
    args = parser.parse_args(argv)
    link_worker(args.rank, args.master, args.port, args.steps, args.eval_every, args.world, args.config, args.iface,
                args.stop_below)


if __name__ == "__main__":
    main(sys.argv[1:])
