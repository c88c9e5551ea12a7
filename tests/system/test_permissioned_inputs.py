"""Bad input to the commands of a permissioned run (keygen, identity, admit, join with --run-owner and
--admission): exit code 2 and one `diloco-node: error:` line each. The commands, and the join inputs
refused while the config is built, go through the CLI's own `main` in this process (each subprocess
costs a torch import); the first keygen and the admission checks of a starting node run the real
CLI in subprocesses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.integration.test_bad_input import (  # noqa: F401  (the fixtures)
    Processes,
    Result,
    assert_bad_input,
    cli,
    in_process,
    join,
    main_in_process,
    nodes,
)


def test_permissioned_run_inputs(nodes: Processes, in_process: Callable[..., Result],  # noqa: F811
                                 tmp_path: Path) -> None:
    owner = cli("keygen", str(tmp_path / "owner.key")).stdout.strip()
    assert_bad_input(main_in_process("keygen", str(tmp_path / "owner.key")), "never overwritten")
    mine = main_in_process("identity", str(tmp_path / "me.key")).stdout.strip()
    theirs = main_in_process("identity", str(tmp_path / "them.key")).stdout.strip()
    admit = ("admit", "--owner-key", str(tmp_path / "owner.key"), "--run-id", "itest")
    assert_bad_input(main_in_process(*admit, "not-a-peer-id"), "is not a peer id")
    assert_bad_input(main_in_process(*admit, "--expires", "soon", theirs), "--expires 'soon'")
    assert_bad_input(main_in_process("admit", "--owner-key", str(tmp_path / "me.key"), "--run-id", "itest", theirs),
                     "not an owner key")
    their_admission = main_in_process(*admit, theirs).stdout.strip()
    expired = main_in_process(*admit, "--expires", "2020-01-01", mine).stdout.strip()
    me = ("--run-id", "itest", "--identity", str(tmp_path / "me.key"))
    assert_bad_input(in_process(*me, "--run-owner", "garbage", "--admission", their_admission),
                     "not a run owner's public key")
    assert_bad_input(in_process(*me, "--run-owner", owner), "needs this node's --admission")
    assert_bad_input(in_process(*me, "--admission", their_admission), "needs the --run-owner")
    assert_bad_input(in_process("--run-id", "itest", "--checkpoint-dir", "", "--run-owner", owner,
                                "--admission", their_admission), "lasting peer id")
    # checked as the node starts (its identity against the admission): the real CLI
    assert_bad_input(join(nodes, *me, "--run-owner", owner, "--admission", their_admission),
                     "does not admit this node", f"admission is for peer {theirs}")
    assert_bad_input(join(nodes, *me, "--run-owner", owner, "--admission", expired), "admission expired")
    assert_bad_input(join(nodes, *me, "--run-owner", owner, "--admission", str(tmp_path / "nowhere")),
                     "neither a token nor a readable file")
