"""Two real nodes train a Hugging Face Llama (a tiny config made here) with a BPE tokenizer trained here
on parquet data read through `datasets`, all offline (issue 27): they hold the same φ after every
blocking round, their eval loss falls, and a resumed node reads on from its checkpoint's data position.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diloco_node.train.tokenizer import load_tokenizer, train_tokenizer
from tests.integration.conftest import NodeFactory
from tests.integration.test_bad_input import LOCAL, Processes, assert_bad_input, first_line, join, nodes  # noqa: F401

pytestmark = pytest.mark.integration

H = 10
ROUNDS = 3
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 0,
         "eos_token_id": 0}


@pytest.fixture
def run_files(tmp_path: Path) -> dict[str, Path]:
    rng = random.Random(5)
    words = ("once there was a small fox who lived near a river and every morning the fox ran to the hill "
             "to look at the birds that sang in the old tree").split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(1500)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "train.parquet")
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    train_tokenizer(iter(docs), 400, tmp_path / "tokenizer.json")
    return {"model": model, "tokenizer": tmp_path / "tokenizer.json", "data": tmp_path / "train.parquet"}


def test_two_nodes_train_a_llama_on_parquet_with_a_bpe_tokenizer(spawn: NodeFactory,
                                                                 run_files: dict[str, Path]) -> None:
    common = ["--model", str(run_files["model"]), "--tokenizer", str(run_files["tokenizer"]),
              "--data", str(run_files["data"]), "--inner-steps", str(H), "--min-peers", "2",
              "--round-timeout", "120", "--inner-lr", "3e-3"]
    first = spawn("a", *common, "--max-outer-steps", str(ROUNDS))
    second = spawn("b", *common, "--max-outer-steps", str(ROUNDS), peer=first)
    pair = [first, second]
    for round_ in range(1, ROUNDS + 1):
        logs = [node.wait_for_round(round_, timeout=300) for node in pair]
        assert {log.group_size for log in logs} == {2}, f"round {round_}: {logs}"
        assert len({log.digest for log in logs}) == 1, f"round {round_}: φ differs: {logs}"
    for node in pair:
        assert node.wait_exit(timeout=120) == 0, node.log_text()[-2000:]
        text = node.log_text()
        assert "Traceback" not in text
        assert node.joined_eval_loss is not None and node.rounds[ROUNDS].eval_loss < node.joined_eval_loss
        assert re.search(rf"data batches={ROUNDS * H} ", text), text[-2000:]  # the process's data-wait figure
    losses = [first.joined_eval_loss] + [first.rounds[r].eval_loss for r in range(1, ROUNDS + 1)]
    assert losses == sorted(losses, reverse=True), losses

    # resumed alone, the node reads on from its checkpoint's data position: batch ROUNDS·H, nothing twice
    resumed = spawn("a", *common, "--min-peers", "1", "--max-outer-steps", str(ROUNDS + 1))
    resumed.wait_for_round(ROUNDS + 1, timeout=300)
    assert resumed.wait_exit(timeout=120) == 0
    text = resumed.log_text()
    assert f"resumed round={ROUNDS}" in text
    starts = re.findall(r"data prefetch starts at position=(\d+)", text)
    assert starts == [str(ROUNDS * H)], starts  # one start, where the first run stopped, and no jump after it


def test_a_node_with_another_tokenizer_is_refused_on_both_sides(nodes: Processes,  # noqa: F811
                                                                run_files: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "other-tokenizer"
    train_tokenizer(iter(["a different text, with other merges to learn"] * 50), 300, other)
    ours, theirs = load_tokenizer(str(run_files["tokenizer"])).digest, load_tokenizer(str(other)).digest
    run_id = f"tokenizers-{os.getpid()}"
    common = [*LOCAL, "--run-id", run_id, "--model", str(run_files["model"]), "--data", str(run_files["data"]),
              "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--inner-steps", "5"]
    a = nodes.start(*common, "--tokenizer", str(run_files["tokenizer"]), "--max-outer-steps", "0",
                    "--checkpoint-dir", "")
    address = a.wait_for_address(timeout=120)
    assert first_line(a, "joined run=", timeout=120), "node A did not finish starting"
    # --manifest off: the swarm's own refusal (taking the run's manifest, B would end at start-up naming --tokenizer)
    b = join(nodes, *common, "--tokenizer", str(other), "--peer", address, "--checkpoint-dir", str(tmp_path / "b"),
             "--manifest", "off", local=False)
    assert_bad_input(b, "incompatible", run_id, f"--tokenizer {ours[:12]}… (ours: {theirs[:12]}…)")
    refused = first_line(a, "refused peer", timeout=30)
    assert refused is not None and f"--tokenizer {theirs[:12]}… (ours: {ours[:12]}…)" in refused, refused
    assert a.running()
    a.signal(signal.SIGTERM)
    assert a.wait_exit(timeout=60) == 0
