"""Bad input to the commands of a permissioned run (keygen, identity, admit, join with --run-owner and
--admission): exit code 2 and one `diloco-node: error:` line each. Fourteen CLI starts: in the system
tier, so that `make test` keeps its ten minutes."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_bad_input import Processes, assert_bad_input, cli, join, nodes  # noqa: F401


def test_permissioned_run_inputs(nodes: Processes, tmp_path: Path) -> None:  # noqa: F811  (the fixture)
    owner = cli("keygen", str(tmp_path / "owner.key")).stdout.strip()
    assert_bad_input(cli("keygen", str(tmp_path / "owner.key")), "never overwritten")
    mine = cli("identity", str(tmp_path / "me.key")).stdout.strip()
    theirs = cli("identity", str(tmp_path / "them.key")).stdout.strip()
    admit = ("admit", "--owner-key", str(tmp_path / "owner.key"), "--run-id", "itest")
    assert_bad_input(cli(*admit, "not-a-peer-id"), "is not a peer id")
    assert_bad_input(cli(*admit, "--expires", "soon", theirs), "--expires 'soon'")
    assert_bad_input(cli("admit", "--owner-key", str(tmp_path / "me.key"), "--run-id", "itest", theirs),
                     "not an owner key")
    their_admission = cli(*admit, theirs).stdout.strip()
    expired = cli(*admit, "--expires", "2020-01-01", mine).stdout.strip()
    me = ("--run-id", "itest", "--identity", str(tmp_path / "me.key"))
    assert_bad_input(join(nodes, *me, "--run-owner", "garbage", "--admission", their_admission),
                     "not a run owner's public key")
    assert_bad_input(join(nodes, *me, "--run-owner", owner), "needs this node's --admission")
    assert_bad_input(join(nodes, *me, "--admission", their_admission), "needs the --run-owner")
    assert_bad_input(join(nodes, "--run-id", "itest", "--checkpoint-dir", "", "--run-owner", owner,
                          "--admission", their_admission), "lasting peer id")
    assert_bad_input(join(nodes, *me, "--run-owner", owner, "--admission", their_admission),
                     "does not admit this node", f"admission is for peer {theirs}")
    assert_bad_input(join(nodes, *me, "--run-owner", owner, "--admission", expired), "admission expired")
    assert_bad_input(join(nodes, *me, "--run-owner", owner, "--admission", str(tmp_path / "nowhere")),
                     "neither a token nor a readable file")
