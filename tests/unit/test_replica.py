"""The three layouts of a replica (replica/) hold and train the same θ in the canonical layout.

Multi-rank replicas start their local ranks as real processes over gloo, as a node does. A
process holds one node's process group at a time, so each layout runs its whole scenario in turn.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco_node.replica import ReplicaSettings, make_replica
from diloco_node.replica.pipeline import stage_layers
from diloco_node.train.model import build_model

LAYOUTS = ("fsdp", "none", "pipeline")  # fsdp first: the others continue from its inner state


def settings(parallel: str) -> ReplicaSettings:
    ranks = 1 if parallel == "none" else 2
    return ReplicaSettings(model="tiny", seed=0, data=None, seq_len=32, batch_size=4, eval_batches=1, inner_lr=1e-3,
                           warmup_steps=2, weight_decay=0.1, grad_clip=1.0, total_steps=20, precision="fp32",
                           parallel=parallel, devices=("cpu",) * ranks, threads=1)


def phi() -> list[torch.Tensor]:
    return [p.detach().clone() for p in build_model("tiny", 0).parameters()]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    """Per layout: losses and θ after 3 steps from φ, eval loss of φ, peak memory, and θ after one
    more step continued from the fsdp replica's inner state (a checkpoint moved between layouts)."""
    results: dict[str, dict[str, Any]] = {}
    handover: dict[str, Any] = {}
    for layout in LAYOUTS:
        replica = make_replica(settings(layout))
        try:
            replica.load(phi())
            result = {"eval": replica.evaluate()}
            replica.load(phi())
            result["losses"] = [replica.train_step(7, position) for position in range(3)]
            result["theta"] = replica.theta()
            if layout == "fsdp":
                handover = {"theta": result["theta"], "state": replica.inner_state()}
            replica.load_inner_state(handover["state"])
            replica.load(handover["theta"])
            replica.train_step(7, 3)
            result["continued"] = replica.theta()
            result["memory"] = replica.peak_memory()
            results[layout] = result
        finally:
            replica.close()
    results["fsdp"]["state"] = handover["state"]
    return results


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal to float summation order. AdamW's first steps move a weight by about lr (1e-3) whatever its
    gradient's size, so where a gradient is near zero its summation order shows at ~1e-6: the bound is
    0.5 % of one step (with 2e-6 one weight in 65536 exceeded it on some batches)."""
    return all(torch.allclose(x, y, atol=5e-6, rtol=1e-5) for x, y in zip(a, b, strict=True))


def test_every_layout_trains_the_same_theta(runs: dict[str, dict[str, Any]]) -> None:
    start, reference = phi(), runs["none"]["theta"]
    assert [t.shape for t in reference] == [p.shape for p in start]  # canonical: the tied weight once
    for layout in ("fsdp", "pipeline"):
        assert close(runs[layout]["theta"], reference), layout
        assert runs[layout]["losses"] == pytest.approx(runs["none"]["losses"], rel=1e-5)
    assert not close(reference, start)  # it did train


def test_evaluation_agrees(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["fsdp"]["eval"] == pytest.approx(runs["none"]["eval"], rel=1e-5)
    assert runs["pipeline"]["eval"] == pytest.approx(runs["none"]["eval"], rel=1e-5)


def test_inner_state_moves_between_layouts(runs: dict[str, dict[str, Any]]) -> None:
    """A checkpoint's inner state written by one layout continues identically under another."""
    state = runs["fsdp"]["state"]
    assert state["step"] == 3 and state["adam_step"] == 3
    assert len(state["moments"]) == len(runs["fsdp"]["theta"])
    assert close(runs["pipeline"]["continued"], runs["fsdp"]["continued"])
    assert close(runs["none"]["continued"], runs["fsdp"]["continued"])


def test_peak_memory_is_reported_per_rank(runs: dict[str, dict[str, Any]]) -> None:
    for layout in LAYOUTS:
        memory = runs[layout]["memory"]
        assert len(memory) == (1 if layout == "none" else 2)
        assert all(value > 10 * 2**20 for value in memory)


def test_stage_layers_are_contiguous_and_even() -> None:
    assert stage_layers(5, 2) == [range(0, 2), range(2, 5)]
    assert [len(r) for r in stage_layers(12, 4)] == [3, 3, 3, 3]
    assert sum(len(r) for r in stage_layers(7, 3)) == 7
