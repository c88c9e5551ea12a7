"""`diloco-node tokenizer train` and `diloco-node tokenize` through the real CLI (issue 27), offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.corpus import parquet_files
from tests.integration.test_bad_input import Result, assert_bad_input


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return parquet_files(tmp_path_factory.mktemp("data"))


def cli(*args: str, offline: bool = False) -> Result:
    env = {**os.environ, **({"HF_HUB_OFFLINE": "1"} if offline else {})}
    done = subprocess.run([sys.executable, "-m", "diloco_node", *args], capture_output=True, text=True, timeout=120,
                          env=env)
    return Result(done.returncode, done.stdout, done.stderr)


def test_tokenizer_train_and_tokenize_through_the_cli(files: dict[str, Path], tmp_path: Path) -> None:
    trained = cli("tokenizer", "train", "--data", str(files["parquet"]), "--vocab-size", "300", str(tmp_path / "tok"))
    assert trained.returncode == 0, trained.stderr
    assert "vocabulary 300" in trained.stdout and (tmp_path / "tok" / "tokenizer.json").is_file()
    made = cli("tokenize", "--data", str(files["parquet"]), "--tokenizer", str(tmp_path / "tok"),
               str(tmp_path / "bins"))
    assert made.returncode == 0, made.stderr
    names = sorted(p.name for p in (tmp_path / "bins").iterdir())
    assert names == ["docs_train_000000.bin", "docs_val_000000.bin"], names
    # a column other than "text"
    other = cli("tokenizer", "train", "--data", str(files["content"]), "--text-column", "content", "--vocab-size",
                "280", str(tmp_path / "tok2.json"))
    assert other.returncode == 0, other.stderr
    assert json.loads((tmp_path / "tok2.json").read_text())["model"]["type"] == "BPE"
    assert_bad_input(cli("tokenizer", "train", "--data", str(files["content"]), "--vocab-size", "300",
                         str(tmp_path / "tok3")), "no text column 'text'", "content")
    assert_bad_input(cli("tokenizer", "train", "--data", str(files["parquet"]), "--vocab-size", "10",
                         str(tmp_path / "tok4")), "vocab size 10 is too small")
    offline = cli("tokenize", "--data", "hf:roneneldan/TinyStories", str(tmp_path / "out"), offline=True)
    assert_bad_input(offline, "hf:roneneldan/TinyStories", "switched off")
