"""Checkpoints (checkpoint.py): tensors in safetensors, the rest in a JSON manifest written last;
bit-exact round trips, a resumed replica continuing exactly, damaged files refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from diloco_node.checkpoint import CheckpointError, CheckpointStore, read_checkpoint
from diloco_node.replica import ReplicaSettings, make_replica
from diloco_node.train.model import build_model


def state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(12, generator=generator)
    return {"fingerprint": "abc", "round": 7, "data_position": 123, "stream_seed": 2**40 + 3,
            "outer_params": [flat[:6].view(2, 3), flat[6:]],  # views of one storage, as a flat φ's would be
            "momentum": None,
            "inner": {"step": 9, "adam_step": 9, "moments": {"w.weight": (torch.ones(2, 3).bfloat16(),
                                                                          torch.full((2, 3), 1e-30))}},
            "codec": {"residual": torch.arange(5, dtype=torch.float16)},
            "outstanding": [{"round": 6, "own": torch.zeros(4), "weight": 0.1 + 0.2, "at_step": 3}],
            "by_number": {0: torch.tensor(1.5), 1: torch.tensor([True, False])},
            "scalars": [math.inf, -0.0, 1e-310, "text", True]}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return isinstance(b, float) and math.copysign(1, a) == math.copysign(1, b) and (a == b)
    return type(a) is type(b) and a == b


def test_a_round_trip_is_exact_and_holds_no_pickle(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    saved = state()
    store.save(saved)
    loaded = store.load()
    assert loaded is not None and loaded.pop("format") == 3
    assert same(saved, loaded)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[0] == ".lock" and files[1].startswith("node-") and files[1].endswith(".safetensors")
    assert files[2:] == ["node.json"]
    manifest = json.loads((tmp_path / "node.json").read_text())
    assert manifest["state"]["round"] == 7 and manifest["state"]["data_position"] == 123
    tensors = load_file(tmp_path / files[1])  # readable by any safetensors reader, names saying what they are
    assert torch.equal(tensors["outer_params/1"], saved["outer_params"][1])
    assert tensors["inner/moments/w.weight/0"].dtype == torch.bfloat16
    store.close()


def test_the_previous_tensors_file_is_kept_one_save_and_an_old_torch_checkpoint_is_replaced(tmp_path: Path) -> None:
    legacy = {"format": 2, "round": 1, "outer_params": [torch.ones(3)]}
    torch.save(legacy, tmp_path / "node.pt")
    store = CheckpointStore(tmp_path)
    old = store.load()
    assert old is not None and old["round"] == 1 and store.path.name == "node.pt"  # still read, weights_only
    names = []
    for round_ in range(3):
        store.save({**state(), "round": round_, "outer_params": [torch.full((3,), float(round_))]})
        names.append(json.loads((tmp_path / "node.json").read_text())["tensors"])
        assert not (tmp_path / "node.pt").exists()
    assert sorted(p.name for p in tmp_path.glob("node-*")) == sorted(names[1:])
    loaded = read_checkpoint(tmp_path)  # by directory, as export reads it
    assert loaded["round"] == 2 and torch.equal(loaded["outer_params"][0], torch.full((3,), 2.0))
    store.close()


def damage(directory: Path, how: str) -> None:
    tensors = next(directory.glob("node-*.safetensors"))
    data = tensors.read_bytes()
    if how == "flipped byte":
        tensors.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif how == "truncated tensors":
        tensors.write_bytes(data[: len(data) // 2])
    elif how == "missing tensors":
        tensors.unlink()
    elif how == "junk manifest":
        (directory / "node.json").write_bytes(b"\x00junk{")
    elif how == "truncated manifest":
        text = (directory / "node.json").read_bytes()
        (directory / "node.json").write_bytes(text[: len(text) // 2])


@pytest.mark.parametrize("how", ["flipped byte", "truncated tensors", "missing tensors", "junk manifest",
                                 "truncated manifest"])
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path: Path, how: str) -> None:
    store = CheckpointStore(tmp_path)
    store.save(state())
    damage(tmp_path, how)
    with pytest.raises(CheckpointError, match="is unreadable \\(damaged, or not a checkpoint\\)") as info:
        store.load()
    assert "\n" not in str(info.value) and "node.json" in str(info.value)
    store.close()


def test_an_unknown_format_and_a_pickle_that_runs_code_are_refused(tmp_path: Path) -> None:
    (tmp_path / "node.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(CheckpointError, match="unknown format"):
        read_checkpoint(tmp_path)
    legacy = tmp_path / "old" / "node.pt"
    legacy.parent.mkdir()
    torch.save({"format": 2, "thing": Path("x")}, legacy)  # an object torch must unpickle to build
    with pytest.raises(CheckpointError, match="holds more than tensors and plain values") as info:
        read_checkpoint(legacy.parent)
    assert "\n" not in str(info.value)


def test_a_replica_resumed_from_a_checkpoint_continues_bit_exactly(tmp_path: Path) -> None:
    """θ and the inner AdamW state through the store, then more steps: equal to never stopping."""
    settings = ReplicaSettings(model="tiny", seed=0, data=None, seq_len=32, batch_size=4, eval_batches=1,
                               inner_lr=1e-3, warmup_steps=2, weight_decay=0.1, grad_clip=1.0, total_steps=20,
                               precision="fp32", parallel="none", devices=("cpu",), threads=1)
    phi = [p.detach().clone() for p in build_model("tiny", 0).parameters()]
    straight, stopped, resumed = (make_replica(settings) for _ in range(3))
    try:
        for replica in (straight, stopped):
            replica.load(phi)
            for position in range(3):
                replica.train_step(7, position)
        store = CheckpointStore(tmp_path)
        store.save({"theta": stopped.theta(), "inner": stopped.inner_state()})
        saved = store.load()
        assert saved is not None
        resumed.load(saved["theta"])
        resumed.load_inner_state(saved["inner"])
        for position in range(3, 6):
            assert straight.train_step(7, position) == resumed.train_step(7, position)
        assert all(torch.equal(a, b) for a, b in zip(straight.theta() or [], resumed.theta() or [], strict=True))
        store.close()
    finally:
        for replica in (straight, stopped, resumed):
            replica.close()
