"""Bad input to the real `diloco-node join`: exit code 2, one `diloco-node: error:` line, no traceback.

The real CLI runs in a subprocess (diloco_node/commands/launch.py, which also asks for the node's events on
stdout). `--log-level ERROR` keeps INFO lines off stderr so that the error line is the only one there.

A bad value of an option is refused while the flags become a NodeConfig, before anything is logged
or imported beyond the config checks: the same path for every option. Two of those cases (a flag, a
config file value) run in a subprocess and prove the path end to end; the other option cases call the
same `main` in this process (`in_process`), cheaper still (a subprocess refused while parsing
costs an interpreter start, ~0.2 s: the CLI parses without torch, tests/unit/test_cli_imports.py).
Everything refused later (resources, layouts checked on the device, the model) runs in a subprocess.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from diloco_node.cli import main
from diloco_node.commands.launch import NodeProcess

pytestmark = pytest.mark.integration

UNKNOWN_PEER_ID = "12D3KooWJZCFWqQH4SvZLraL276kcU6ZvaLyacnJUdUc1t4Cx8AZ"
QUIET = ["--log-level", "ERROR"]
LOCAL = ["--status", "127.0.0.1:0", "--listen", "/ip4/127.0.0.1/tcp/0", "--threads", "1"]
RUN_TIMEOUT = 90  # a case hanging past this is a failure in itself


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


class Processes:
    """Starts `diloco-node join` (launch.NodeProcess: a session of its own, whose process group then
    also holds hivemind's helper processes) and kills whatever is left of their groups at teardown."""

    def __init__(self, workdir: Path, logs: Path) -> None:
        self.workdir = workdir  # relative defaults (checkpoints/<run_id>) land here, not in the repo
        self.logs = logs
        self.started: list[NodeProcess] = []
        self._names = (f"join{index}" for index in itertools.count())

    def start(self, *args: str) -> NodeProcess:
        node = NodeProcess(next(self._names), list(args), self.logs, cwd=self.workdir).start()
        self.started.append(node)
        return node

    def run(self, *args: str, timeout: float = RUN_TIMEOUT) -> Result:
        """Run to its exit; a case still running after `timeout` fails (with the node's stacks)."""
        node = self.start(*args)
        code = node.wait_exit(timeout)
        return Result(code, "".join(node.stdout_lines), node.log_text())

    def cleanup(self) -> None:
        for node in self.started:
            node.kill(group=True)  # also reaps helpers a clean exit may have left behind in its group


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Processes]:
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    processes = Processes(workdir, tmp_path)
    try:
        yield processes
    finally:
        processes.cleanup()


def join(nodes: Processes, *args: str, local: bool = True) -> Result:
    return nodes.run(*(LOCAL if local else []), *QUIET, *args)


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[..., Result]:
    """`diloco-node join ARGS` through the CLI's own `main` in this process, for input refused while
    the config is built. Should a bad value get past the checks, the node is not started here: the
    case ends with exit 3, which assert_bad_input reports."""
    def started(_cfg: object) -> int:
        print("diloco-node: the bad input was accepted and a node would start", file=sys.stderr)
        return 3

    monkeypatch.setattr("diloco_node.daemon.runner.run_node", started)
    monkeypatch.chdir(tmp_path)  # relative defaults (checkpoints/<run_id>) land here, not in the repo

    return lambda *args: main_in_process("join", *LOCAL, *QUIET, *args)


def main_in_process(*args: str) -> Result:
    """`diloco-node ARGS` through the CLI's own `main` in this process (for `join`: the `in_process` fixture)."""
    done = CliRunner().invoke(main, list(args))
    crashed = "" if done.exception is None or isinstance(done.exception, SystemExit) else \
        "Traceback " + repr(done.exception)  # an exception the CLI let escape: a traceback for a user
    return Result(done.exit_code, done.stdout, done.stderr + crashed)


def assert_bad_input(result: Result, *words: str) -> str:
    """Exit 2 and exactly one stderr line, `diloco-node: error: ...`, containing all `words`."""
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 2, \
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{result.stderr}"
    line = lines[0]
    assert line.startswith("diloco-node: error: "), line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    return line


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that this test process holds (bound and listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


# --- bad options and files (rejected before anything starts) ----------------------------------


def test_malformed_multiaddr(nodes: Processes) -> None:
    assert_bad_input(join(nodes, "--peer", "garbage"), "peer", "malformed multiaddr", "garbage")


def test_peer_without_peer_id(in_process: Callable[..., Result]) -> None:
    assert_bad_input(in_process("--peer", "/ip4/127.0.0.1/tcp/4001"), "peer", "/p2p/")


@pytest.mark.parametrize("problem", ["corrupt", "open permissions"])
def test_unusable_identity_key_is_refused_and_kept(nodes: Processes, tmp_path: Path, problem: str) -> None:
    key = tmp_path / "identity.key"
    key.write_bytes(b"\x08\x01\x12\x03abc" if problem == "corrupt" else b"")
    if problem == "open permissions":
        assert subprocess.run([sys.executable, "-m", "diloco_node", "identity", str(key.with_name("good.key"))],
                              capture_output=True, check=True).returncode == 0
        key = key.with_name("good.key")
    key.chmod(0o644 if problem == "open permissions" else 0o600)
    before = key.read_bytes()
    words = ("not a libp2p RSA private key",) if problem == "corrupt" else ("readable by others", "chmod 600")
    assert_bad_input(join(nodes, "--identity", str(key)), str(key), *words)
    assert key.read_bytes() == before, "a refused key file must be left as it was"


def cli(*args: str) -> Result:
    """Any other `diloco-node` command."""
    done = subprocess.run([sys.executable, "-m", "diloco_node", *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    return Result(done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize("args,words", [
    (["--local-ranks", "2"], ["local_ranks 2 needs parallel fsdp or pipeline"]),
    (["--parallel", "fsdp"], ["parallel fsdp needs local_ranks 2 or more"]),
    (["--parallel", "pipeline", "--local-ranks", "3", "--batch-size", "12"], ["pipeline of 3 stages", "has 2"]),
    (["--parallel", "fsdp", "--local-ranks", "2", "--batch-size", "7"], ["batch_size 7", "2 local ranks"]),
    (["--parallel", "fsdp", "--devices", "cpu,cpu,cpu", "--local-ranks", "2"], ["devices lists 3"]),
    (["--parallel", "mesh", "--local-ranks", "2"], ["parallel"]),
    (["--precision", "fp16"], ["precision"]),
    (["--micro-batch-size", "auto", "--parallel", "fsdp", "--local-ranks", "2"], ["micro_batch_size auto"]),
])
def test_bad_layout(in_process: Callable[..., Result], args: list[str], words: list[str]) -> None:
    """Layouts that cannot work are refused before any local rank starts."""
    assert_bad_input(in_process(*args), *words)


def test_devices_this_machine_lacks(nodes: Processes) -> None:
    """Checked on the devices, once the config is built: a subprocess."""
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the two GPUs asked for")  # never true in CI (CPU machines)
    assert_bad_input(join(nodes, "--parallel", "fsdp", "--devices", "cuda:0,cuda:1"), "cuda:0,cuda:1")


@pytest.mark.parametrize(("args", "words"), [
    (["--round-seconds", "0"], ["round_seconds must be a number of seconds > 0", "0.0"]),
    (["--round-seconds", "30", "--inner-steps", "50"], ["--round-seconds", "--inner-steps", "not both"]),
])
def test_bad_round_length(in_process: Callable[..., Result], args: list[str], words: list[str]) -> None:
    """A round is H steps or T seconds (docs/architecture.md §13): a T ≤ 0, or both, is refused (the
    other bad values of T: tests/unit/test_budget.py)."""
    assert_bad_input(in_process(*args), *words)


def test_bad_fragments(in_process: Callable[..., Result], nodes: Processes) -> None:
    """A negative P and more fragments than inner steps: tests/unit/test_fragments.py (the same config path)."""
    assert_bad_input(in_process("--fragments", "0"), "fragments")
    # the tiny preset has 28 parameter tensors; a fragment holds whole ones (docs/architecture.md §15),
    # which only the built model knows: a subprocess
    assert_bad_input(join(nodes, "--fragments", "29", "--inner-steps", "50"), "fragments 29", "28 parameter tensors")


def test_more_local_ranks_than_cores(nodes: Processes) -> None:
    ranks = (os.cpu_count() or 1) + 1
    assert_bad_input(join(nodes, "--parallel", "fsdp", "--local-ranks", str(ranks), "--batch-size", str(4 * ranks)),
                     f"{ranks} local ranks on the CPU need as many cores")


@pytest.mark.parametrize("args,words", [
    (["--upload-limit", "-1"], ["upload_limit", "'-1' is not a rate"]),
    (["--upload-limit", "5 parsecs"], ["upload_limit", "'5 parsecs' is not a rate"]),
])
def test_bad_bandwidth_caps(in_process: Callable[..., Result], args: list[str], words: list[str]) -> None:
    """--upload-limit / --download-limit (docs/architecture.md §13) take a rate with its unit, or 0."""
    assert_bad_input(in_process(*args), *words)


def test_invalid_value_in_config_file(nodes: Processes, tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("inner_steps = 0\n")
    assert_bad_input(join(nodes, "--config", str(path)), "inner_steps")


def test_unknown_key_in_config_file(in_process: Callable[..., Result], tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("inner_steps = 5\nouter_learning_rate = 0.5\n")
    result = in_process("--config", str(path))
    assert_bad_input(result, "unknown config key", "outer_learning_rate", str(path))


def test_missing_config_file(in_process: Callable[..., Result], tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    assert_bad_input(in_process("--config", str(path)), str(path), "does not exist")


# --- bad resources (rejected while starting) --------------------------------------------------


def test_missing_data_path(nodes: Processes, tmp_path: Path) -> None:
    path = tmp_path / "no-such-corpus.txt"
    assert_bad_input(join(nodes, "--data", str(path)), str(path), "does not exist")


def test_checkpoint_dir_locked_by_another_node(nodes: Processes, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    store = directory / "locked-run"  # a node keeps its checkpoints in <checkpoint_dir>/<run_id>/
    store.mkdir(parents=True)
    with open(store / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running node holds (daemon/checkpoint.py)
        result = join(nodes, "--checkpoint-dir", str(directory), "--run-id", "locked-run")
        line = assert_bad_input(result, str(store), "in use")
    assert "another node" in line
    assert not (store / "node.json").exists()


def test_damaged_checkpoint_is_refused_and_kept(nodes: Processes, tmp_path: Path) -> None:
    """A checkpoint whose tensors file was altered: one line, exit 2, the files left as they were."""
    from diloco_node.daemon.checkpoint import CheckpointStore

    store_dir = tmp_path / "ckpt" / "damaged-run"
    store = CheckpointStore(store_dir)
    store.save({"round": 1, "outer_params": [torch.zeros(8)]})
    store.close()
    tensors = next(store_dir.glob("node-*.safetensors"))
    tensors.write_bytes(tensors.read_bytes()[:-1] + b"\x01")
    before = {p.name: p.read_bytes() for p in store_dir.iterdir()}
    result = join(nodes, "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-id", "damaged-run")
    assert_bad_input(result, str(store_dir / "node.json"), "unreadable (damaged, or not a checkpoint)", "SHA-256")
    assert {p.name: p.read_bytes() for p in store_dir.iterdir()} == before


def test_status_port_in_use(nodes: Processes, busy_port: int) -> None:
    result = join(nodes, "--status", f"127.0.0.1:{busy_port}", "--listen", "/ip4/127.0.0.1/tcp/0",
                  "--threads", "1", local=False)
    assert_bad_input(result, f"127.0.0.1:{busy_port}", "address already in use")


def test_status_port_in_use_debug_log_has_no_traceback(nodes: Processes, busy_port: int) -> None:
    """Same case with every log line on: shutting the status server down must not leave a traceback."""
    result = nodes.run("--status", f"127.0.0.1:{busy_port}", "--listen", "/ip4/127.0.0.1/tcp/0",
                       "--threads", "1", "--log-level", "DEBUG")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("diloco-node: error: ")]
    assert len(errors) == 1 and "address already in use" in errors[0]


def test_listen_port_in_use(nodes: Processes, busy_port: int) -> None:
    result = join(nodes, "--status", "127.0.0.1:0", "--listen", f"/ip4/127.0.0.1/tcp/{busy_port}",
                  "--threads", "1", local=False)
    assert_bad_input(result, f"/ip4/127.0.0.1/tcp/{busy_port}", "address already in use")


def test_unreachable_peer(nodes: Processes) -> None:
    peer = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{UNKNOWN_PEER_ID}"
    assert_bad_input(join(nodes, "--peer", peer), "cannot reach", peer)


# --- an incompatible peer ---------------------------------------------------------------------


def first_line(node: NodeProcess, text: str, timeout: float) -> str | None:
    """The node's first log line containing `text`, once it wrote it; None if it did not in time."""
    def found() -> str | None:
        return next((line for line in node.stderr_lines if text in line), None)

    return found() if node.reached(lambda: found() is not None, timeout) else None


def test_incompatible_peer_is_refused_on_both_sides(nodes: Processes, tmp_path: Path) -> None:
    run_id = f"bad-input-{os.getpid()}"
    identity = str(tmp_path / "a.key")
    light = ["--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--inner-steps", "5"]
    # A and B share a directory: A keeps no checkpoints, so B's default checkpoints/<run_id> is free.
    a = nodes.start(*LOCAL, "--model", "tiny", "--run-id", run_id, "--max-outer-steps", "0",
                    "--checkpoint-dir", "", "--identity", identity, *light)
    a_address = a.wait_for_address(timeout=60)
    assert first_line(a, "joined run=", timeout=60), "node A did not finish starting"

    # --manifest off: B keeps its own options, so the swarm's own refusal is what is tested (with the
    # run's manifest taken, B would end at start-up naming --model: tests/integration/test_manifest.py)
    b = join(nodes, "--peer", a_address, "--run-id", run_id, "--model", "small", "--manifest", "off")
    line = assert_bad_input(b, "incompatible", run_id)
    assert "--model tiny (ours: small)" in line  # names the option that differs: A's model, and B's own
    assert len(line) < 300 and "n_layer" not in line, line  # the model's shape folds into --model
    assert "small" in line
    b_addresses = [text.removeprefix("peer address: ").strip() for text in b.stdout.splitlines()
                   if text.startswith("peer address: ")]
    assert b_addresses, b.stdout
    b_peer_id = b_addresses[0].rsplit("/p2p/", 1)[1]

    refused = first_line(a, "refused peer", timeout=15)
    assert refused is not None, "node A never logged the refused peer"
    assert b_peer_id in refused
    assert "--model small (ours: tiny)" in refused
    assert a.running(), "node A must keep running after refusing a peer"
    # a second node started with A's key (a copied volume, say) is refused before it can impersonate A
    assert_bad_input(join(nodes, "--peer", a_address, "--run-id", run_id, "--identity", identity,
                          "--checkpoint-dir", ""), "in use by another running node", identity)
    assert a.running(), "node A must keep running"

    a.signal(signal.SIGTERM)
    assert a.wait_exit(timeout=60) == 0
    stderr = a.log_text()
    assert "Traceback" not in stderr + "".join(a.stdout_lines), stderr
