"""A Hugging Face model starts from the same bits in every process, and under FSDP or a pipeline
over two local ranks trains the same θ as in one process from the same φ. A tiny Llama with tied
embeddings: one FSDP unit per decoder layer, the rotary frequencies (buffers, not in φ) rebuilt on
every rank, the tie kept (the pipeline's last stage holds a copy kept equal). GPT-2 (tied, learned
positions added on the first stage only) and Qwen2 (untied, per-layer attention types) in a pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_node.replica import ReplicaSettings, make_replica
from diloco_node.replica.layout import digest
from diloco_node.train.model import build_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
          "tie_word_embeddings": True}
# three layers over two stages: [0, 1] and [2]; no dropout, so one process and a pipeline draw nothing
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": 256, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
QWEN2 = {**CONFIG, "model_type": "qwen2", "num_hidden_layers": 3, "tie_word_embeddings": False}


def _train_in_layouts(config: dict[str, Any], root: Path, layouts: tuple[str, ...]) -> dict[str, Any]:
    """Per layout (two local ranks, or one process for none): φ's eval loss, three steps' losses and θ."""
    (root / "config.json").write_text(json.dumps(config))
    phi = [p.detach().clone() for p in build_model(str(root), 0).parameters()]
    results = {"phi": phi}
    for layout in layouts:
        ranks = 1 if layout == "none" else 2
        settings = ReplicaSettings(model=str(root), seed=0, data=None, seq_len=16, batch_size=4, eval_batches=1,
                                   inner_lr=1e-3, warmup_steps=1, weight_decay=0.1, grad_clip=1.0, total_steps=0,
                                   precision="fp32", parallel=layout, devices=("cpu",) * ranks, threads=1,
                                   micro_batch_size=1)
        replica = make_replica(settings)
        try:
            replica.load(phi)
            eval_loss = replica.evaluate()
            losses = [replica.train_step(3, position) for position in range(3)]
            results[layout] = (eval_loss, losses, replica.theta(), replica.inner_state())
        finally:
            replica.close()
    return results


def _agrees(results: dict[str, Any], layout: str) -> None:
    (eval_split, losses_split, theta_split, state_split) = results[layout]
    (eval_one, losses_one, theta_one, state_one) = results["none"]
    assert abs(eval_split - eval_one) < 1e-5, layout
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses_split, losses_one, strict=True)), layout
    assert len(theta_split) == len(results["phi"])  # canonical: a tied embedding once
    assert all(torch.allclose(a, b, atol=2e-6, rtol=1e-5) for a, b in zip(theta_split, theta_one, strict=True)), layout
    assert not all(torch.equal(a, b) for a, b in zip(theta_one, results["phi"], strict=True))  # it did train
    # the inner AdamW state a checkpoint saves: canonical names, the same moments (a tie's copy not twice)
    assert (state_split["step"], sorted(state_split["moments"])) == (state_one["step"], sorted(state_one["moments"]))
    for name, (exp_avg, exp_avg_sq) in state_one["moments"].items():
        assert torch.allclose(state_split["moments"][name][0], exp_avg, atol=1e-6, rtol=1e-4), (layout, name)
        assert torch.allclose(state_split["moments"][name][1], exp_avg_sq, atol=1e-9, rtol=1e-4), (layout, name)


def test_fsdp_and_pipeline_train_the_same_theta_as_one_process(tmp_path: Path) -> None:
    results = _train_in_layouts(CONFIG, tmp_path, ("fsdp", "pipeline", "none"))
    _agrees(results, "fsdp")
    _agrees(results, "pipeline")


@pytest.mark.parametrize("config", [GPT2, QWEN2], ids=["gpt2", "qwen2"])
def test_a_pipeline_splits_other_architectures_as_one_process_trains_them(tmp_path: Path,
                                                                          config: dict[str, Any]) -> None:
    _agrees(_train_in_layouts(config, tmp_path, ("pipeline", "none")), "pipeline")


def test_random_init_is_the_same_in_another_process(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    ours = digest(list(build_model(str(tmp_path), seed=5).parameters()))
    script = ("import sys, torch; torch.set_num_threads(1); from diloco_node.train.model import build_model; "
              "from diloco_node.replica.layout import digest; "
              "print(digest(list(build_model(sys.argv[1], seed=5).parameters())))")
    other = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert other.stdout.strip() == ours  # another process, another thread count: the same bits


def test_compile_trains_the_same_as_eager(tmp_path: Path) -> None:
    """--compile on: torch.compile of the forward (inductor on the CPU), parameters keep their names."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    phi = [p.detach().clone() for p in build_model(str(tmp_path), 0).parameters()]
    runs = []
    for compiled in (False, True):
        settings = ReplicaSettings(model=str(tmp_path), seed=0, data=None, seq_len=16, batch_size=4, eval_batches=1,
                                   inner_lr=1e-3, warmup_steps=1, weight_decay=0.1, grad_clip=1.0, total_steps=0,
                                   precision="fp32", parallel="none", devices=("cpu",), threads=1, compile=compiled,
                                   micro_batch_size=2)
        replica = make_replica(settings)
        replica.load(phi)
        runs.append(([replica.train_step(3, position) for position in range(2)], replica.theta()))
    (eager_losses, eager), (compiled_losses, compiled_theta) = runs
    assert all(abs(a - b) < 1e-4 for a, b in zip(eager_losses, compiled_losses, strict=True))
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(eager, compiled_theta, strict=True))


def test_a_trained_run_exports_what_transformers_loads(spawn: Any, tmp_path: Path) -> None:
    """A node trains a tiny Llama with a BPE tokenizer on parquet; `diloco-node export` of its checkpoint
    loads in transformers, whose loss on the node's held-out batches equals the node's last eval loss."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from diloco_node.train.data import open_data
    from diloco_node.train.tokenizer import load_tokenizer, train_tokenizer

    words = "a small fox ran to the hill to look at the birds that sang in the old tree by the river".split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) + "." for i in range(600)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "train.parquet")
    train_tokenizer(iter(docs), 300, tmp_path / "tokenizer.json")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 300}))
    node = spawn("a", "--model", str(tmp_path / "llama"), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--data", str(tmp_path / "train.parquet"), "--inner-steps", "5", "--max-outer-steps", "2",
                 "--seq-len", "32")
    assert node.wait_exit(timeout=300) == 0, node.log_text()[-2000:]
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "diloco_node", "export", "--checkpoint-dir", str(tmp_path / "a"),
                           "--run-id", "itest", str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 and done.stdout.strip() == f"wrote {out}", done.stderr
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("the old tree")["input_ids"] == \
        load_tokenizer(str(tmp_path / "tokenizer.json")).encode_batch(["the old tree"])[0]
    batches = open_data(str(tmp_path / "train.parquet"), str(tmp_path / "tokenizer.json"), 32).eval_batches(8, 2)
    with torch.no_grad():
        losses = [float(model(input_ids=torch.cat([x, y[:, -1:]], 1), labels=torch.cat([x, y[:, -1:]], 1)).loss)
                  for x, y in batches]
    assert sum(losses) / len(losses) == pytest.approx(node.rounds[2].eval_loss, abs=1e-5)

