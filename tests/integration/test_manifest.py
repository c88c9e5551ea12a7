"""The run manifest through the real CLI: a node started with run-level flags (a Llama preset and a
tokenizer this test trains) serves it; `diloco-node run show ADDR` prints it; `diloco-node join
--peer ADDR` with no run-level option takes it, prints one line, writes it beside its checkpoint,
and averages with the first node; a conflicting run-level flag ends a joiner with one short line
(exit 2); a restart of the joiner knows its run from the copy on disk, without the network."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_node.commands.launch import NodeProcess
from diloco_node.config import NodeConfig
from diloco_node.train.manifest import MANIFEST_NAME, build, read_local, write_local
from diloco_node.train.tokenizer import train_tokenizer
from harness.bench import free_port
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

RUN = "manifest-itest"
NODE_LEVEL = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0", "--threads", "1"]


def cli(*args: str, cwd: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "diloco_node", *args], capture_output=True, text=True,
                            timeout=timeout, cwd=cwd)
    return result, time.monotonic() - started


def test_join_with_only_peer_takes_the_run(spawn: NodeFactory, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok"
    train_tokenizer(iter(["every node of a run cuts text into the same ids"] * 60), 300, tokenizer)
    a = spawn("a", "--model", "llama-2m", "--tokenizer", str(tokenizer), "--inner-steps", "5", "--seq-len", "32",
              "--batch-size", "4", "--compression", "int8", run_id=RUN)
    address = a.wait_for_address(timeout=120)

    shown, seconds = cli("run", "show", address, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    text = shown.stdout
    assert text.startswith(f"run {RUN}\n"), text
    for part in ("llama-2m (hf:llama)", ", tokenizer.json sha256 ", "tokenizer digest ", "data the embedded corpus",
                 "inner_steps = 5", 'compression = "int8"', 'sync = "blocking"'):
        assert part in text, (part, text)
    assert seconds < 90, seconds

    conflicting, seconds = cli("join", "--peer", address, "--sync", "eager", *NODE_LEVEL,
                               "--checkpoint-dir", str(tmp_path / "c"), cwd=tmp_path)
    assert conflicting.returncode == 2, conflicting.stderr[-2000:]
    lines = conflicting.stderr.strip().splitlines()
    assert lines[-1] == "diloco-node: error: --sync: the run's is blocking, given eager (leave it out to take " \
                        "the run's)", lines
    assert "Traceback" not in conflicting.stderr and seconds < 90, seconds
    assert not (tmp_path / "c" / RUN / MANIFEST_NAME).exists()  # nothing written for a refused run

    checkpoints = tmp_path / "b"
    b = NodeProcess("b", ["--peer", address, *NODE_LEVEL, "--checkpoint-dir", str(checkpoints)], tmp_path).start()
    try:
        b.wait_until(lambda: any(line.startswith("took run ") for line in b.stdout_lines), 120, "taking the run")
        took = next(line for line in b.stdout_lines if line.startswith("took run "))
        for part in (f"took run {RUN}: model llama-2m (hf:llama) (", "parameters), tokenizer digest ",
                     "codec int8", "sync blocking", "H=5", "data the embedded corpus", f"from {address}"):
            assert part in took, (part, took)
        assert read_local(checkpoints / RUN / MANIFEST_NAME).run_id == RUN
        b.wait_joined(timeout=180)

        def averaged() -> int | None:
            """A round both report in a group of two, with the same φ after it."""
            return next((r for r in sorted(b.rounds) if b.rounds[r].group_size == 2 and r in a.rounds
                         and a.rounds[r].digest == b.rounds[r].digest), None)

        # a.rounds grows on a's reader thread: b's wait looks again at least every 0.5 s
        b.wait_until(lambda: averaged() is not None, 240, "a round averaged with node a")
        took_seconds = b.stop("sigterm", within=60)
        assert took_seconds < 60
    finally:
        b.kill()
    a.stop("sigterm", within=60)


def test_a_restart_knows_its_run_from_the_copy_beside_its_checkpoint(tmp_path: Path) -> None:
    """No manifest from the network: the joiner's peer is gone (joining the swarm then fails, in one
    line), yet it names its run from the copy it wrote when it took it. A test of its own, two at a
    time beside the one above (each waits on nodes more than it computes)."""
    tokenizer = tmp_path / "tok"
    train_tokenizer(iter(["every node of a run cuts text into the same ids"] * 60), 300, tokenizer)
    cfg = NodeConfig(run_id=RUN, model="llama-2m", tokenizer=str(tokenizer), inner_steps=5, seq_len=32, batch_size=4,
                     compression="int8", sync="blocking")
    checkpoints = tmp_path / "b"
    write_local(build(cfg, 1_705_600), checkpoints / RUN / MANIFEST_NAME)
    gone = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    restart, seconds = cli("join", "--peer", gone, *NODE_LEVEL, "--checkpoint-dir", str(checkpoints),
                           cwd=tmp_path, timeout=240)
    assert f"took run {RUN}: " in restart.stdout and f"from {checkpoints / RUN / MANIFEST_NAME}" in restart.stdout
    assert restart.returncode == 2 and "cannot reach any peer" in restart.stderr, restart.stderr[-2000:]
    assert "Traceback" not in restart.stderr
