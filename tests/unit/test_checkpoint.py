"""Checkpoints (daemon/checkpoint.py): tensors in safetensors, the rest in a JSON manifest written last;
bit-exact round trips, a resumed replica continuing exactly, damaged files refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from diloco_node.daemon.checkpoint import CheckpointError, CheckpointStore, read_checkpoint
from diloco_node.replica import ReplicaSettings, make_replica
from diloco_node.telemetry.progress import Progress
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


def test_reading_a_checkpoint_reports_the_bytes_of_its_check(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save({**state(), "outer_params": [torch.zeros(3 << 20)]})  # 12 MiB: three of check's chunks
    store.close()
    progress = Progress("export", emit=lambda line: None)
    read_checkpoint(tmp_path, progress)  # export's progress: the tensors file's size, then each chunk
    size = next(tmp_path.glob("node-*.safetensors")).stat().st_size
    assert progress.total == progress.done == size > 12 << 20


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


# --- a checkpoint confined to its directory, and read with one line on any damage -----------------


def node_state() -> dict[str, Any]:
    """What Node.save_checkpoint writes, for a φ of shapes (2, 3) and (6,)."""
    return {**{k: v for k, v in state().items() if k not in ("by_number", "scalars")},
            "export": {"model": "tiny", "config": "", "tokenizer": ""}}


def edit_manifest(directory: Path, edit: Any) -> None:
    manifest = json.loads((directory / "node.json").read_text())
    edit(manifest)
    (directory / "node.json").write_text(json.dumps(manifest))


def resume_from(directory: Path) -> None:
    """startup.resume against a φ of node_state()'s shapes: the node's own path through the checks."""
    from types import SimpleNamespace

    from diloco_node.daemon.startup import resume

    phi = [torch.zeros(2, 3), torch.zeros(6)]
    outer = SimpleNamespace(phi=phi, round=0, install=lambda round_, params, momentum: [
        p.copy_(v) for p, v in zip(phi, params, strict=True)])
    replica = SimpleNamespace(load_inner_state=lambda inner: None)
    codec = SimpleNamespace(load_state_dict=lambda d: None)
    drift = SimpleNamespace(restore=lambda saved, phi: True)
    store = CheckpointStore(directory)
    try:
        resume(store, "abc", outer, replica, [codec], drift)  # type: ignore[arg-type]
    finally:
        store.close()


def test_a_node_checkpoint_resumes_through_the_checks(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(node_state())
    store.close()
    resume_from(tmp_path)  # nothing refused


@pytest.mark.parametrize("key", ["fingerprint", "round", "outer_params", "momentum", "codec", "data_position",
                                 "stream_seed", "inner"])
def test_a_manifest_missing_a_key_is_refused_in_one_line_on_resume(tmp_path: Path, key: str) -> None:
    store = CheckpointStore(tmp_path)
    store.save(node_state())
    store.close()
    edit_manifest(tmp_path, lambda manifest: manifest["state"].pop(key))
    with pytest.raises(CheckpointError, match=f"is damaged: it lacks '{key}'") as info:
        resume_from(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("key, value", [("round", "7"), ("round", -1), ("outer_params", 5), ("inner", {"step": 1}),
                                        ("outstanding", [{"round": 1, "what": 2}]), ("data_position", True)])
def test_a_mistyped_key_is_refused_in_one_line_on_resume(tmp_path: Path, key: str, value: Any) -> None:
    store = CheckpointStore(tmp_path)
    store.save(node_state())
    store.close()
    edit_manifest(tmp_path, lambda manifest: manifest["state"].__setitem__(key, value))
    with pytest.raises(CheckpointError, match=f"its '{key}' is not what a checkpoint holds") as info:
        resume_from(tmp_path)
    assert "\n" not in str(info.value)


def test_tensors_of_other_shapes_are_refused_in_one_line_on_resume(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save({**node_state(), "outer_params": [torch.zeros(3, 2), torch.zeros(6)]})
    store.close()
    with pytest.raises(CheckpointError, match="does not fit this model") as info:
        resume_from(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.timeout(20)  # before the fix, /dev/zero was hashed for ever
@pytest.mark.parametrize("name", ["/dev/zero", "../elsewhere/node-0123456789abcdef.safetensors", "..", "",
                                  "node.json", 5, None])
def test_a_tensors_file_outside_the_directory_is_refused(tmp_path: Path, name: Any) -> None:
    run = tmp_path / "run"
    store = CheckpointStore(run)
    store.save(state())
    store.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "node-0123456789abcdef.safetensors").write_bytes(next(run.glob("node-*")).read_bytes())
    edit_manifest(run, lambda manifest: manifest.__setitem__("tensors", name))
    with pytest.raises(CheckpointError, match="names a tensors file outside its directory") as info:
        read_checkpoint(run)
    assert "\n" not in str(info.value)


@pytest.mark.timeout(20)
def test_a_link_a_fifo_or_a_device_in_a_checkpoint_is_refused_and_does_not_hang(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(state())
    store.close()
    tensors = next(tmp_path.glob("node-*.safetensors"))
    tensors.unlink()
    tensors.symlink_to("/dev/zero")  # a name of our making, but a link out of the directory
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_checkpoint(tmp_path)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    import os

    os.mkfifo(fifo / "node.json")  # a manifest that would block its reader
    with pytest.raises(CheckpointError, match="is unreadable") as info:
        read_checkpoint(fifo)
    assert "\n" not in str(info.value)


def export_cli(*args: str) -> tuple[int, str]:
    """`diloco-node export` through the CLI's own `main` in this process: (exit code, stderr, and
    any exception the CLI let escape, which would be a traceback for a user)."""
    from click.testing import CliRunner

    from diloco_node.cli import main

    done = CliRunner().invoke(main, ["export", *args])
    crashed = "" if done.exception is None or isinstance(done.exception, SystemExit) else \
        "Traceback " + repr(done.exception)
    return done.exit_code, done.stderr + crashed


@pytest.mark.parametrize("edit", ["no outer_params", "no model", "export not a dict of text", "absolute tensors"])
def test_export_of_a_damaged_checkpoint_ends_in_one_line(tmp_path: Path, edit: str) -> None:
    run = tmp_path / "ckpt" / "r"
    store = CheckpointStore(run)
    store.save(node_state())
    store.close()

    def damage_manifest(manifest: dict[str, Any]) -> None:
        if edit == "no outer_params":
            manifest["state"].pop("outer_params")
        elif edit == "no model":
            manifest["state"]["export"].pop("model")
        elif edit == "export not a dict of text":
            manifest["state"]["export"]["config"] = [1]
        else:
            manifest["tensors"] = "/dev/zero"
    edit_manifest(run, damage_manifest)
    code, stderr = export_cli("--checkpoint-dir", str(tmp_path / "ckpt"), "--run-id", "r", str(tmp_path / "out"))
    assert code == 2, stderr
    assert stderr.startswith("diloco-node: error: checkpoint") and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_the_export_command_refuses_a_damaged_checkpoint_in_one_line(tmp_path: Path) -> None:
    """The real command in a subprocess, end to end: exit 2, one line on stderr."""
    import subprocess
    import sys

    run = tmp_path / "ckpt" / "r"
    store = CheckpointStore(run)
    store.save(node_state())
    store.close()
    edit_manifest(run, lambda manifest: manifest["state"].pop("outer_params"))
    done = subprocess.run([sys.executable, "-m", "diloco_node", "export", "--checkpoint-dir", str(tmp_path / "ckpt"),
                           "--run-id", "r", str(tmp_path / "out")], capture_output=True, text=True, timeout=110)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("diloco-node: error: checkpoint") and "lacks 'outer_params'" in done.stderr


def test_a_save_beside_a_fifo_in_the_manifests_place_does_not_hang(tmp_path: Path) -> None:
    """A save reads the current manifest to keep its tensors file: a FIFO there blocked that read for
    good (it is read as a load reads it, a regular file or nothing), and the save replaces it."""
    import os
    import threading

    os.mkfifo(tmp_path / "node.json")
    store = CheckpointStore(tmp_path)
    saving = threading.Thread(target=lambda: (store.save(state()), store.close()), daemon=True)
    saving.start()
    saving.join(30)
    assert not saving.is_alive()
    assert read_checkpoint(tmp_path) is not None
