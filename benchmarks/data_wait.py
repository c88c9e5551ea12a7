"""Does the inner loop ever wait for data? The node's own replica, its own data path, counted.

    .venv/bin/python benchmarks/data_wait.py               # ~2 min on 2 CPU cores
    .venv/bin/python benchmarks/data_wait.py --steps 50    # quicker

For each case a one-process replica (replica/single.py, exactly what `join` runs) trains `--steps`
inner steps on batch positions 0, 1, 2, ... as the round loop asks for them, and the data's meter
(train/prefetch.py, DataMeter: the same figure a node logs as `data batches=… waits=…`) counts every
time the training thread asked for a batch and found the prefetch queue empty (`waits`, and the
seconds it then blocked, `wait_s`, after the first step). The first batch's wait is reported apart
(`first batch s`): by default the prefetch is started first at the data position and an eval runs, as
a node's start-up does (Replica.prepare_data, then its eval loss at join); `--cold` leaves the
prefetch to start at the first step, as it did before start-up prepared it. The prefetch's own rate
(`producer batches/s`: the batches it makes with no training beside it) shows the margin: how much
faster than the inner loop the data can be made.

Cases: the default (built-in `tiny` GPT, bytes, the embedded corpus); a Llama (configs/llama-2m.json)
with a BPE tokenizer trained here on examples/tiny-stories.jsonl, from the jsonl through datasets
(tokenized at start-up), from token shards written by `tokenize` (memory-mapped), and as a stream
(datasets' IterableDataset over the same jsonl, which is what an hf:NAME source reads: documents are
fetched and tokenized in the prefetch thread while the model trains).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import datasets
import torch

from diloco_node.config import build_config
from diloco_node.replica import settings_of
from diloco_node.replica.single import SingleReplica
from diloco_node.train.data import NodeData
from diloco_node.train.prefetch import METER
from diloco_node.train.prepare import train_tokenizer_from, write_shards
from diloco_node.train.shares import TokenDataset
from diloco_node.train.tokens import Source

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "tiny-stories.jsonl"


def measure(label: str, values: dict[str, object], steps: int, stream: str | None = None,
            prepared: bool = True) -> dict[str, float | str]:
    cfg = build_config({**values, "threads": 1, "checkpoint_dir": ""})
    replica = SingleReplica(settings_of(cfg))
    if stream is not None:  # what an hf: source reads, from a local file: documents tokenized in the prefetch
        replica.dataset = NodeData(TokenDataset(
            Source([], replica.dataset.dataset.source.eval, stream=lambda: datasets.load_dataset(
                "json", data_files=stream, split="train", streaming=True), skip=0),
            cfg.inputs.seq_len, replica.dataset.dataset.tokenizer, "stream"))
    replica.load([p.detach().clone() for p in replica.model.parameters()])
    METER.reset()  # this case's figures only
    if prepared:  # as start-up does once it knows the data position, then its eval at join
        replica.prepare_data(7, 0)
        replica.evaluate()
    started = time.perf_counter()
    replica.train_step(7, 0)
    first_s, first_waits = METER.waited(), METER.waits
    for position in range(1, steps):
        replica.train_step(7, position)
    seconds = time.perf_counter() - started
    meter = METER
    # the producer alone: how fast the prefetch makes batches when nothing else runs
    data = replica.dataset
    produced = time.perf_counter()
    batches = data.dataset.batches(cfg.inputs.batch_size, 8, 0)  # another node's order, from its start
    for _ in range(steps):
        next(batches)
    producer = steps / (time.perf_counter() - produced)
    data.prefetch.close()
    return {"case": label, "steps": steps, "step_ms": 1000 * seconds / steps, "waits": meter.waits - first_waits,
            "wait_s": meter.waited() - first_s, "cold_s": first_s, "producer_per_s": producer,
            "steps_per_s": steps / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cold", action="store_true", help="do not prepare the prefetch before the first step "
                        "(what a node did before start-up called Replica.prepare_data)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(tmp) / "tok"
        train_tokenizer_from(str(SAMPLE), 2048, tokenizer)
        write_shards(str(SAMPLE), str(tokenizer), Path(tmp) / "shards")
        llama = {"model": str(ROOT / "configs" / "llama-2m.json"), "tokenizer": str(tokenizer), "seq_len": 128,
                 "batch_size": 16}
        cases = [("tiny GPT, bytes, embedded corpus", {}),
                 ("llama-2m, BPE, jsonl via datasets", {**llama, "data": str(SAMPLE)}),
                 ("llama-2m, BPE, token shards (mmap)", {**llama, "data": str(Path(tmp) / "shards")})]
        rows = [measure(label, values, args.steps, prepared=not args.cold) for label, values in cases]
        rows.append(measure("llama-2m, BPE, a stream (datasets streaming, tokenized in the prefetch)",
                            {**llama, "data": str(SAMPLE)}, args.steps, stream=str(SAMPLE), prepared=not args.cold))
    print("| case | steps | ms/step | waits | wait s | first batch s | prefetch batches/s | inner steps/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['steps']} | {r['step_ms']:.1f} | {r['waits']} | {r['wait_s']:.4f} | "
              f"{r['cold_s']:.4f} | {r['producer_per_s']:.0f} | {r['steps_per_s']:.1f} |")


if __name__ == "__main__":
    main()
