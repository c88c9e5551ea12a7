"""What the benchmarks share: whole runs of real nodes (a swarm on loopback, a pair across two
islands) summarised from their events, the final φ of a run, scratch folders, machine info and plots.

Run a benchmark as a script (`.venv/bin/python benchmarks/<name>.py`); it imports only diloco_node
and this package (installed with the project: `pip install -e '.[test,bench]'`).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from diloco_node.commands.launch import LaunchTimeout, NodeProcess
from diloco_node.config import FIELDS, NodeConfig
from diloco_node.daemon.checkpoint import CheckpointStore
from diloco_node.train.inner import InnerConfig
from harness import wire
from harness.islands import Islands
from harness.nodes import WORLD, final_eval_loss, node_args, parse_node_log, start_node, start_swarm, stop

RESULTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def parse_candidate(text: str) -> tuple[str, int, list[str]]:
    """`H:FLAGS` → (label, H, join options): eager unless FLAGS name another --sync."""
    h, _, flags = text.partition(":")
    options = shlex.split(flags)
    if "--sync" not in options:
        options = ["--sync", "eager", *options]
    named = dict(zip(options[::2], options[1:][::2], strict=False))
    rest = [f"{flag.removeprefix('--').replace('-', ' ')} {value}" for flag, value in named.items()
            if flag not in ("--sync", "--compression")]
    label = f"DiLoCo {named['--sync']} {named.get('--compression', FIELDS['compression'].default)}"
    return label + (f" ({', '.join(rest)})" if rest else ""), int(h), options


def verdict(measured: float | None, target: float) -> str:
    """A benchmark's ratio against its target, as its results table says it."""
    if measured is None:
        return "**miss** (target loss not reached)"
    if measured >= target:
        return "pass"
    return f"**miss** ({measured / target:.2f} of the target: {target / measured:.1f}x short)"


def unwind_on_sigterm() -> None:
    """A benchmark sent SIGTERM unwinds as on Ctrl-C, so that its `finally` blocks stop its nodes and
    its islands are removed; by default Python dies on the spot and left both behind (seen: a deep.py
    stopped with pkill left 12 node processes and five network namespaces)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


@contextlib.contextmanager
def work_dir(prefix: str) -> Iterator[Path]:
    """A scratch folder for a benchmark's node logs: removed after a run that succeeds, kept (and
    named) after one that fails, since the logs then say why."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    except BaseException:
        print(f"node logs kept in {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)


def inner_config(cfg: NodeConfig, total_steps: int) -> InnerConfig:
    """What Node builds for a run of `total_steps` = max_outer_steps * inner_steps."""
    return InnerConfig(lr=cfg.inner.inner_lr, weight_decay=cfg.inner.weight_decay, warmup_steps=cfg.inner.warmup_steps,
                       total_steps=total_steps, grad_clip=cfg.inner.grad_clip)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- a swarm on loopback ----------------------------------------------------------------------

class StartupStalled(TimeoutError):
    """The nodes of a swarm did not all report `joined` in time (e.g. they never saw each other)."""


def run_pair(label: str, h: int, rounds: int, run_id: str, work: Path, timeout: float,
             checkpoint_dirs: Sequence[Path | str] | None = None, extra: Sequence[str] = (),
             join_timeout: float | None = None) -> tuple[list[dict[str, Any]], float, int | None]:
    """Run a 2-node swarm to its last round: (parsed logs per node, wall seconds, lo bytes per node).

    With `join_timeout`, raises StartupStalled when the nodes have not both joined the run (reported
    `joined`, i.e. found each other under --min-peers) within that many seconds.
    """
    return run_swarm(label, WORLD, h, rounds, run_id, work, timeout, checkpoint_dirs, extra, join_timeout)


def run_swarm(label: str, n: int, h: int, rounds: int, run_id: str, work: Path, timeout: float,
              checkpoint_dirs: Sequence[Path | str] | None = None, extra: Sequence[str] = (),
              join_timeout: float | None = None) -> tuple[list[dict[str, Any]], float, int | None]:
    """Run an n-node swarm (start_swarm, --min-peers n) to its last round: (parsed logs per node, in node
    order, wall seconds, lo bytes per node). Each node's stdout and stderr are kept in
    work/node<i>.{stdout,stderr}.log.

    With `join_timeout`, raises StartupStalled when the nodes have not all joined the run (reported
    `joined`, i.e. found each other under --min-peers) within that many seconds.
    """
    work.mkdir(parents=True)
    lo_before, started = wire.loopback_bytes(), time.monotonic()
    nodes = start_swarm(n, h, rounds, run_id, work, timeout, checkpoint_dirs, extra)
    try:
        if join_timeout is not None:
            for node in nodes:
                try:
                    node.wait_joined(max(1.0, started + join_timeout - time.monotonic()))
                except LaunchTimeout as exc:
                    raise StartupStalled(f"{label}: {exc}") from None
        deadline = started + timeout
        for node in nodes:
            assert node.process is not None
            try:
                node.process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{label}: {node.name} did not finish within {timeout:.0f}s"
                                   f"\n{node.tail()}") from None
    finally:
        for node in nodes:
            stop(node)
    wall, lo_after = time.monotonic() - started, wire.loopback_bytes()
    for node in nodes:
        assert node.process is not None
        if node.process.returncode != 0:
            raise RuntimeError(f"{label}: {node.name} exited with {node.process.returncode}\n{node.tail()}")
    return [parse_node_log(node) for node in nodes], wall, wire.per_node(lo_before, lo_after, n)


# --- nodes across islands (a pair by default) ------------------------------------------

def run_diloco_on_link(islands: Islands, name: str, h: int, rounds: int, work: Path, timeout: float,
                       options: list[str], join_timeout: float | None = None, nodes: int = WORLD,
                       step_seconds: Sequence[float] | None = None,
                       until: Callable[[list[NodeProcess]], bool] | None = None) -> dict[str, Any]:
    """`nodes` nodes, one per island (islands 0..nodes-1), to their last round; node 1 first, the others
    pointed at it. With `join_timeout`: raises when they have not all joined the run within that many
    seconds of the launch (e.g. one refused another). `step_seconds` (one per node): node i's inner steps
    take step_seconds[i] each (harness/pace.py), an emulated machine of that speed. `until`: polled
    every second on the running nodes; once true the nodes are stopped (SIGTERM) before their last round."""
    if len(islands) < nodes:
        raise ValueError(f"{nodes} nodes need {nodes} islands, not {len(islands)}")
    if step_seconds is not None and len(step_seconds) != nodes:
        raise ValueError(f"{len(step_seconds)} step times for {nodes} nodes")
    run_id = f"wide-{os.getpid()}-{int(time.time())}"
    work.mkdir(parents=True)
    before = wire.wire_bytes(islands)
    started, launched = time.monotonic(), time.time()

    def launch(i: int, extra: list[str]) -> NodeProcess:
        island = islands[i]
        return start_node(f"node{i + 1}", node_args(h, rounds, run_id, work / f"ck{i + 1}", options,
                                                     host=island.address, min_peers=nodes) + extra,
                          work, wrap=island.command, step_seconds=step_seconds[i] if step_seconds else None)

    running = [launch(0, [])]
    try:
        address = running[0].wait_for_address(60)
        running += [launch(i, ["--peer", address]) for i in range(1, nodes)]
        if join_timeout is not None:
            for node in running:
                node.wait_joined(max(1.0, started + join_timeout - time.monotonic()))
        for node in running:
            assert node.process is not None
            while True:
                try:
                    node.process.wait(timeout=max(0.1, min(1.0, started + timeout - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > started + timeout:
                        raise
                    if until is not None and until(running):
                        break
            if until is not None and until(running):
                break
    finally:
        for node in running:
            stop(node)
    wall = time.monotonic() - started
    for node in running:
        assert node.process is not None
        if node.process.returncode != 0:
            raise RuntimeError(f"{name}: {node.name} exited with {node.process.returncode}\n{node.tail()}")
    logs = [parse_node_log(node) for node in running]
    moved = wire.wire_bytes(islands, before)
    return {**summarize_link_run(name, h, rounds, logs, wall, moved,
                                 outer_difference(run_id, *(work / f"ck{i + 1}" for i in range(nodes)))),
            "launched_at": launched}


def summarize_link_run(name: str, h: int, rounds: int, logs: list[dict[str, Any]], wall: float, wire_bytes: int,
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
        "wire_bytes_per_round": wire_bytes / rounds,
        "transfer_mbit": [8 * r["transfer_bytes"] / r["transfer_seconds"] / 1e6 for r in transfers],
        "outer_params_difference": drift,
    }


def outer_difference(run_id: str, *directories: Path) -> dict[str, Any]:
    """How far the nodes' final φ are apart, from the checkpoints they saved on leaving."""
    states = []
    for directory in directories:
        path = NodeConfig.model_validate({"run_id": run_id, "checkpoint_dir": str(directory)}).checkpoint_path
        assert path is not None
        if not path.exists():  # CheckpointStore would create it
            return {"max_abs": None, "elements_differing": None}
        store = CheckpointStore(path)
        try:
            states.append(store.load())
        finally:
            store.close()
    loaded = [state for state in states if state is not None]
    if len(loaded) < len(states):
        return {"max_abs": None, "elements_differing": None}
    # every node against the first (two nodes: the one pair)
    pairs = [(a, b) for other in loaded[1:] for a, b in zip(loaded[0]["outer_params"], other["outer_params"],
                                                              strict=True)]
    return {"max_abs": max(float((a - b).abs().max()) for a, b in pairs),
            "elements_differing": sum(int((a != b).sum()) for a, b in pairs)}


# --- reporting --------------------------------------------------------------------------------

def pair(values: list[Any], fmt: str = "{:,}") -> str:
    """One value when the nodes agree, else 'node1 / node2'."""
    return fmt.format(values[0]) if len(set(values)) == 1 else " / ".join(fmt.format(v) for v in values)


def machine_info() -> dict[str, Any]:
    import hivemind

    return {"nproc": os.cpu_count(), "torch": torch.__version__, "hivemind": hivemind.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine()}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'); skipping the plot", file=sys.stderr)
        return None
    return plt


def write_results(out_dir: Path, name: str, payload: dict[str, Any], text: str) -> None:
    """A benchmark's figures as `<name>.json` (every number) and `<name>.md` (the table docs/benchmarks.md quotes),
    and the table on stdout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (out_dir / f"{name}.md").write_text(text)
    print(text)
