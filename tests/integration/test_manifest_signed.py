"""A permissioned run's manifest through the real CLI (issue #42, must-holds 1 and 6): a joiner given
the run owner's key (`--run-owner`) refuses the manifest of a node whose owner has not signed it,
in one line with exit 2 and nothing written, and so does one that named its run (`--run-id`); the
owner signs it (`diloco-node run sign ADDR`, into the running node's checkpoint directory: no
restart), and the same joiner takes it, writing the manifest and the signature beside its
checkpoint (so it serves both in turn)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from diloco_node.cli import main
from diloco_node.commands.launch import NodeProcess
from diloco_node.train.manifest import MANIFEST_NAME, SIGNATURE_NAME, read_local
from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

RUN = "signed-itest"
NODE_LEVEL = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0", "--threads", "1"]


def cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diloco_node", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def in_process(*args: str) -> str:
    done = CliRunner().invoke(main, list(args))
    assert done.exit_code == 0, done.output
    return done.stdout.strip()


def test_a_permissioned_joiner_takes_only_the_manifest_its_owner_signed(spawn: NodeFactory, tmp_path: Path) -> None:
    owner_key = tmp_path / "owner.key"
    owner = in_process("keygen", str(owner_key))  # the owner's commands need no node: in this process
    admitted = {}
    for name in ("a", "b"):
        peer_id = in_process("identity", str(tmp_path / f"{name}.key"))
        admitted[name] = ["--identity", str(tmp_path / f"{name}.key"), "--admission",
                          in_process("admit", "--owner-key", str(owner_key), "--run-id", RUN, peer_id)]
    a = spawn("a", "--run-owner", owner, "--inner-steps", "5", *admitted["a"], run_id=RUN)
    address = a.wait_for_address(timeout=120)

    joiner = ["join", "--peer", address, "--run-owner", owner, *admitted["b"], *NODE_LEVEL,
              "--checkpoint-dir", str(tmp_path / "b")]
    refused = cli(*joiner, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    errors = [line for line in refused.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"diloco-node: error: no run manifest taken from {address}: its manifest is not signed by "
                      "the run owner (the owner signs it once: diloco-node run sign)"], refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr and "took run" not in refused.stdout
    assert not (tmp_path / "b").exists()  # nothing written: no run.json, no run files
    # naming the run (and a run-level option) does not turn the refusal into a join on the options given
    named = cli(*joiner, "--run-id", RUN, "--inner-steps", "5", cwd=tmp_path)
    assert named.returncode == 2, named.stderr[-2000:]
    assert [line for line in named.stderr.splitlines() if "error" in line.lower()] == errors, named.stderr[-2000:]
    assert "joining run" not in named.stderr and not (tmp_path / "b").exists()

    # the owner signs what a serves, into a's checkpoint directory: a serves the signature from then on
    signed = cli("run", "sign", "--owner-key", str(owner_key), "--checkpoint-dir", str(tmp_path / "a"), address,
                 cwd=tmp_path)
    assert signed.returncode == 0, signed.stderr[-2000:]
    assert signed.stdout.startswith(f"signed run {RUN}'s manifest "), signed.stdout
    assert (tmp_path / "a" / RUN / SIGNATURE_NAME).is_file()

    b = NodeProcess("b", joiner[1:], tmp_path).start()
    try:
        b.wait_until(lambda: any(line.startswith("took run ") for line in b.stdout_lines), 120, "taking the run")
        took = next(line for line in b.stdout_lines if line.startswith("took run ")).rstrip("\n")
        assert took.startswith(f"took run {RUN}: ") and took.endswith(f", signed by the run owner), from {address}"), \
            took
        taken = read_local(tmp_path / "b" / RUN / MANIFEST_NAME)
        assert taken.run_id == RUN and taken.signature_state() == "signed by the run owner"
        signature = (tmp_path / "a" / RUN / SIGNATURE_NAME).read_text()
        assert (tmp_path / "b" / RUN / SIGNATURE_NAME).read_text() == signature
    finally:
        b.kill()
