"""Every pseudo-gradient applied exactly once under eager, through the real round engine (#13).

With outer momentum 0 and outer lr 1, φ at the end is φ_0 minus the sum of every step a node
applied. If each node applied each round's group mean exactly once — whatever it applied early
as a stand-in, whenever an exchange landed, and for a node that joined mid-run whatever its
server had applied of its own — all nodes end with the same φ, up to float summation order. A
joiner that inherited its server's own pseudo-gradient at full weight would end one Δ away.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.conftest import NodeFactory

pytestmark = pytest.mark.integration

EXACT = ["--sync", "eager", "--outer-momentum", "0", "--outer-lr", "1.0", "--inner-steps", "30",
         "--max-outer-steps", "14", "--round-timeout", "60"]


def final_phi(tmp_path: Path, name: str) -> torch.Tensor:
    state = torch.load(tmp_path / name / "itest" / "node.pt", weights_only=True)
    return torch.cat([p.reshape(-1) for p in state["outer_params"]])


def test_every_mean_once_also_for_a_joiner(spawn: NodeFactory, tmp_path: Path) -> None:
    a = spawn("a", *EXACT, "--min-peers", "2")
    b = spawn("b", *EXACT, "--min-peers", "2", peer=a)
    a.wait_for_round(1, timeout=180)
    c = spawn("c", *EXACT, peer=a)  # joins mid-run: downloads φ from a or b, which hold their own Δ early
    for node in (a, b, c):
        assert node.wait_exit(timeout=240) == 0, node.log_text()[-3000:]
        assert "settled round=14" in node.log_text(), node.log_text()[-3000:]
    joined = c.joined_round or 0
    assert 2 <= joined <= 12, c.log_text()[-2000:]
    for node in (a, b):
        groups = [node.rounds[r].group_size for r in range(2, 15)]
        assert min(groups) >= 2, f"{node.name} averaged alone: {groups}"  # a lone round would differ by design
    phis = {name: final_phi(tmp_path, name) for name in ("a", "b", "c")}
    step = (phis["a"] - final_phi_start()).abs().max()
    for name in ("b", "c"):
        apart = float((phis[name] - phis["a"]).abs().max())
        # float summation order only: far below one pseudo-gradient (what a missed or doubled Δ costs)
        assert apart < 1e-4 * float(step), f"{name} ended {apart:.3g} from a (steps moved φ by {float(step):.3g})"


def final_phi_start() -> torch.Tensor:
    from diloco_node.train.model import build_model
    return torch.cat([p.detach().reshape(-1) for p in build_model("tiny", 0).parameters()])


def test_every_mean_once_across_a_crash_and_resume(spawn: NodeFactory, tmp_path: Path) -> None:
    """`kill -9` under eager leaves a checkpoint whose φ holds our Δ of the last round in place of
    its mean; the resumed node takes the run's state instead, which holds that mean exactly once."""
    a = spawn("a", *EXACT, "--min-peers", "2")
    b = spawn("b", *EXACT, "--min-peers", "2", peer=a)
    b.wait_for_round(3, timeout=180)
    b.kill()
    b = spawn("b", *EXACT, peer=a)
    for node in (a, b):
        assert node.wait_exit(timeout=240) == 0, node.log_text()[-3000:]
    text = b.log_text()
    assert "resumed round=" in text and "synced state from peers" in text, text[-3000:]
    apart = float((final_phi(tmp_path, "b") - final_phi(tmp_path, "a")).abs().max())
    step = float((final_phi(tmp_path, "a") - final_phi_start()).abs().max())
    assert apart < 1e-4 * step, f"b ended {apart:.3g} from a (steps moved φ by {step:.3g})"
