"""Real `diloco-node join` nodes for the tests and the benchmarks, through the one launcher
(diloco_node/commands/launch.py's NodeProcess): their flags, swarms of them on loopback, and what their events
say once they have finished.

Everything is read from the nodes' own JSON events (`launch.parse_event`); warnings are log lines.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from diloco_node.commands.launch import NodeProcess
from diloco_node.telemetry.record import RoundRecord, SettledRecord
from harness.pace import paced_environment, reports

# Fast test-node flags: tiny batches on loopback, one torch thread.
FAST = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0", "--threads", "1", "--seq-len", "64",
        "--batch-size", "8", "--eval-batches", "2", "--warmup-steps", "5", "--matchmaking-time", "2",
        # most tests check that φ agrees bit for bit, which only blocking promises; a later --sync wins
        "--sync", "blocking"]


def fast_on(listen_port: int = 0, status_port: int = 0) -> list[str]:
    """FAST, listening for peers on `listen_port` and serving status on `status_port` (0: any free one)."""
    flags = list(FAST)
    flags[flags.index("--listen") + 1] = f"/ip4/127.0.0.1/tcp/{listen_port}"
    flags[flags.index("--status") + 1] = f"127.0.0.1:{status_port}"
    return flags


WORLD = 2  # workers / nodes per benchmark configuration
# DiLoCo as published, the step the codec, layout, NoLoCo and data-parallel comparisons were measured
# with: each round waits for the group's mean (every node holds the same φ), inner lr 4e-4, outer
# Nesterov 0.7 / 0.9. The node's own defaults differ since #39 (plain averaging at inner lr 1.6e-3,
# config/defaults.py), so these pin the step that their results describe; an error-feedback codec
# takes its own outer step instead of PUBLISHED_OUTER (benchmarks/codecs.py). The eager comparisons
# are benchmarks of their own (wide_area.py, eager_loss.py).
BLOCKING_FLAGS = ("--sync", "blocking", "--inner-lr", "4e-4")
PUBLISHED_OUTER = ("--outer-lr", "0.7", "--outer-momentum", "0.9")
PUBLISHED_FP32 = (*BLOCKING_FLAGS, *PUBLISHED_OUTER, "--compression", "none")  # the baseline row of a headline
STOP_BOUND = 30.0  # README: a stop takes at most this plus the exchange in flight

# A diloco_node warning on a node's stderr (the log format of cli.setup_logging; hivemind's log
# setup renames WARNING to WARN). Warnings are log lines, not events.
WARNING_RE = re.compile(r" WARN(ING)? diloco_node")


def start_node(name: str, args: list[str], log_dir: Path,
               wrap: Callable[[list[str]], list[str]] | None = None, step_seconds: float | None = None) -> NodeProcess:
    """A benchmark node, started: its stdout and stderr kept in <log_dir>/<name>.{stdout,stderr}.log.
    `wrap` wraps its command line, e.g. Island.command to run it in a network namespace. `step_seconds`:
    each inner step takes that long (harness/pace.py), an emulated slower machine."""
    return NodeProcess(name, list(args), log_dir, wrap=wrap, log_path=log_dir / f"{name}.stderr.log",
                       stdout_log_path=log_dir / f"{name}.stdout.log",
                       env=paced_environment(step_seconds) if step_seconds is not None else None).start()


def stop(node: NodeProcess) -> int | None:
    """SIGTERM (the node checkpoints and leaves); a node that hangs is SIGKILLed, and says so; so does a
    node that exits with an error. Its exit code (None: killed), once its last events are read."""
    code = node.terminate(STOP_BOUND)
    if code not in (0, None, -signal.SIGKILL):
        print(f"WARNING: {node.name} exited {code}\n{node.tail()}", file=sys.stderr)
    return code


def node_args(h: int, rounds: int, run_id: str, checkpoint_dir: Path | str, extra: Sequence[str] = (),
              host: str = "127.0.0.1", min_peers: int = WORLD) -> list[str]:
    """`join` flags of a benchmark node: listens on `host`, one torch thread, waits for `min_peers` nodes
    (all WORLD nodes of a pair unless told otherwise). `h` 0: no --inner-steps (rounds by --round-seconds
    in `extra`)."""
    return ["--listen", f"/ip4/{host}/tcp/0", "--status", "127.0.0.1:0", "--threads", "1",
            "--max-outer-steps", str(rounds), *(["--inner-steps", str(h)] if h else []), "--run-id", run_id,
            "--checkpoint-dir", str(checkpoint_dir), "--min-peers", str(min_peers), *extra]


def start_swarm(n: int, h: int, rounds: int, run_id: str, work: Path, timeout: float,
                checkpoint_dirs: Sequence[Path | str] | None = None, extra: Sequence[str] = ()) -> list[NodeProcess]:
    """Node 1 without --peer, then nodes 2..n pointed at the address node 1 prints; all wait for n peers.

    Node i checkpoints to work/ck<i> unless `checkpoint_dirs` (one per node) says otherwise ('' = none).
    """
    dirs = list(checkpoint_dirs) if checkpoint_dirs is not None else [work / f"ck{i}" for i in range(1, n + 1)]
    if len(dirs) != n:
        raise ValueError(f"{len(dirs)} checkpoint dirs for {n} nodes")
    nodes = [start_node("node1", node_args(h, rounds, run_id, dirs[0], extra, min_peers=n), work)]
    try:
        address = nodes[0].wait_for_address(timeout)
        for i in range(2, n + 1):
            nodes.append(start_node(f"node{i}", node_args(h, rounds, run_id, dirs[i - 1], extra, min_peers=n)
                                    + ["--peer", address], work))
    except BaseException:
        for node in nodes:
            stop(node)
        raise
    return nodes


def parse_node_log(node: NodeProcess) -> dict[str, Any]:
    """What a node reported, from its events (its warnings from its log): `joined`, `rounds` (one entry
    per round event, in order), `synced_round` (the last sync from peers), `settled` and `warnings`.
    `time`: when the node emitted the event (unix seconds)."""
    node.drain()  # a node that has exited: its last events may still be in the pipe
    parsed: dict[str, Any] = {"rounds": [], "joined": None, "synced_round": None, "settled": None, "warnings": [],
                              "pace": reports(node.stderr_lines)}
    for event in list(node.events):
        kind = event["event"]
        if kind == "round":
            record = RoundRecord.from_event(event)
            # the keys benchmarks' saved results have always used (scale.py reads older result files)
            parsed["rounds"].append({
                "round": record.round, "time": record.time, "loss": record.loss, "eval_loss": record.eval_loss,
                "group_size": record.group_size, "sent": record.bytes_sent, "received": record.bytes_received,
                "seconds": record.round_seconds, "digest": record.digest, "payload": record.payload_bytes,
                "bytes_per_param": record.bytes_per_param, "codec_seconds": record.codec_seconds,
                # as the round's log line shows them: 0 where the round applied no exchange
                "utilization": record.utilization, "transfer_bytes": record.transfer_bytes or 0,
                "transfer_seconds": record.transfer_seconds or 0.0,
                # what the node trained that round (under --round-seconds it varies with its speed)
                "inner_steps": record.last_round_inner_steps, "tokens": record.last_round_tokens})
        elif kind == "joined":
            parsed["joined"] = {"round": int(event["round"]), "time": float(event["time"]),
                                "eval_loss": float(event["eval_loss"]),
                                "parameters": int(event["parameters"]), "digest": event["digest"]}
        elif kind == "synced":
            parsed["synced_round"] = int(event["round"])
        elif kind == "settled":
            settled = SettledRecord.from_event(event)
            parsed["settled"] = {"round": settled.round, "time": float(event["time"]),
                                 "eval_loss": settled.eval_loss, "digest": settled.digest}
    parsed["warnings"] = [line.rstrip("\n") for line in list(node.stderr_lines) if WARNING_RE.search(line)]
    if parsed["joined"] is None or not parsed["rounds"]:
        raise RuntimeError(f"{node.name} reported no 'joined' or no 'round' event\n{node.tail()}")
    return parsed


def final_eval_loss(log: dict[str, Any]) -> float:
    """Where the node ended: after delayed / eager settled the last exchange, else its last round."""
    return float((log["settled"] or log["rounds"][-1])["eval_loss"])


def agreed_round(nodes: Sequence[NodeProcess], after: int) -> int | None:
    """The first round after `after` that every node logged with one digest."""
    common = set.intersection(*(set(node.rounds) for node in nodes))
    for round_ in sorted(r for r in common if r > after):
        if len({node.rounds[round_].digest for node in nodes}) == 1:
            return round_
    return None
