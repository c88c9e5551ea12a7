"""`diloco-node demo`: a real local swarm of `diloco-node join` processes, a progress bar, a summary.

The demo drives the same CLI a volunteer uses; it only reads what the nodes print (their addresses
on stdout, one key=value line per round on stderr), so what it reports is what the nodes did.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tqdm import tqdm

ROUND_LINE = re.compile(r"round=(\d+) loss=([\d.]+) eval_loss=([\d.]+) group_size=(\d+) sent=(\d+) received=(\d+)")
JOIN_LINE = re.compile(r"joined run=\S+ round=(\d+) eval_loss=([\d.]+) parameters=(\d+)")
# eager / delayed, after the last round
SETTLED_LINE = re.compile(r"settled round=\d+ eval_loss=([\d.]+) sent=(\d+)")
FP32_BYTES = 4


@dataclass
class NodeProgress:
    eval_before: float | None = None
    parameters: int = 0
    rounds: list[tuple[int, float, int, int, int]] = field(default_factory=list)  # round, eval, group, sent, recv
    eval_settled: float | None = None  # eval loss once the last exchange was applied
    sent_settling: int = 0  # what that last exchange sent after the last round line
    errors: list[str] = field(default_factory=list)


def _start_node(args: list[str], log: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A session of its own: the terminal's Ctrl-C reaches the demo only, which passes exactly one
    # SIGINT on to each node (a node takes a second one as "stop now, without saving").
    return subprocess.Popen([sys.executable, "-m", "diloco_node", "join", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=log.parent, start_new_session=True)


def _stop_nodes(processes: list[subprocess.Popen[str]]) -> list[int]:
    """Ctrl-C: each node stops at its next safe point; a second Ctrl-C stops them at once."""
    for attempt in range(2):
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        try:
            return [process.wait() for process in processes]
        except KeyboardInterrupt:
            if attempt == 1:
                raise
    return [process.wait() for process in processes]


def _first_peer_address(process: subprocess.Popen[str]) -> str | None:
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("peer address: "):
            return line.split(": ", 1)[1].strip()
    return None


def _follow(stream: IO[str], progress: NodeProgress, bar: tqdm, log: Path) -> None:
    with open(log, "w", buffering=1) as out:  # line-buffered: the log is readable while the demo runs
        for line in stream:
            out.write(line)
            if match := JOIN_LINE.search(line):
                progress.eval_before, progress.parameters = float(match[2]), int(match[3])
            elif match := ROUND_LINE.search(line):
                rnd, _, eval_loss, group, sent, recv = match.groups()
                progress.rounds.append((int(rnd), float(eval_loss), int(group), int(sent), int(recv)))
                bar.update(1)
                bar.set_postfix(eval_loss=f"{float(eval_loss):.3f}")
            elif match := SETTLED_LINE.search(line):
                progress.eval_settled, progress.sent_settling = float(match[1]), int(match[2])
            elif "error" in line.lower():
                progress.errors.append(line.strip())


def run_demo(nodes: int, rounds: int, inner_steps: int, model: str) -> int:
    run_id = f"demo-{secrets.token_hex(3)}"
    threads = max(1, (os.cpu_count() or 1) // nodes)
    workdir = Path(tempfile.mkdtemp(prefix="diloco-demo-"))
    common = ["--run-id", run_id, "--model", model, "--inner-steps", str(inner_steps), "--max-outer-steps",
              str(rounds), "--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0",
              "--threads", str(threads), "--min-peers", str(nodes), "--log-level", "INFO"]
    print(f"demo: {nodes} nodes, run {run_id}, {rounds} rounds of H={inner_steps}, logs in {workdir}")
    bar = tqdm(total=nodes * rounds, desc="outer rounds (all nodes)", unit="round")
    processes: list[subprocess.Popen[str]] = []
    progresses: list[NodeProgress] = []
    followers: list[threading.Thread] = []
    try:
        first_address = ""
        for index in range(nodes):
            args = common + ["--checkpoint-dir", str(workdir / f"node{index}")]
            args += ["--peer", first_address] if index else []
            process = _start_node(args, workdir / f"node{index}.log")
            progress = NodeProgress()
            assert process.stderr is not None
            follower = threading.Thread(target=_follow, daemon=True,
                                        args=(process.stderr, progress, bar, workdir / f"node{index}.log"))
            follower.start()
            followers.append(follower)
            processes.append(process)
            progresses.append(progress)
            if index == 0:
                first_address = _first_peer_address(process) or ""
                if not first_address:
                    process.wait()
                    bar.close()
                    print(f"demo: the first node failed to start; see {workdir / 'node0.log'}", file=sys.stderr)
                    return 1
        codes = [process.wait() for process in processes]
    except KeyboardInterrupt:
        print("\ndemo: stopping the nodes at their next safe point (Ctrl-C again to stop them now)")
        codes = _stop_nodes(processes)
    for follower in followers:  # a node's last lines (its settled eval) may still be in the pipe
        follower.join(timeout=10)
    bar.close()
    print(summary(progresses, nodes, inner_steps))
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
