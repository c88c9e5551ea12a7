"""Bad tokenizers and data given to the real `diloco-node join` (issue 27): exit 2 with one line, before
anything is made (no checkpoint directory, no swarm).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco_node.train.prepare import train_tokenizer_from, write_shards
from harness.corpus import parquet_files
from tests.integration.test_bad_input import Processes, assert_bad_input, join, nodes  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return parquet_files(tmp_path_factory.mktemp("data"))


def test_bad_data_and_tokenizers_exit_2_with_one_line(nodes: Processes, files: dict[str, Path],  # noqa: F811
                                                      tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    keep = ("--checkpoint-dir", str(checkpoints))
    # made in this process (the CLI's own `tokenizer train` and `tokenize` are tested in tests/system)
    train_tokenizer_from(str(files["parquet"]), 300, tmp_path / "tok")
    write_shards(str(files["parquet"]), None, tmp_path / "bins")
    # a dataset without a text column
    assert_bad_input(join(nodes, *keep, "--data", str(files["content"])), "no text column 'text'",
                     "columns: content", "--text-column")
    # a truncated shard
    shard = tmp_path / "bins" / "docs_train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert_bad_input(join(nodes, *keep, "--data", str(tmp_path / "bins")), str(shard), "truncated or corrupt")
    # a tokenizer larger than the model's vocabulary
    assert_bad_input(join(nodes, *keep, "--tokenizer", str(tmp_path / "tok")), "has 300 tokens",
                     "model 'tiny'", "(256)")
    assert not checkpoints.exists(), "bad input must change nothing"


def test_a_hub_dataset_while_offline(nodes: Processes, tmp_path: Path,  # noqa: F811
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the node inherits it (launch.NodeProcess passes the environment)
    result = join(nodes, "--checkpoint-dir", str(tmp_path / "ckpt"), "--data", "hf:HuggingFaceFW/fineweb-edu")
    assert_bad_input(result, "hf:HuggingFaceFW/fineweb-edu", "local files")
    assert not (tmp_path / "ckpt").exists()
