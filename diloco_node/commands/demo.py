"""`diloco-node demo`: a real local swarm of `diloco-node join` processes, a progress bar, a summary.

The demo drives the same CLI a volunteer uses (through diloco_node/commands/launch.py); it only reads what the
nodes print (their addresses, and their JSON events: joined, each round, settled), so what it
reports is what the nodes did.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from tqdm import tqdm

from diloco_node.commands.launch import NodeProcess

FP32_BYTES = 4


@dataclass
class NodeProgress:
    eval_before: float | None = None
    parameters: int = 0
    rounds: list[tuple[int, float, int, int, int]] = field(default_factory=list)  # round, eval, group, sent, recv
    eval_settled: float | None = None  # eval loss once the last exchange was applied
    sent_settling: int = 0  # what that last exchange sent after the last round
    errors: list[str] = field(default_factory=list)


def progress_of(node: NodeProcess) -> NodeProgress:
    """A node's figures for the summary, from its events (and its log lines that report an error)."""
    progress = NodeProgress()
    for event in list(node.events):
        if event["event"] == "joined":
            progress.eval_before, progress.parameters = float(event["eval_loss"]), int(event["parameters"])
        elif event["event"] == "round":
            progress.rounds.append((int(event["round"]), float(event["eval_loss"]), int(event["group_size"]),
                                    int(event["bytes_sent"]), int(event["bytes_received"])))
        elif event["event"] == "settled":  # eager / delayed, after the last round
            progress.eval_settled, progress.sent_settling = float(event["eval_loss"]), int(event["bytes_sent"])
    progress.errors = [line.strip() for line in list(node.stderr_lines) if "error" in line.lower()]
    return progress


# What stops the demo: Ctrl-C (SIGINT to the terminal's foreground group), `kill` (SIGTERM), a closed
# terminal (SIGHUP). Each is passed on to the nodes, which run in sessions of their own and would
# otherwise outlive the demo.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Deferral:
    """A stop held back while a node is being started: raised between Popen and its pid being
    kept, it would leave that node running unseen. (Blocking the signals instead would not do:
    the node would inherit the blocked mask and never see a stop.)"""

    def __init__(self) -> None:
        self.active = False
        self.pending = False

    def __enter__(self) -> None:
        self.active = True

    def __exit__(self, *_: object) -> None:
        self.active = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


_starting = _Deferral()


def _as_ctrl_c(_signum: int, _frame: FrameType | None) -> None:
    if _starting.active:
        _starting.pending = True
        return
    raise KeyboardInterrupt


def _stop_nodes(nodes: list[NodeProcess]) -> list[int]:
    """Ctrl-C: each node stops at its next safe point; a second Ctrl-C stops them at once.

    The nodes get SIGTERM, not SIGINT: hivemind's averager ignores SIGINT in the node's process
    while it starts (daemon/lifecycle.py), and a node stopped then would never see it."""
    for attempt in range(2):
        for node in nodes:
            if node.running():
                node.signal(signal.SIGTERM)
        try:
            return _exit_codes(nodes)
        except KeyboardInterrupt:
            if attempt == 1:
                raise
    return _exit_codes(nodes)


def _exit_codes(nodes: list[NodeProcess]) -> list[int]:
    """Each started node's exit code, once it exited and its last lines (its settled eval) were read."""
    return [node.wait_exit(timeout=None) for node in nodes if node.process is not None]


def _first_address(node: NodeProcess) -> str:
    """The node's first peer address, once it printed it; '' when it exited without one."""
    node.reached(lambda: node.address is not None, timeout=None)
    return node.address or ""


def _on_round(bar: tqdm) -> Callable[[dict[str, Any]], None]:
    """Each round event moves the bar (on the node's reader thread)."""
    def update(event: dict[str, Any]) -> None:
        if event["event"] == "round":
            bar.update(1)
            bar.set_postfix(eval_loss=f"{float(event['eval_loss']):.3f}")
    return update


def run_demo(nodes: int, rounds: int, inner_steps: int, model: str) -> int:
    for signum in STOP_SIGNALS:
        signal.signal(signum, _as_ctrl_c)
    run_id = f"demo-{secrets.token_hex(3)}"
    threads = max(1, (os.cpu_count() or 1) // nodes)
    workdir = Path(tempfile.mkdtemp(prefix="diloco-demo-"))
    common = ["--run-id", run_id, "--model", model, "--inner-steps", str(inner_steps), "--max-outer-steps",
              str(rounds), "--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0",
              "--threads", str(threads), "--min-peers", str(nodes), "--log-level", "INFO"]
    print(f"demo: {nodes} nodes, run {run_id}, {rounds} rounds of H={inner_steps}, logs in {workdir}")
    bar = tqdm(total=nodes * rounds, desc="outer rounds (all nodes)", unit="round")
    started: list[NodeProcess] = []
    try:
        first_address = ""
        for index in range(nodes):
            args = common + ["--checkpoint-dir", str(workdir / f"node{index}")]
            args += ["--peer", first_address] if index else []
            # each node in a session of its own (launch.py): the terminal's Ctrl-C reaches the demo
            # only, which passes exactly one stop signal on to each node (a node takes a second one as
            # "stop now, without saving"); the user's DILOCO_* settings apply, as to any node they start
            node = NodeProcess(f"node{index}", args, workdir, env=dict(os.environ), on_event=_on_round(bar))
            started.append(node)
            with _starting:
                node.start()
            if index == 0:
                first_address = _first_address(node)
                if not first_address:
                    node.wait_exit(timeout=None)
                    bar.close()
                    print(f"demo: the first node failed to start; see {workdir / 'node0.log'}", file=sys.stderr)
                    return 1
        codes = _exit_codes(started)
    except KeyboardInterrupt:
        print("\ndemo: stopping the nodes at their next safe point (Ctrl-C again to stop them now)")
        codes = _stop_nodes(started)
    bar.close()
    print(summary([progress_of(node) for node in started], nodes, inner_steps))
    return 0 if all(code == 0 for code in codes) else 1


def summary(progresses: list[NodeProgress], nodes: int, inner_steps: int) -> str:
    lines = ["", f"{'node':>4} {'eval at start':>11} {'eval after':>10} {'rounds':>6} {'avg group':>9} "
             f"{'bytes/round':>12} {'B/param/round':>13} {'vs all-reduce':>13}"]
    for index, progress in enumerate(progresses):
        if not progress.rounds:
            lines.append(f"{index:>4} finished no round" + (f": {progress.errors[-1]}" if progress.errors else ""))
            continue
        rounds = len(progress.rounds)
        sent = sum(r[3] for r in progress.rounds) + progress.sent_settling
        per_round = sent / rounds
        per_param = per_round / max(progress.parameters, 1)
        # Data-parallel ring all-reduce sends 2(M-1)/M of the fp32 gradient every step.
        ring = 2 * (nodes - 1) / nodes * FP32_BYTES * progress.parameters * inner_steps * rounds
        reduction = f"{ring / sent:.0f}x less" if sent else "n/a"
        # over the exchanges applied (under eager a round applies the previous one's; the first none)
        groups = [r[2] for r in progress.rounds if r[2]]
        group = sum(groups) / len(groups) if groups else 0.0
        eval_after = progress.eval_settled if progress.eval_settled is not None else progress.rounds[-1][1]
        lines.append(f"{index:>4} {progress.eval_before or float('nan'):>13.4f} {eval_after:>10.4f} "
                     f"{rounds:>6} {group:>9.2f} {per_round:>12,.0f} {per_param:>13.3f} {reduction:>13}")
    lines.append(f"bytes are this node's payload sent per round (pseudo-gradients, and the start state it served "
                 f"to nodes that joined after it); 'vs all-reduce' compares with data-parallel "
                 f"training sending {nodes}-way ring all-reduces every step for the same tokens.")
    return "\n".join(lines)
