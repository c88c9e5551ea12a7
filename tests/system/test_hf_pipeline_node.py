"""Real nodes with a Hugging Face model (a tiny Llama, tied embeddings, three layers over two stages):
a pipeline node and a one-process node train together and hold the same φ after every blocking
round: φ, the wire and the digest are canonical whatever the layout, and both start from the same
bits. (A checkpoint's inner state
moving between layouts: tests/system/test_hf_layouts.py, at the replica.)"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.integration.conftest import NodeFactory
from tests.system.test_hf_layouts import CONFIG

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_a_pipeline_node_and_a_one_process_node_train_a_llama_together(spawn: NodeFactory, tmp_path: Path) -> None:
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 3}))
    common = ["--model", str(tmp_path / "llama"), "--seq-len", "32", "--inner-steps", "5", "--round-timeout", "120"]
    pipeline = ["--parallel", "pipeline", "--local-ranks", "2"]
    first = spawn("none", *common, "--min-peers", "2", "--max-outer-steps", "2")
    pair = [first, spawn("pipeline", *common, "--min-peers", "2", "--max-outer-steps", "2", *pipeline, peer=first)]
    for round_ in (1, 2):
        logs = [node.wait_for_round(round_, timeout=240) for node in pair]
        assert {log.group_size for log in logs} == {2}, f"round {round_}: {logs}"
        assert len({log.digest for log in logs}) == 1, f"round {round_}: φ differs across layouts: {logs}"
    # --init random is a function of the seed alone: the pipeline node built the φ0 the other holds,
    # so it downloaded nothing (statesync compares the two), and both joined with the same digest
    assert "nothing to download" in pair[1].log_text() and "synced state" not in pair[1].log_text()
    joined = [re.findall(r"joined run=\S+ round=0 .* digest=(\w+)", node.log_text()) for node in pair]
    assert len(joined[0]) == 1 and joined[0] == joined[1], joined
    for node in pair:
        assert node.wait_exit(timeout=120) == 0, node.log_text()[-2000:]
        assert "Traceback" not in node.log_text()
        assert node.joined_eval_loss is not None and node.rounds[2].eval_loss < node.joined_eval_loss

