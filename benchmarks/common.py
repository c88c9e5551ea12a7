"""Helpers shared by the benchmarks: real `diloco-node join` subprocesses, their events, machine info.

The benchmarks drive the real CLI on loopback (through diloco_node/launch.py, the launcher the tests
and the demo use too) and read the JSON events the nodes print (`--events -`); nothing here imports
the node's internals. Run the benchmarks as scripts (`.venv/bin/python benchmarks/<name>.py`): the
script's folder is then on sys.path, so `from common import ...` finds this file.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from diloco_node import launch
from diloco_node.config import NodeConfig
from diloco_node.train.inner import InnerConfig

WORLD = 2  # workers / nodes per configuration
# DiLoCo as published: each round waits for the group's mean, so every node holds the same φ, with
# outer momentum 0.9. The codec and data-parallel comparisons pin it (the node's default is eager);
# the eager comparisons are benchmarks of their own (wide_area.py, eager_loss.py).
BLOCKING_FLAGS = ("--sync", "blocking")
STOP_BOUND = 30.0  # README: a stop takes at most this plus the exchange in flight
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# A diloco_node warning on a node's stderr (the log format of cli.setup_logging; hivemind's log
# setup renames WARNING to WARN). Warnings are log lines, not events.
WARNING_RE = re.compile(r" WARN(ING)? diloco_node")


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


def read_lo_bytes() -> int | None:
    """Transmit byte counter of the loopback interface (machine-wide), or None where unavailable."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, sep, counters = line.partition(":")
            if sep and name.strip() == "lo":
                return int(counters.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return None


def lo_per_node(before: int | None, after: int | None, nodes: int = WORLD) -> int | None:
    return None if before is None or after is None else (after - before) // nodes


def inner_config(cfg: NodeConfig, total_steps: int) -> InnerConfig:
    """What Node builds for a run of `total_steps` = max_outer_steps * inner_steps."""
    return InnerConfig(lr=cfg.inner_lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                       total_steps=total_steps, grad_clip=cfg.grad_clip)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class NodeProcess:
    """A `diloco-node join` subprocess (the package's launcher, diloco_node/launch.py) with what the
    benchmarks use: its stdout/stderr lines, kept in <log_dir>/<name>.{stdout,stderr}.log and awaitable,
    its events (`node.events`), and a stop that never kills silently."""

    def __init__(self, name: str, args: list[str], log_dir: Path,
                 launcher: Callable[[list[str]], list[str]] | None = None):
        """`launcher` wraps the command line, e.g. Island.command to run the node in a network namespace."""
        self.name = name
        # DILOCO_* variables of the caller's shell are left out: only our flags count
        self.node = launch.NodeProcess(name, list(args), log_dir, wrap=launcher,
                                       log_path=log_dir / f"{name}.stderr.log",
                                       stdout_log_path=log_dir / f"{name}.stdout.log").start()
        assert self.node.process is not None
        self.proc = self.node.process

    @property
    def lines(self) -> dict[str, list[str]]:
        """Its stdout (addresses and JSON events) and stderr (the log) lines so far, without newlines."""
        return {"stdout": [line.rstrip("\n") for line in self.node.stdout_lines],
                "stderr": [line.rstrip("\n") for line in self.node.stderr_lines]}

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.node.events

    def _await(self, predicate: Callable[[], Any], timeout: float, what: str) -> None:
        """Raises RuntimeError if the node exits first, TimeoutError when `timeout` seconds pass."""
        if self.node.reached(predicate, timeout):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited (rc={self.proc.returncode}) before {what}\n{self.tail()}")
        raise TimeoutError(f"{self.name}: no {what} within {timeout:.0f}s\n{self.tail()}")

    def wait_for(self, stream: str, prefix: str, timeout: float) -> str:
        """The rest of the first `stream` line containing `prefix`; raises if the node exits first."""
        lines = self.node.stdout_lines if stream == "stdout" else self.node.stderr_lines

        def first() -> str | None:
            return next((line for line in lines if prefix in line), None)

        self._await(lambda: first() is not None, timeout, f"'{prefix}'")
        return str(first()).split(prefix, 1)[1].strip()

    def wait_joined(self, timeout: float) -> int:
        """The round of its `joined` event (it found its peers under --min-peers)."""
        self._await(lambda: self.node.joined_round is not None, timeout, "'joined' event")
        assert self.node.joined_round is not None
        return self.node.joined_round

    def tail(self, n: int = 15) -> str:
        return "\n".join(f"  {self.name}: {line}" for line in self.lines["stderr"][-n:])

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def stop(self) -> None:
        """SIGTERM (the node checkpoints and leaves); a node that hangs is SIGKILLed, and says so."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_BOUND)
            except subprocess.TimeoutExpired:
                print(f"WARNING: {self.name} did not stop within {STOP_BOUND:.0f}s of SIGTERM; killing it",
                      file=sys.stderr)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # this node's own session only
        code = self.proc.wait()
        self.node.drain()  # its last events (the last round, settled) may still be in the pipe
        if code not in (0, -signal.SIGKILL):
            print(f"WARNING: {self.name} exited {code}\n{self.tail()}", file=sys.stderr)


def node_args(h: int, rounds: int, run_id: str, checkpoint_dir: Path | str, extra: Sequence[str] = (),
              host: str = "127.0.0.1", min_peers: int = WORLD) -> list[str]:
    """`join` flags of a benchmark node: listens on `host`, one torch thread, waits for `min_peers` nodes
    (all WORLD nodes of a pair unless told otherwise)."""
    return ["--listen", f"/ip4/{host}/tcp/0", "--status", "127.0.0.1:0", "--threads", "1",
            "--max-outer-steps", str(rounds), "--inner-steps", str(h), "--run-id", run_id,
            "--checkpoint-dir", str(checkpoint_dir), "--min-peers", str(min_peers), *extra]


def start_swarm(n: int, h: int, rounds: int, run_id: str, work: Path, timeout: float,
                checkpoint_dirs: Sequence[Path | str] | None = None, extra: Sequence[str] = ()) -> list[NodeProcess]:
    """Node 1 without --peer, then nodes 2..n pointed at the address node 1 prints; all wait for n peers.

    Node i checkpoints to work/ck<i> unless `checkpoint_dirs` (one per node) says otherwise ('' = none).
    """
    dirs = list(checkpoint_dirs) if checkpoint_dirs is not None else [work / f"ck{i}" for i in range(1, n + 1)]
    if len(dirs) != n:
        raise ValueError(f"{len(dirs)} checkpoint dirs for {n} nodes")
    nodes = [NodeProcess("node1", node_args(h, rounds, run_id, dirs[0], extra, min_peers=n), work)]
    try:
        address = nodes[0].wait_for("stdout", "peer address:", timeout)
        for i in range(2, n + 1):
            nodes.append(NodeProcess(f"node{i}", node_args(h, rounds, run_id, dirs[i - 1], extra, min_peers=n)
                                     + ["--peer", address], work))
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def start_pair(h: int, rounds: int, run_id: str, work: Path, timeout: float,
               checkpoint_dirs: Sequence[Path | str] | None = None, extra: Sequence[str] = ()) -> list[NodeProcess]:
    """Node 1 without --peer, then node 2 pointed at the address node 1 prints.

    Checkpoints go to work/ck1 and work/ck2 unless `checkpoint_dirs` says otherwise ('' = none).
    """
    return start_swarm(WORLD, h, rounds, run_id, work, timeout, checkpoint_dirs, extra)


class StartupStalled(TimeoutError):
    """The nodes of a pair did not both report `joined` in time (e.g. they never saw each other)."""


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
    lo_before, started = read_lo_bytes(), time.monotonic()
    nodes = start_swarm(n, h, rounds, run_id, work, timeout, checkpoint_dirs, extra)
    try:
        if join_timeout is not None:
            for node in nodes:
                try:
                    node.wait_joined(max(1.0, started + join_timeout - time.monotonic()))
                except TimeoutError as exc:
                    raise StartupStalled(f"{label}: {exc}") from None
        deadline = started + timeout
        for node in nodes:
            try:
                node.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{label}: {node.name} did not finish within {timeout:.0f}s"
                                   f"\n{node.tail()}") from None
    finally:
        for node in nodes:
            node.stop()
    wall, lo_after = time.monotonic() - started, read_lo_bytes()
    for node in nodes:
        if node.proc.returncode != 0:
            raise RuntimeError(f"{label}: {node.name} exited with {node.proc.returncode}\n{node.tail()}")
    return [parse_node_log(node) for node in nodes], wall, lo_per_node(lo_before, lo_after, n)


def parse_node_log(node: NodeProcess) -> dict[str, Any]:
    """What a node reported, from its events (its warnings from its log): `joined`, `rounds` (one entry
    per round event, in order), `synced_round` (the last sync from peers), `settled` and `warnings`.
    `time`: when the node emitted the event (unix seconds)."""
    node.node.drain()  # a node that has exited: its last events may still be in the pipe
    parsed: dict[str, Any] = {"rounds": [], "joined": None, "synced_round": None, "settled": None, "warnings": []}
    for event in list(node.events):
        kind = event["event"]
        if kind == "round":
            parsed["rounds"].append({
                "round": int(event["round"]), "time": float(event["time"]), "loss": float(event["loss"]),
                "eval_loss": float(event["eval_loss"]),
                "group_size": int(event["group_size"]), "sent": int(event["bytes_sent"]),
                "received": int(event["bytes_received"]), "seconds": float(event["round_seconds"]),
                "digest": event["digest"], "payload": int(event["payload_bytes"]),
                "bytes_per_param": float(event["bytes_per_param"]), "codec_seconds": float(event["codec_seconds"]),
                # as the round's log line shows them: 0 where the round applied no exchange
                "utilization": float(event["utilization"]), "transfer_bytes": int(event["transfer_bytes"] or 0),
                "transfer_seconds": float(event["transfer_seconds"] or 0.0)})
        elif kind == "joined":
            parsed["joined"] = {"round": int(event["round"]), "time": float(event["time"]),
                                "eval_loss": float(event["eval_loss"]),
                                "parameters": int(event["parameters"]), "digest": event["digest"]}
        elif kind == "synced":
            parsed["synced_round"] = int(event["round"])
        elif kind == "settled":
            parsed["settled"] = {"round": int(event["round"]), "time": float(event["time"]),
                                 "eval_loss": float(event["eval_loss"]),
                                 "digest": event["digest"]}
    parsed["warnings"] = [line for line in node.lines["stderr"] if WARNING_RE.search(line)]
    if parsed["joined"] is None or not parsed["rounds"]:
        raise RuntimeError(f"{node.name} reported no 'joined' or no 'round' event\n{node.tail()}")
    return parsed


def read_events(path: Path) -> list[dict[str, Any]]:
    """A node's events from a copy of its stdout (<name>.stdout.log): the JSON lines, in order."""
    return [event for line in path.read_text().splitlines() if (event := launch.parse_event(line)) is not None]


def final_eval_loss(log: dict[str, Any]) -> float:
    """Where the node ended: after delayed / eager settled the last exchange, else its last round."""
    return float((log["settled"] or log["rounds"][-1])["eval_loss"])


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
