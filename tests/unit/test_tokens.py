"""Tokenizers, data sources, token shards and the prefetch (issue 27): offline, on data made here.

A byte-level BPE tokenizer is trained by the test on small text; datasets are written as parquet and
read back through `datasets`; shards are written by `write_shards` and by hand (llm.c, nanoGPT).
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from diloco_node.config import ConfigError, build_config
from diloco_node.swarm.records import config_difference
from diloco_node.train import data as D
from diloco_node.train import shards
from diloco_node.train.prefetch import DataMeter, Prefetcher
from diloco_node.train.prepare import write_shards
from diloco_node.train.shares import TokenDataset
from diloco_node.train.sources import HUB_TIMEOUT, DataError, documents, parse_hub
from diloco_node.train.tokenizer import TokenizerError, load_tokenizer, train_tokenizer
from diloco_node.train.tokens import EVAL_FRACTION, Source, digest_of, pack, read_source

WORDS = ("the quick brown fox jumps over a lazy dog while river stones hum under grey clouds "
         "and seven small birds count their feathers beside an old wooden bridge").split()


def make_docs(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60))) + "." for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(300)
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), root / "docs.parquet")
    pq.write_table(pa.table({"body": docs[:50]}), root / "notext.parquet")
    train_tokenizer(iter(docs), 320, root / "tok")
    train_tokenizer(iter(docs[:100]), 300, root / "other.json")
    return {"root": root, "parquet": root / "docs.parquet", "notext": root / "notext.parquet",
            "tok": root / "tok", "other": root / "other.json"}


# --- tokenizers ---------------------------------------------------------------------------------


def test_trained_tokenizer_loads_from_file_or_directory(corpus: dict[str, Path]) -> None:
    from_dir = load_tokenizer(str(corpus["tok"]))
    from_file = load_tokenizer(str(corpus["tok"] / "tokenizer.json"))
    assert from_dir.vocab_size == from_file.vocab_size == 320
    assert from_dir.digest == from_file.digest
    assert from_dir.eot_id == 0  # the end-of-text token is the first special token
    ids = from_dir.encode_batch(["the quick brown fox"])[0]
    assert 0 < len(ids) < len("the quick brown fox")  # merges learnt
    assert load_tokenizer(str(corpus["other"])).digest != from_dir.digest


def test_bytes_are_the_default_tokenizer() -> None:
    tokenizer = load_tokenizer(None)
    assert (tokenizer.vocab_size, tokenizer.digest) == (256, "bytes")
    assert tokenizer.encode_batch(["hé"]) == [[104, 195, 169]]


@pytest.mark.parametrize("content,words", [(None, "does not exist"), ("{not json", "not a tokenizer.json")])
def test_unusable_tokenizer(tmp_path: Path, content: str | None, words: str) -> None:
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenizerError, match=words):
        load_tokenizer(str(path))


# --- sources, packing and the eval split --------------------------------------------------------


def test_parquet_documents_are_packed_with_end_of_text(corpus: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(str(corpus["tok"]))
    source = read_source(str(corpus["parquet"]), tokenizer)
    docs = pq.read_table(corpus["parquet"]).column("text").to_pylist()
    expected = np.concatenate([np.array([*ids, tokenizer.eot_id]) for ids in tokenizer.encode_batch(docs)])
    packed = np.concatenate(source.train + source.eval)
    assert np.array_equal(packed, expected)
    assert sum(len(a) for a in source.eval) == len(expected) - int(len(expected) * (1 - EVAL_FRACTION))


def test_jsonl_text_and_directory_sources(tmp_path: Path) -> None:
    docs = make_docs(60)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "t").mkdir()
    for index, doc in enumerate(docs):
        (tmp_path / "t" / f"{index:03d}.txt").write_text(doc)
    assert list(documents(str(tmp_path / "j" / "a.jsonl"))) == docs
    assert list(documents(str(tmp_path / "j"))) == docs
    assert list(documents(str(tmp_path / "t"))) == docs


def test_a_dataset_without_the_text_column(corpus: dict[str, Path]) -> None:
    with pytest.raises(DataError, match="no text column 'text' \\(columns: body"):
        read_source(str(corpus["notext"]), load_tokenizer(None))


def test_a_text_column_that_is_not_text_and_mixed_formats(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": list(range(100))}), tmp_path / "numbers.parquet")
    with pytest.raises(DataError, match="column 'text' holds int, not text"):
        read_source(str(tmp_path / "numbers.parquet"), load_tokenizer(None))
    (tmp_path / "more.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="mixes json, parquet files"):
        read_source(str(tmp_path), load_tokenizer(None))


def test_corrupt_parquet_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match="broken.parquet") as info:
        read_source(str(path), load_tokenizer(None))
    assert "\n" not in str(info.value)


def test_eval_split_is_the_same_for_every_node_and_disjoint_from_train(corpus: dict[str, Path]) -> None:
    a = D.open_data(str(corpus["parquet"]), str(corpus["tok"]), 32)
    b = D.open_data(str(corpus["parquet"]), str(corpus["tok"]), 32)
    for (xa, ya), (xb, yb) in zip(a.eval_batches(4, 3), b.eval_batches(4, 3), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # the eval windows are the tail of the packed tokens, the train windows never reach it
    train_tokens = sum(len(t) for t in a.dataset.source.train)
    assert a.dataset.train_windows == (train_tokens - 1) // 32


# --- the node's order: every window once per epoch, resumable -------------------------------------


def window_ids(dataset: TokenDataset, batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    """Which train windows a batch holds (window i starts at token i * seq_len of the train split)."""
    train = torch.from_numpy(np.concatenate(dataset.source.train).astype(np.int64))
    ids = []
    for row in torch.cat([batch[0], batch[1][:, -1:]], dim=1):
        starts = [i for i in range(dataset.train_windows)
                  if torch.equal(train[i * dataset.seq_len:i * dataset.seq_len + dataset.seq_len + 1], row)]
        ids.append(starts[0])
    return ids


def test_each_epoch_reads_every_window_once_in_the_nodes_own_order(corpus: dict[str, Path]) -> None:
    data = D.open_data(str(corpus["parquet"]), str(corpus["tok"]), 64)
    dataset, batch = data.dataset, 5
    n = dataset.train_windows
    order = dataset.window_indices(stream_seed=11, start=0, count=2 * n)
    assert sorted(order[:n]) == list(range(n)) and sorted(order[n:]) == list(range(n))
    assert not np.array_equal(order[:n], order[n:])  # each epoch its own permutation
    assert not np.array_equal(order[:n], dataset.window_indices(stream_seed=12, start=0, count=n))
    assert order[0] != dataset.window_indices(stream_seed=12, start=0, count=1)[0]  # another place, another start
    # the batches are those windows, in that order
    x, y = data.train_batch(batch, 11, 3)
    assert window_ids(dataset, (x, y)) == list(order[3 * batch:4 * batch])
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_nodes_read_disjoint_shares_of_one_ring(corpus: dict[str, Path]) -> None:
    """Every node reads the epoch's one ring of windows, onwards from its own place: two nodes read
    disjoint windows until one reaches the other's place, and a third joining later changes neither's."""
    dataset = D.open_data(str(corpus["parquet"]), str(corpus["tok"]), 16).dataset
    n = dataset.train_windows
    a, b, c = 0, 1, 2
    starts = {seed: dataset.share_start(seed) for seed in (a, b, c)}
    assert len(set(starts.values())) == 3
    ring = np.roll(dataset.window_indices(a, 0, n), starts[a])  # a's epoch, from the ring's place 0: the ring
    for seed in (a, b, c):  # every node's epoch is the same ring, rotated to its place
        assert np.array_equal(dataset.window_indices(seed, 0, n), np.roll(ring, -starts[seed]))
    gap = (starts[b] - starts[a]) % n  # the arc a reads before it reaches b's place
    first_a, first_b = dataset.window_indices(a, 0, gap), dataset.window_indices(b, 0, n - gap)
    assert not set(first_a.tolist()) & set(first_b.tolist())
    assert sorted([*first_a.tolist(), *first_b.tolist()]) == list(range(n))  # together: the split, once
    # epoch 2 is another ring, read from the same places
    assert not np.array_equal(dataset.window_indices(a, n, n), dataset.window_indices(a, 0, n))
    assert dataset.window_indices(a, n, 1)[0] == dataset.window_indices(b, n + (starts[a] - starts[b]) % n, 1)[0]


def test_a_resumed_node_goes_on_where_it_stopped(corpus: dict[str, Path]) -> None:
    """Positions 0..9 in one go equal 0..4, a stop, then 5..9 from a fresh process's data (as a node
    resumed from its checkpoint's data_position): no window repeated, none skipped."""
    spec, tok = str(corpus["parquet"]), str(corpus["tok"])
    one = D.open_data(spec, tok, 64)
    straight = [one.train_batch(4, 5, p) for p in range(10)]
    before = D.open_data(spec, tok, 64)
    first = [before.train_batch(4, 5, p) for p in range(5)]
    before.prefetch.close()
    D._source.cache_clear()  # a new process reads the source again
    after = D.open_data(spec, tok, 64)
    resumed = first + [after.train_batch(4, 5, p) for p in range(5, 10)]
    for (xa, ya), (xb, yb) in zip(straight, resumed, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    order = after.dataset.window_indices(5, 0, 40)
    assert len(set(order.tolist())) == 40  # 40 distinct windows: nothing read twice within the epoch
    # and they are the node's share: the ring onwards from its place, before the stop and after it
    n, place = after.dataset.train_windows, after.dataset.share_start(5)
    dataset_ring = after.dataset._ring(0)
    assert np.array_equal(order, dataset_ring[[(place + i) % n for i in range(40)]])
    assert window_ids(after.dataset, resumed[5]) == order[20:24].tolist()


def test_the_prefetch_follows_jumps_and_counts_waits(corpus: dict[str, Path]) -> None:
    data = D.open_data(str(corpus["parquet"]), str(corpus["tok"]), 64)
    meter = DataMeter()
    data.prefetch = Prefetcher(data.dataset.batches, meter)
    expected = data.dataset.batch(4, 9, 7)
    got = data.train_batch(4, 9, 7)  # a start at 7 (a resume): one cold start
    assert torch.equal(got[0], expected[0])
    for position in range(8, 30):
        time.sleep(0.005)  # stands in for a training step
        x, _ = data.train_batch(4, 9, position)
        assert torch.equal(x, data.dataset.batch(4, 9, position)[0])
    assert torch.equal(data.train_batch(4, 9, 2)[0], data.dataset.batch(4, 9, 2)[0])  # a jump back restarts
    assert (meter.batches, meter.cold_starts, meter.waits) == (24, 2, 0)
    data.prefetch.close()


def test_reading_and_tokenizing_run_off_the_calling_thread(corpus: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """open_data returns while the source is still being read; the read runs on its own thread, and the
    fingerprint's digest and the replica's batches wait for that one read (and get its DataError)."""
    release, threads = threading.Event(), []
    real = read_source

    def slow_read(*args: Any) -> Source:
        threads.append(threading.current_thread().name)
        assert release.wait(30)
        return real(*args)

    monkeypatch.setattr(D, "read_source", slow_read)  # the name data.py's reads call
    D._source.cache_clear()
    spec, tok = str(corpus["parquet"]), str(corpus["tok"])
    data = D.open_data(spec, tok, 64)  # returns with the read blocked: it is not on this thread
    assert threads == ["data-read"]
    data.prepare(4, 3, 0)  # the prefetch starts before the read is done: its thread waits for it
    release.set()
    meter = data.prefetch.meter = DataMeter()
    x, _ = data.train_batch(4, 3, 0)
    assert torch.equal(x, data.dataset.batch(4, 3, 0)[0]) and meter.cold_starts == 0  # no restart: prepared
    assert D._source(spec, tok, "text") is data.dataset.source and threads == ["data-read"]  # one read, shared
    data.prefetch.close()
    D._source.cache_clear()
    bad = D.open_data(str(corpus["notext"]), tok, 64)
    with pytest.raises(DataError, match="no text column 'text'"):
        bad.eval_batches(4)
    with pytest.raises(DataError, match="no text column 'text'"):
        bad.train_batch(4, 3, 0)
    D._source.cache_clear()


def test_a_producer_failure_reaches_the_training_thread() -> None:
    def failing(batch_size: int, seed: int, position: int):  # type: ignore[no-untyped-def]
        yield torch.zeros(1), torch.zeros(1)
        raise OSError("disk gone")

    prefetch = Prefetcher(failing, DataMeter())
    prefetch.get(1, 0, 0)
    with pytest.raises(DataError, match="disk gone"):
        prefetch.get(1, 0, 1)


# --- shards ---------------------------------------------------------------------------------------


class Counted:
    """A Tally that keeps what it is told."""

    def __init__(self) -> None:
        self.total: float | None = None
        self.amount = 0.0
        self.counts: list[int] = []

    def expect(self, total: float) -> None:
        self.total = total

    def add(self, amount: float, count: int = 1) -> None:
        self.amount += amount
        self.counts.append(count)


def test_tokenize_writes_llmc_shards_the_node_reads_back(corpus: dict[str, Path], tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(corpus["tok"]))
    tally = Counted()  # tokenize's progress: the documents to come, then each one tokenized, once
    paths, train, held = write_shards(str(corpus["parquet"]), str(corpus["tok"]), tmp_path / "out",
                                        shard_tokens=4000, tally=tally)
    source = read_source(str(corpus["parquet"]), tokenizer)
    assert train == sum(len(a) for a in source.train) and held == sum(len(a) for a in source.eval)
    assert sum(tally.counts) == train + held and tally.amount == len(tally.counts) == tally.total > 1
    assert len(paths) == 1 + -(-train // 4000)
    header = np.fromfile(paths[-1], dtype="<i4", count=256)
    assert (header[0], header[1]) == (20240520, 1)  # llm.c's GPT-2 layout: uint16 tokens
    again = read_source(str(tmp_path / "out"), tokenizer)  # *_val_* is the eval split
    assert np.array_equal(np.concatenate(again.train), np.concatenate(source.train))
    assert np.array_equal(np.concatenate(again.eval), np.concatenate(source.eval))
    assert digest_of(again.eval) == digest_of(source.eval)


def test_nanogpt_and_llama3_layouts(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype="<u2") % 250
    tokens.tofile(tmp_path / "train.bin")
    assert np.array_equal(shards.open_shard(tmp_path / "train.bin"), tokens)
    shards.write_shard(tmp_path / "big.bin", np.arange(10, dtype=np.uint32) + 70_000, 128_256)
    assert shards.open_shard(tmp_path / "big.bin").tolist() == list(range(70_000, 70_010))
    assert shards.is_eval_shard(Path("val.bin")) and shards.is_eval_shard(Path("fineweb_val_000000.bin"))
    assert not shards.is_eval_shard(Path("fineweb_train_000001.bin"))


@pytest.mark.parametrize("damage,words", [
    ("truncate", "truncated or corrupt: its header says 1000 tokens"),
    ("odd", "not a whole number of uint16 tokens"),
    ("version", "version 3"),
    ("empty", "is empty"),
])
def test_damaged_shards_are_refused_naming_the_file(tmp_path: Path, damage: str, words: str) -> None:
    path = tmp_path / "d_train_000000.bin"
    shards.write_shard(path, np.arange(1000) % 200, 256)
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:-100])
    elif damage == "odd":
        path.write_bytes(b"\x01\x02\x03")
    elif damage == "version":
        path.write_bytes(raw[:4] + np.int32(3).tobytes() + raw[8:])
    else:
        path.write_bytes(b"")
    with pytest.raises(shards.ShardError, match=words) as info:
        read_source(str(tmp_path), load_tokenizer(None))
    assert str(path) in str(info.value)


def test_shard_ids_beyond_the_vocabulary(tmp_path: Path) -> None:
    shards.write_shard(tmp_path / "x_train_000000.bin", np.full(500, 300), 320)
    with pytest.raises(shards.ShardError, match="token id 300, beyond the tokenizer's vocabulary of 256"):
        read_source(str(tmp_path), load_tokenizer(None))


# --- hub datasets ---------------------------------------------------------------------------------


def test_hub_offline_is_one_line_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="hub dataset and the hub is switched off"):
        read_source("hf:HuggingFaceFW/fineweb-edu:sample-10BT", load_tokenizer(None))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    started = time.monotonic()
    with pytest.raises(DataError, match="cannot be reached") as info:
        read_source("hf:HuggingFaceFW/fineweb-edu", load_tokenizer(None))
    assert time.monotonic() - started < HUB_TIMEOUT + 1
    assert "local files" in str(info.value)


@pytest.mark.parametrize("spec", ["hf:", "hf:a:b:c:d", "hf:a::train"])
def test_malformed_hub_names(spec: str) -> None:
    with pytest.raises(DataError, match="is not hf:NAME"):
        parse_hub(spec)


def test_a_stream_is_read_in_the_nodes_order_and_resumes(corpus: dict[str, Path]) -> None:
    """The hub path, fed a local parquet stream (datasets' IterableDataset, as for a hub dataset)."""
    import datasets

    def load() -> datasets.IterableDataset:
        return datasets.load_dataset("parquet", data_files=str(corpus["parquet"]), split="train", streaming=True)

    tokenizer = load_tokenizer(str(corpus["tok"]))
    held = [np.concatenate(list(pack(tokenizer, pq.read_table(corpus["parquet"]).column("text")
                                        .to_pylist()[:20])))]
    dataset = TokenDataset(Source([], held, stream=load, skip=20), 32, tokenizer, "stream")
    straight = dataset.batches(4, 3, 0)
    first = [next(straight) for _ in range(6)]
    later = dataset.batches(4, 3, 4)  # a resume at position 4 reads and drops what came before
    for batch in first[4:]:
        assert torch.equal(next(later)[0], batch[0])
    other = next(dataset.batches(4, 4, 0))[0]
    assert not torch.equal(other, first[0][0])  # another node, another order


# --- the run's fingerprint --------------------------------------------------------------------------


def test_tokenizer_larger_than_the_vocabulary_names_both(corpus: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="has 320 tokens, more than model 'tiny' has in its vocabulary \\(256\\)"):
        build_config({"tokenizer": str(corpus["tok"])})


def test_the_fingerprint_names_the_tokenizer_and_the_eval_data(corpus: dict[str, Path], tmp_path: Path) -> None:
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                 "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128}))
    base = {"model": str(model), "data": str(corpus["parquet"])}
    ours = build_config({**base, "tokenizer": str(corpus["tok"])})
    theirs = build_config({**base, "tokenizer": str(corpus["other"])})
    fields = ours.fingerprint_fields()
    assert fields["tokenizer"] == load_tokenizer(str(corpus["tok"])).digest
    assert fields["eval_data"] == digest_of(read_source(str(corpus["parquet"]),
                                                             load_tokenizer(str(corpus["tok"]))).eval)
    assert ours.fingerprint() != theirs.fingerprint()
    difference = config_difference(fields, theirs.fingerprint_fields())
    theirs_digest = load_tokenizer(str(corpus['other'])).digest
    assert f"--tokenizer {theirs_digest[:12]}… (ours: {fields['tokenizer'][:12]}…)" in difference
    assert "tokenizer" not in build_config({}).fingerprint_fields()  # bytes and the default corpus: as before
    assert "eval_data" not in build_config({}).fingerprint_fields()
