"""One run, three layouts (#13): a one-process node, an FSDP node and a pipeline node average
together and hold the same φ after every round; their checkpoints resume under other layouts."""

from __future__ import annotations

import pytest

from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

ROUNDS = ["--inner-steps", "5", "--min-peers", "3", "--round-timeout", "120"]
LAYOUTS = {"single": [], "fsdp": ["--parallel", "fsdp", "--local-ranks", "2"],
           "pipeline": ["--parallel", "pipeline", "--local-ranks", "2"]}
# each node's checkpoint comes back under another layout
RESUMED_AS = {"single": "pipeline", "fsdp": "single", "pipeline": "fsdp"}


def test_three_layouts_share_every_round_and_resume_under_each_other(spawn: NodeFactory) -> None:
    first = spawn("single", *ROUNDS, "--max-outer-steps", "3", *LAYOUTS["single"])
    nodes = [first] + [spawn(name, *ROUNDS, "--max-outer-steps", "3", *LAYOUTS[name], peer=first)
                       for name in ("fsdp", "pipeline")]
    for round_ in (1, 2, 3):
        logs = [node.wait_for_round(round_, timeout=240) for node in nodes]
        assert {log.group_size for log in logs} == {3}, f"round {round_}: {logs}"
        assert len({log.digest for log in logs}) == 1, f"round {round_}: φ differs across layouts: {logs}"
    for node in nodes:
        assert node.wait_exit(timeout=120) == 0, node.log_text()[-2000:]
        assert "Traceback" not in node.log_text()
        assert node.joined_eval_loss is not None and node.rounds[3].eval_loss < node.joined_eval_loss
    digest = nodes[0].rounds[3].digest

    # the same checkpoints, each under another layout, one more round together
    resumed = {}
    for name in ("single", "fsdp", "pipeline"):
        resumed[name] = spawn(name, *ROUNDS, "--max-outer-steps", "4", *LAYOUTS[RESUMED_AS[name]],
                              peer=None if name == "single" else resumed["single"])
    for name, node in resumed.items():
        log = node.wait_for_round(4, timeout=240)
        text = node.log_text()
        assert "resumed round=3" in text, f"{name}:\n{text[-2000:]}"
        assert "inner optimizer starts afresh" not in text  # its AdamW state came along
        assert "synced state" not in text  # resumed, not re-downloaded
        assert log.group_size == 3
    assert len({node.rounds[4].digest for node in resumed.values()}) == 1
    assert resumed["single"].rounds[4].digest != digest  # round 4 trained on from the resumed φ
    for node in resumed.values():
        assert node.wait_exit(timeout=120) == 0
