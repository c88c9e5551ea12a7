"""Real `diloco-node join` processes for integration tests, and what they printed.

Each node's stdout (addresses) and stderr (one key=value log line per round) are read on threads,
so tests can wait for a round without polling files and without the pipes ever filling up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROUND = re.compile(r"round=(\d+) loss=\S+ eval_loss=([\d.]+) group_size=(\d+) .* digest=(\w+)")
GOSSIP = re.compile(r" consensus_distance=(\S+) group=(\S+)")
JOINED = re.compile(r"joined run=\S+ round=(\d+) eval_loss=([\d.]+)")
FAST = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0", "--threads", "1", "--seq-len", "64",
        "--batch-size", "8", "--eval-batches", "2", "--warmup-steps", "5", "--matchmaking-time", "2",
        # most tests check that φ agrees bit for bit, which only blocking promises; a later --sync wins
        "--sync", "blocking"]


@dataclass
class RoundLog:
    eval_loss: float
    group_size: int
    digest: str
    consensus_distance: float | None = None  # NoLoCo only, as are its group's peer ids
    group: tuple[str, ...] = ()


@dataclass
class NodeProcess:
    name: str
    args: list[str]
    workdir: Path
    process: subprocess.Popen[str] | None = None
    address: str | None = None
    status_url: str | None = None
    joined_eval_loss: float | None = None
    joined_round: int | None = None
    rounds: dict[int, RoundLog] = field(default_factory=dict)
    stderr_lines: list[str] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> NodeProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # a session of its own, as a program started in a terminal is the leader of its foreground
        # process group: `stop("ctrl-c")` signals that group as the terminal's Ctrl-C does
        self.process = subprocess.Popen([sys.executable, "-m", "diloco_node", "join", *self.args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                        cwd=self.workdir, start_new_session=True)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        return self

    def _read_stdout(self) -> None:
        assert self.process and self.process.stdout
        for line in self.process.stdout:
            with self._changed:
                if line.startswith("peer address: ") and self.address is None:
                    self.address = line.split(": ", 1)[1].strip()
                elif line.startswith("status: "):
                    self.status_url = line.split(": ", 1)[1].strip()
                self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process and self.process.stderr
        with open(self.workdir / f"{self.name}.log", "w") as log:
            for line in self.process.stderr:
                log.write(line)
                log.flush()
                with self._changed:
                    self.stderr_lines.append(line)
                    if match := ROUND.search(line):
                        entry = RoundLog(float(match[2]), int(match[3]), match[4])
                        if gossip := GOSSIP.search(line):
                            distance = None if gossip[1] == "-" else float(gossip[1])
                            entry = RoundLog(entry.eval_loss, entry.group_size, entry.digest, distance,
                                             tuple(gossip[2].split(",")))
                        self.rounds[int(match[1])] = entry
                    elif match := JOINED.search(line):
                        self.joined_round, self.joined_eval_loss = int(match[1]), float(match[2])
                    self._changed.notify_all()

    def wait_until(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.process and self.process.poll() is not None and not predicate()):
                    tail = "".join(self.stderr_lines[-15:])
                    code = self.process and self.process.poll()
                    raise AssertionError(f"{self.name}: {what} not reached (exit={code})"
                                         f"\n--- last log lines ---\n{tail}")
                self._changed.wait(min(remaining, 0.5))

    def wait_for_address(self, timeout: float = 60) -> str:
        self.wait_until(lambda: self.address is not None, timeout, "start-up")
        assert self.address is not None
        return self.address

    def wait_joined(self, timeout: float = 90) -> int:
        """The round this node starts training at (after syncing and waiting for --min-peers)."""
        self.wait_until(lambda: self.joined_round is not None, timeout, "joining")
        assert self.joined_round is not None
        return self.joined_round

    def wait_for_round(self, round_: int, timeout: float = 120) -> RoundLog:
        self.wait_until(lambda: round_ in self.rounds, timeout, f"round {round_}")
        return self.rounds[round_]

    def get(self, path: str) -> Any:
        """JSON from this node's status server, e.g. get("/api/history")."""
        assert self.status_url
        with urllib.request.urlopen(f"{self.status_url}{path}", timeout=10) as response:
            return json.loads(response.read())

    def status(self) -> dict[str, Any]:
        return dict(self.get("/api/status"))

    def log_text(self) -> str:
        with self._changed:
            return "".join(self.stderr_lines)

    def signal(self, signum: int) -> None:
        assert self.process
        self.process.send_signal(signum)

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.process
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout:.0f}s\n{self.stacks()}") from None

    def stacks(self) -> str:
        """The last log lines and every thread's stack (SIGUSR1, see lifecycle.py), for a failure report."""
        assert self.process
        count = len(self.stderr_lines)
        self.process.send_signal(signal.SIGUSR1)
        time.sleep(2)
        with self._changed:
            return ("--- last log lines ---\n" + "".join(self.stderr_lines[max(0, count - 15):count])
                    + "--- stacks ---\n" + "".join(self.stderr_lines[count:]))

    def stop(self, how: str, within: float) -> float:
        """Stop the node as a user would and return the seconds it took; fails unless it exits 0
        within `within` seconds, leaves no helper process behind and prints no traceback.

        how: "ctrl-c" (SIGINT to the node's whole process group, as a terminal sends it) or
        "sigterm" (to the main pid, as `kill`, `docker stop` and systemd send it).
        """
        assert self.process and self.process.poll() is None, f"{self.name} is not running"
        helpers = descendants(self.process.pid)
        started = time.monotonic()
        if how == "ctrl-c":
            os.killpg(self.process.pid, signal.SIGINT)
        else:
            assert how == "sigterm", how
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {within:.0f}s of {how}\n{self.stacks()}") from None
        took = time.monotonic() - started
        assert code == 0, f"{self.name} exited {code} after {how}\n{self.log_text()[-3000:]}"
        assert "Traceback" not in self.log_text(), self.log_text()[-3000:]
        deadline = time.monotonic() + 10
        while (survivors := [pid for pid in helpers if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not survivors, f"{self.name}'s helper processes outlived it: {survivors}"
        return took

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            # the node's own children (hivemind DHT, averager, p2pd) die with their parent's pipes
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (hivemind's helpers, p2pd), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
