"""Tests for corpus loading and deterministic byte batching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diloco_node.train.bytedata import ByteDataset
from diloco_node.train.sources import DataError, embedded_corpus, load_corpus

TEXT = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 100).encode()


@pytest.fixture(scope="module")
def small_embedded() -> bytes:
    return embedded_corpus(max_bytes=200_000)


def test_embedded_corpus_is_deterministic_stdlib_text(small_embedded: bytes) -> None:
    assert len(small_embedded) == 200_000
    assert small_embedded == embedded_corpus(max_bytes=200_000)
    assert b"def " in small_embedded and b"import " in small_embedded


def test_load_corpus_none_uses_embedded() -> None:
    assert load_corpus(None) == embedded_corpus()


def test_load_text_file(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes(TEXT)
    assert load_corpus(str(path)) == TEXT


def test_load_directory_sorted_skipping_binary(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"B" * 3000)
    (tmp_path / "a.txt").write_bytes(b"A" * 3000)
    (tmp_path / "sub" / "c.md").write_bytes(b"C" * 3000)
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00" * 1000)
    assert load_corpus(str(tmp_path)) == b"A" * 3000 + b"\n" + b"B" * 3000 + b"\n" + b"C" * 3000


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"text": "x" * 3000}, {"text": "héllo" * 600, "id": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    assert load_corpus(str(path)) == ("x" * 3000 + "\n" + "héllo" * 600).encode()


def test_missing_path_raises(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="does not exist") as info:
        load_corpus(str(missing))
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("bad_line", ["not json", '{"txt": "a"}', '{"text": 5}', "[1, 2]"])
def test_malformed_jsonl_line_names_file_and_line(tmp_path: Path, bad_line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "a" * 5000}) + "\n" + bad_line + "\n")
    with pytest.raises(DataError, match="line 2") as info:
        load_corpus(str(path))
    assert str(path) in str(info.value)


def test_empty_and_tiny_corpora_raise(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty") as info:
        load_corpus(str(empty))
    assert str(empty) in str(info.value)
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"abc")
    with pytest.raises(DataError, match="too small"):
        load_corpus(str(tiny))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(tmp_path / "emptydir"))


def test_split_sizes(small_embedded: bytes) -> None:
    ds = ByteDataset(small_embedded, seq_len=64, eval_fraction=0.1)
    assert ds.train_bytes == 180_000 and ds.eval_bytes == 20_000


def test_train_batch_is_deterministic_and_shifted(small_embedded: bytes) -> None:
    ds = ByteDataset(small_embedded, seq_len=64)
    x1, y1 = ds.train_batch(8, stream_seed=3, position=10)
    x2, y2 = ByteDataset(small_embedded, seq_len=64).train_batch(8, stream_seed=3, position=10)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (8, 64) and x1.dtype == torch.long
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_train_batch_differs_by_seed_and_position(small_embedded: bytes) -> None:
    ds = ByteDataset(small_embedded, seq_len=64)
    base, _ = ds.train_batch(8, stream_seed=0, position=0)
    assert not torch.equal(base, ds.train_batch(8, stream_seed=1, position=0)[0])
    assert not torch.equal(base, ds.train_batch(8, stream_seed=0, position=1)[0])


def test_eval_batches_identical_and_from_eval_split(small_embedded: bytes) -> None:
    a = ByteDataset(small_embedded, seq_len=64).eval_batches(4, max_batches=3)
    b = ByteDataset(small_embedded, seq_len=64).eval_batches(4, max_batches=3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # Windows are consecutive, non-overlapping slices of the tail of the corpus.
    ds = ByteDataset(small_embedded, seq_len=64)
    eval_region = small_embedded[ds.train_bytes :]
    flat = b"".join(bytes(torch.cat([x[i], y[i, -1:]]).tolist()) for x, y in a for i in range(4))
    assert eval_region.startswith(flat)


def test_train_and_eval_regions_are_disjoint() -> None:
    # Train region is all "A", eval region all "E": any leak shows up as a foreign byte.
    corpus = b"A" * 7680 + b"E" * 2560
    ds = ByteDataset(corpus, seq_len=16, eval_fraction=0.25)
    assert ds.train_bytes == 7680
    for pos in range(50):
        x, y = ds.train_batch(32, stream_seed=9, position=pos)
        assert bool((x == ord("A")).all()) and bool((y == ord("A")).all())
    for x, y in ds.eval_batches(8):
        assert bool((x == ord("E")).all()) and bool((y == ord("E")).all())


def test_too_short_for_seq_len_raises() -> None:
    with pytest.raises(DataError):
        ByteDataset(b"a" * 5000, seq_len=1024, eval_fraction=0.05)
