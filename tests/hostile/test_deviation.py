"""How far a hostile contributor moves φ (#15): no further than the clip rule allows, and not
at all when its payload is rejected; honest nodes' memory stays that of the clean run.

Two honest nodes train the same run twice from the same identities, seeds and options: once alone
(the clean twin) and once with forger.py's "huge" peer in the groups from the first rounds on (a
pseudo-gradient ~1e6 times an honest one's norm, declaring 1e15 tokens, the most a node accepts).
Both stop after ROUNDS.

The bound, from outer/aggregate.py's "clip" and the outer step's linearity: in a round the forger
is in, its Δ counts at most NORM_CLIP_MULTIPLE × the reference norm ref_r (the group's median:
the larger honest norm) at its capped token share w_f, so it moves the group's mean by at most
w_f·(M+1)·ref_r from the honest members' mean; that mean and the clean twin's differ by at most
ref_r + ‖Δ̄_clean,r‖. A round without it differs by at most ‖Δ̄_hostile,r‖ + ‖Δ̄_clean,r‖. Nesterov
SGD is linear in its gradients: a change e_r of round r's gradient moves φ after round N by
outer_lr·(1 + μ + … + μ^(N−r+1))·e_r (that step adds (1 + μ)·e_r, each later one μ^(k+1)·e_r),
less than outer_lr·e_r/(1 − μ). The sum over the rounds from the forger's first is B, and
‖φ_hostile − φ_clean‖ must stay within it (plus the spread of two clean runs, which is zero: a
clean run repeats bit for bit, on CPU with --threads 1, given the same peer ids).

What is measured, not assumed: ref_r, the forger's norm and its token cap, from the honest node's
own log lines when it clips and caps; each round's mean Δ̄, from φ and the outer momentum in the
checkpoint each round leaves (Δ̄_r = m_r − μ·m_(r−1)).
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from diloco_node.commands.launch import NodeProcess
from diloco_node.daemon.checkpoint import read_checkpoint
from diloco_node.outer.aggregate import NORM_CLIP_MULTIPLE, TOKEN_CAP_MULTIPLE
from diloco_node.swarm.identity import create
from tests.hostile.test_forged_records import forging_process
from tests.integration.conftest import NodeFactory
from tests.integration.test_swarm import assert_same_digests

pytestmark = pytest.mark.integration

ROUNDS = 5
OUTER_LR, MOMENTUM = 0.7, 0.9  # DiLoCo's published step, named so that the bound uses what the nodes use
# codec none: forger.py's payloads are fp32 (a run of another codec drops them before any clip)
OPTIONS = ("--inner-steps", "5", "--max-outer-steps", str(ROUNDS), "--outer-lr", str(OUTER_LR),
           "--outer-momentum", str(MOMENTUM), "--compression", "none")
RUN_ID = "hostile"  # forger.py's
CLIPPED = re.compile(r"clipped contribution from peer=(\S+): norm (\S+) > (\S+)")
CAPPED = re.compile(r"capped the tokens of peer=(\S+) at (\S+)")
ROUND_LINE = re.compile(r"\bround=(\d+) loss=")
LOGGED = 1.005  # the log prints 3 significant digits: a logged norm may be this much below the true one


class Checkpoints:
    """φ and the outer momentum after each round, read from a node's checkpoint while it runs: each
    round's checkpoint stays in place until the next round's replaces it, seconds later."""

    def __init__(self, path: Path):
        self.path = path
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._seen: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"watch-{path.parent.parent.name}")
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            self.read()

    def read(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        if (stat.st_ino, stat.st_mtime_ns) == self._seen:
            return
        self._seen = stat.st_ino, stat.st_mtime_ns
        state = read_checkpoint(self.path)  # the manifest is replaced by rename: whole
        phi = torch.cat([p.flatten() for p in state["outer_params"]])
        momentum = torch.zeros_like(phi) if state["momentum"] is None else \
            torch.cat([m.flatten() for m in state["momentum"]])
        self.saved[int(state["round"])] = phi, momentum

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.read()  # the last one, written as the node left

    def mean_norms(self, rounds: range) -> dict[int, float]:
        """‖Δ̄_r‖, the group's mean pseudo-gradient of round r: torch's Nesterov keeps m_r = μ·m_(r−1) + Δ̄_r."""
        missing = [r for r in [rounds.start - 1, *rounds] if r not in self.saved and r > 0]
        assert not missing, f"no checkpoint read for rounds {missing} of {self.path}"
        before = {0: torch.zeros_like(self.saved[rounds.stop - 1][1]), **{r: m for r, (_, m) in self.saved.items()}}
        return {r: float((before[r] - MOMENTUM * before[r - 1]).norm()) for r in rounds}


@dataclass
class Clip:
    """What node a's aggregator logged of one round's hostile contribution."""

    norm: float  # the forger's Δ
    reference: float  # ref_r: the group's median norm
    token_cap: float


@dataclass
class Twin:
    nodes: list[NodeProcess]
    checkpoints: Checkpoints
    forged: list[str] = field(default_factory=list)  # the forger's `contributed ROUND GROUP_SIZE` lines

    def phi(self, node: NodeProcess) -> torch.Tensor:
        return torch.cat([p.flatten() for p in
                          read_checkpoint(node.workdir / node.name / RUN_ID)["outer_params"]])

    def clips(self) -> dict[int, Clip]:
        """Per round, what node a clipped and capped (logged before the round's own line)."""
        found, pending, cap = {}, None, None
        for line in self.nodes[0].log_text().splitlines():
            if match := CAPPED.search(line):
                cap = float(match[2])
            elif match := CLIPPED.search(line):
                pending = float(match[2]), float(match[3]) / NORM_CLIP_MULTIPLE
            elif match := ROUND_LINE.search(line):
                if pending is not None:
                    assert cap is not None, line
                    found[int(match[1])] = Clip(pending[0], pending[1] * LOGGED, cap)
                pending = cap = None
        return found


def twin_run(spawn: NodeFactory, label: str, keys: dict[str, Path], attack: str | None = None,
             extra: tuple[str, ...] = ()) -> Twin:
    """Nodes a and b to ROUNDS (with forger.py in mode `attack` from right after a is up), each with
    its checkpoints in `label`-a and `label`-b.

    With an attack they wait for three peers: the forger's record counts as one (an open run cannot
    tell it from an honest node's), so with two, a would train with the forger alone while b is
    still starting. --min-peers only gates the start: the runs' steps are alike."""
    options = (*OPTIONS, *extra, "--min-peers", "3" if attack else "2")
    a = spawn(f"{label}-a", *options, "--identity", str(keys["a"]), run_id=RUN_ID)
    twin = Twin([a], Checkpoints(a.workdir / a.name / RUN_ID / "node.json"))
    with (forging_process(a.wait_for_address(), attack) if attack else contextlib.nullcontext()) as forger:
        twin.nodes.append(spawn(f"{label}-b", *options, "--identity", str(keys["b"]), run_id=RUN_ID, peer=a))
        for node in twin.nodes:
            assert node.wait_exit(150) == 0, node.log_text()[-3000:]
    twin.checkpoints.stop()
    if forger is not None:
        assert forger.stdout is not None
        twin.forged = [line for line in forger.stdout.read().splitlines() if line.startswith("contributed ")]
    assert_same_digests(twin.nodes, range(1, ROUNDS + 1))
    assert torch.equal(twin.phi(twin.nodes[0]), twin.phi(twin.nodes[1]))
    return twin


MEMORY_SLACK = 64 << 20  # bytes of peak RSS an honest node may hold beyond its clean twin's


def peak_memory(twin: Twin) -> int:
    return max(int(log.peak_memory_bytes[0]) for node in twin.nodes for log in node.rounds.values())


@pytest.fixture
def clean_and_keys(spawn: NodeFactory, tmp_path: Path) -> tuple[Twin, dict[str, Path]]:
    keys = {name: tmp_path / f"{name}.key" for name in "ab"}
    for path in keys.values():
        create(path)  # the same peer ids, so the same data orders, in both runs
    return twin_run(spawn, "clean", keys), keys


def test_a_damaged_contribution_leaves_phi_exactly_as_in_the_clean_run(
        spawn: NodeFactory, clean_and_keys: tuple[Twin, dict[str, Path]]) -> None:
    """A payload that does not decode is rejected by both honest nodes: their mean is the clean
    twin's, bit for bit, however many rounds the forger was in."""
    clean, keys = clean_and_keys
    hostile = twin_run(spawn, "hostile", keys, attack="fuzz")
    in_group = [int(line.split()[1]) for line in hostile.forged if line.split()[2] == "3"]
    assert in_group, f"the forger never averaged\n{hostile.nodes[0].log_text()[-3000:]}"
    assert torch.equal(hostile.phi(hostile.nodes[0]), clean.phi(clean.nodes[0]))
    for r in range(1, ROUNDS + 1):
        assert hostile.nodes[0].rounds[r].digest == clean.nodes[0].rounds[r].digest, r
    assert peak_memory(hostile) <= peak_memory(clean) + MEMORY_SLACK
    print(f"forger rejected in rounds {in_group}: ‖φ_hostile − φ_clean‖ = 0; peak memory "
          f"{peak_memory(hostile) >> 20} MiB (clean {peak_memory(clean) >> 20} MiB)")


def test_a_huge_contributor_moves_phi_no_further_than_the_clip_bound(
        spawn: NodeFactory, clean_and_keys: tuple[Twin, dict[str, Path]]) -> None:
    clean, keys = clean_and_keys
    hostile = twin_run(spawn, "hostile", keys, attack="huge")

    clips = hostile.clips()
    in_group = [int(line.split()[1]) for line in hostile.forged if line.split()[2] == "3"]
    assert clips, f"the forger was never clipped; it averaged in {in_group}\n{hostile.nodes[0].log_text()[-3000:]}"
    assert len(clips) == len(in_group), (sorted(clips), in_group)
    first = min(clips)
    rounds = range(first, ROUNDS + 1)
    clean_norms = clean.checkpoints.mean_norms(rounds)
    hostile_norms = hostile.checkpoints.mean_norms(rounds)
    # until the forger's first round both runs take the same steps, bit for bit
    for r in range(1, first):
        assert hostile.nodes[0].rounds[r].digest == clean.nodes[0].rounds[r].digest, r

    bound = unclipped = 0.0
    for r in rounds:
        reach = OUTER_LR * sum(MOMENTUM ** j for j in range(ROUNDS - r + 2))  # outer_lr·(1 + μ + … + μ^(N−r+1))
        if (clip := clips.get(r)) is not None:
            # both honest nodes declare the same tokens (same H, batch, seq_len): the cap is TOKEN_CAP_MULTIPLE × theirs
            share = clip.token_cap / (clip.token_cap + 2 * clip.token_cap / TOKEN_CAP_MULTIPLE)
            change = share * (NORM_CLIP_MULTIPLE + 1) * clip.reference + clip.reference + clean_norms[r]
            unclipped += (reach * clip.norm) ** 2  # weight ~1, and its Δs are random: near orthogonal
        else:
            change = hostile_norms[r] + clean_norms[r]
        bound += reach * change
    unclipped = math.sqrt(unclipped)
    deviation = float((hostile.phi(hostile.nodes[0]) - clean.phi(clean.nodes[0])).norm())
    print(f"forger clipped in rounds {sorted(clips)}; ‖φ_hostile − φ_clean‖ = {deviation:.4g}, bound {bound:.4g} "
          f"({deviation / bound:.3f} of it); unclipped it would be ~{unclipped:.4g}; peak memory "
          f"{peak_memory(hostile) >> 20} MiB (clean {peak_memory(clean) >> 20} MiB)")
    assert deviation <= bound, (deviation, bound, clips, clean_norms, hostile_norms)
    assert peak_memory(hostile) <= peak_memory(clean) + MEMORY_SLACK
