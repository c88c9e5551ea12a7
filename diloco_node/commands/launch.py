"""Start `diloco-node join` processes and follow what they report: the one launcher of the tests,
the benchmarks and the demo.

A node started here writes its machine-readable events (`--events -`, see telemetry/events.py) to
stdout as JSON lines, beside its `status:` and `peer address:` lines; its stderr is the human log.
So what callers read are the node's own figures, not a parse of log lines whose wording may change.
Both pipes are read on threads: callers wait for an event without polling files, and a node never
blocks on a full pipe in the middle of a round.

Failures raise LaunchError (LaunchTimeout when time ran out while the node still runs), with the
node's last log lines. Both are AssertionErrors too, so that a test reports them as failed assertions
(nothing here imports pytest). `read_events` reads the same events from a file (`--events FILE`, or
a copy of a node's stdout): `parse_event` is the one reader of the node's events.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

from diloco_node.errors import NodeError
from diloco_node.procs import alive, descendants
from diloco_node.telemetry.record import RoundRecord

# After a node has exited, how long its last lines may take to be read: a helper process that
# outlives it (briefly) may still hold its pipes open, and then no end of file comes.
DRAIN_SECONDS = 10.0


class LaunchError(NodeError, AssertionError):
    """A node started here did not do what its caller waited for (it exited, failed to stop cleanly...)."""


class LaunchTimeout(LaunchError, TimeoutError):
    """The time given ran out while the node was still running."""


def clean_environment() -> dict[str, str]:
    """This process's environment without DILOCO_* variables: only the flags given to a node started
    here count (a DILOCO_PEER of the caller's shell would otherwise change every such node)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("DILOCO_")}


@dataclass
class NodeProcess:
    """A `diloco-node join` process and what it reported so far.

    `args` are the `join` flags; `--events -` is added unless they name `--events` themselves (their
    events then go where they say, and `events`, `rounds` and the joined figures stay empty).
    `workdir` is its working directory unless `cwd` says otherwise, and holds a copy of its stderr
    (`<name>.log`) unless `log_path` says otherwise; `stdout_log_path`, when given, gets a copy of its
    stdout. `wrap` wraps the command line, e.g. to run the node inside a network namespace (the one
    way to start it elsewhere: harness/islands.py's IslandNode).
    `on_event` is called with each event, on the reader thread, after it is recorded.
    """

    name: str
    args: list[str]
    workdir: Path
    process: subprocess.Popen[str] | None = None
    address: str | None = None  # the first `peer address:` it printed
    status_url: str | None = None
    joined_eval_loss: float | None = None
    joined_round: int | None = None
    rounds: dict[int, RoundRecord] = field(default_factory=dict)
    stderr_lines: list[str] = field(default_factory=list)  # as read, newline included
    stdout_lines: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    wrap: Callable[[list[str]], list[str]] | None = field(default=None, repr=False)
    env: dict[str, str] | None = field(default=None, repr=False)
    cwd: Path | None = None
    log_path: Path | None = None
    stdout_log_path: Path | None = None
    on_event: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
    _changed: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _streams_open: int = field(default=0, repr=False)

    # --- starting -----------------------------------------------------------------------------

    def command(self) -> list[str]:
        """The node's command line, wrapped."""
        events = [] if any(arg == "--events" or arg.startswith("--events=") for arg in self.args) \
            else ["--events", "-"]
        command = [sys.executable, "-m", "diloco_node", "join", *self.args, *events]
        return self.wrap(command) if self.wrap is not None else command

    def environment(self) -> dict[str, str]:
        env = dict(self.env) if self.env is not None else clean_environment()
        env["PYTHONUNBUFFERED"] = "1"  # each line as it is written, not when a buffer fills
        return env

    def start(self) -> Self:
        stderr_log = open(self.log_path or self.workdir / f"{self.name}.log", "w")  # noqa: SIM115 - the reader closes it
        stdout_log = open(self.stdout_log_path, "w") if self.stdout_log_path else None  # noqa: SIM115
        # A session of its own, as a program started in a terminal is the leader of its foreground
        # process group: `stop("ctrl-c")` signals that group as the terminal's Ctrl-C does, and the
        # caller's own Ctrl-C does not reach the node (the demo passes exactly one stop on).
        self.process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        errors="replace", env=self.environment(), cwd=self.cwd or self.workdir,
                                        start_new_session=True)
        self._streams_open = 2
        threading.Thread(target=self._read_stdout, args=(stdout_log,), daemon=True,
                         name=f"{self.name}-stdout").start()
        threading.Thread(target=self._read_stderr, args=(stderr_log,), daemon=True,
                         name=f"{self.name}-stderr").start()
        return self

    # --- reading ------------------------------------------------------------------------------

    def _read_stdout(self, log: IO[str] | None) -> None:
        assert self.process and self.process.stdout
        with log or contextlib.nullcontext():
            for line in self.process.stdout:
                if log is not None:
                    log.write(line)
                    log.flush()
                event = parse_event(line)
                with self._changed:
                    self.stdout_lines.append(line)
                    if event is not None:
                        self._record(event)
                    elif line.startswith("peer address: ") and self.address is None:
                        self.address = line.split(": ", 1)[1].strip()
                    elif line.startswith("status: "):
                        self.status_url = line.split(": ", 1)[1].strip()
                    self._changed.notify_all()
                if event is not None and self.on_event is not None:
                    try:
                        self.on_event(event)
                    except Exception:  # reading must go on, or the node blocks on a full pipe
                        traceback.print_exc()
        self._closed()

    def _read_stderr(self, log: IO[str]) -> None:
        assert self.process and self.process.stderr
        with log:
            for line in self.process.stderr:
                log.write(line)
                log.flush()  # readable while the node runs
                with self._changed:
                    self.stderr_lines.append(line)
                    self._changed.notify_all()
        self._closed()

    def _closed(self) -> None:
        with self._changed:
            self._streams_open -= 1
            self._changed.notify_all()

    def _record(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        kind = event.get("event")
        if kind == "joined":
            self.joined_round, self.joined_eval_loss = int(event["round"]), float(event["eval_loss"])
        elif kind == "round":
            self.rounds[int(event["round"])] = RoundRecord.from_event(event)

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        """Its events of one kind so far ("joined", "resumed", "synced", "round", "settled", "left")."""
        with self._changed:
            return [event for event in self.events if event.get("event") == kind]

    def log_text(self) -> str:
        with self._changed:
            return "".join(self.stderr_lines)

    def tail(self, lines: int = 15) -> str:
        """Its last log lines, for a failure report."""
        with self._changed:
            return "".join(self.stderr_lines[-lines:])

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # --- waiting ------------------------------------------------------------------------------

    def reached(self, predicate: Callable[[], Any], timeout: float | None) -> bool:
        """Wait until predicate() holds (True), or until `timeout` seconds passed or the node exited
        and its last lines were read without it holding (False). None: no time limit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        exited_at: float | None = None
        with self._changed:
            while not predicate():
                now = time.monotonic()
                if self.process is not None and self.process.poll() is not None:
                    exited_at = now if exited_at is None else exited_at
                    if self._streams_open <= 0 or now - exited_at >= DRAIN_SECONDS:
                        return False
                if deadline is not None and now >= deadline:
                    return False
                self._changed.wait(0.5 if deadline is None else min(deadline - now, 0.5))
        return True

    def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str) -> None:
        """Raises LaunchError when the node exits first, LaunchTimeout when `timeout` seconds pass."""
        if not self.reached(predicate, timeout):
            code = self.process and self.process.poll()
            error = LaunchTimeout if code is None else LaunchError
            raise error(f"{self.name}: {what} not reached (exit={code})\n--- last log lines ---\n{self.tail()}")

    def wait_for_address(self, timeout: float = 60) -> str:
        self.wait_until(lambda: self.address is not None, timeout, "start-up")
        assert self.address is not None
        return self.address

    def wait_joined(self, timeout: float = 90) -> int:
        """The round this node starts training at (after syncing and waiting for --min-peers)."""
        self.wait_until(lambda: self.joined_round is not None, timeout, "joining")
        assert self.joined_round is not None
        return self.joined_round

    def wait_for_round(self, round_: int, timeout: float = 120) -> RoundRecord:
        self.wait_until(lambda: round_ in self.rounds, timeout, f"round {round_}")
        return self.rounds[round_]

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Once the node has exited, wait until its last lines are read; False if they were not in time."""
        return self.reached(lambda: self._streams_open <= 0, timeout)

    # --- the status server --------------------------------------------------------------------

    def get(self, path: str) -> Any:
        """JSON from this node's status server, e.g. get("/api/history")."""
        assert self.status_url
        with urllib.request.urlopen(f"{self.status_url}{path}", timeout=10) as response:
            return json.loads(response.read())

    def status(self) -> dict[str, Any]:
        return dict(self.get("/api/status"))

    # --- stopping -----------------------------------------------------------------------------

    def signal(self, signum: int) -> None:
        assert self.process
        self.process.send_signal(signum)

    def wait_exit(self, timeout: float | None = 60) -> int:
        """Its exit code, once its last lines are read (a test reads its last rounds and log lines next)."""
        assert self.process
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise LaunchTimeout(f"{self.name} did not exit within {timeout}s\n{self.stacks()}") from None
        self.drain()
        return code

    def stacks(self) -> str:
        """The last log lines and every thread's stack (SIGUSR1, see daemon/lifecycle.py), for a failure report."""
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

        how: "ctrl-c" (SIGINT to the node's whole process group, as a terminal sends it),
        "sigterm" (to the main pid, as `kill`, `docker stop` and systemd send it) or "sighup" (to
        the main pid, as a closed terminal or ssh session, or `kill -HUP`, sends it).
        """
        assert self.process and self.process.poll() is None, f"{self.name} is not running"
        helpers = descendants(self.process.pid)
        started = time.monotonic()
        if how == "ctrl-c":
            os.killpg(self.process.pid, signal.SIGINT)
        else:
            assert how in ("sigterm", "sighup"), how
            self.process.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGHUP)
        try:
            code = self.process.wait(timeout=within)
        except subprocess.TimeoutExpired:
            raise LaunchTimeout(f"{self.name} did not exit within {within:.0f}s of {how}\n{self.stacks()}") from None
        took = time.monotonic() - started
        self.drain()
        if code != 0:
            raise LaunchError(f"{self.name} exited {code} after {how}\n{self.log_text()[-3000:]}")
        if "Traceback" in self.log_text():
            raise LaunchError(self.log_text()[-3000:])
        deadline = time.monotonic() + 10
        while (survivors := [pid for pid in helpers if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        if survivors:
            raise LaunchError(f"{self.name}'s helper processes outlived it: {survivors}")
        return took

    def terminate(self, within: float) -> int | None:
        """Stop it as `kill`, `docker stop` and systemd do, and never raise: SIGTERM (the node saves and
        leaves), then SIGKILL to its session if it has not exited `within` seconds later, saying so on
        stderr. Its exit code once its last lines are read; None when it had to be killed."""
        assert self.process
        killed = False
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=within)
            except subprocess.TimeoutExpired:
                print(f"WARNING: {self.name} did not stop within {within:.0f}s of SIGTERM; killing it",
                      file=sys.stderr)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)  # this node's own session only
                killed = True
        code = self.process.wait()
        self.drain()  # its last events (the last round, settled) may still be in the pipe
        return None if killed else code

    def kill(self, group: bool = False) -> None:
        """SIGKILL the node if it still runs. With `group`, its whole process group too, even after it
        exited: the session it was started in, so helpers a clean exit left behind go with it."""
        if self.process is None:
            return
        if group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)  # the group we created for it, nothing else
        if self.process.poll() is None:
            # the node's own children (hivemind DHT, averager, p2pd) die with their parent's pipes
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)


def parse_event(line: str) -> dict[str, Any] | None:
    """The event a stdout line carries, or None for the node's other lines."""
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def read_events(path: Path) -> list[dict[str, Any]]:
    """A node's events from a file, in order: its --events FILE, or a copy of its stdout."""
    return [event for line in path.read_text().splitlines() if (event := parse_event(line)) is not None]
