"""What the token cap trades (#41 must-hold 3 against the attacker bounds; docs/architecture.md §3,
'Bound', and §13, 'Weights'): for a token cap of c × the group's median declaration
(outer/aggregate.py TOKEN_CAP_MULTIPLE, 1 today) and the norm clip at 1.25 × the median norm,

- the share of an honest mixed-speed group's work the cap removes (outer/aggregate.removed_share):
  speeds 4:2:1:1 and 2:1:1:1 spending their speed on batch (`--speed-spent batch`: every Δ covers
  H steps, so their norms are alike and only the cap removes weight), and
- the worst cos(mean, honest mean) one attacker reaches at group sizes M = 3, 4, 5 and 8 when it
  knows the honest mean, claims more tokens than anyone (counted at the cap: the fastest speed its
  records could show) and sends the longest vector the clip lets through in the direction that
  lowers the cosine most (`worst_case_cosine`; tests/unit/test_aggregate.py holds today's bounds
  with it: cos ≥ 0.5 at M = 3 and ≥ 0.8 at M = 8).

Arithmetic on synthetic Δs, no training: about a minute on one core.

Run: `.venv/bin/python benchmarks/cap_vs_attacker.py`. Results: benchmarks/results/cap_vs_attacker.{json,md}.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from diloco_node.outer import aggregate as aggregate_module
from diloco_node.outer.aggregate import WEIGHTINGS, Contribution, aggregate, removed_share
from harness.bench import RESULTS_DIR, machine_info, write_results

NAME = "cap_vs_attacker"
CAPS = (1.0, 1.25, 1.5, 2.0, 3.0)
GROUPS = (3, 4, 5, 8)
SPEEDS = ((4, 2, 1, 1), (2, 1, 1, 1))
BOUNDS = {3: 0.5, 8: 0.8}  # the attacker bounds the trust work set (#41 must-hold 3 restates them)
MIXED = (4, 1, 2, 1)  # honest speeds in turn: at M = 3 the attacker's cap is the 4x member's declaration


def worst_case_cosine(group_size: int, spread: float = 1.0, seeds: int = 5, dim: int = 4096,
                      weighting: str = "tokens", speeds: tuple[int, ...] = (1,)) -> float:
    """cos(mean, honest mean) under `clip` when one member of `group_size` is an attacker that knows
    the honest mean: it claims 1e30 tokens (counted at the cap) and sends the longest vector the clip
    lets through, in the direction that lowers the cosine most (searched over angles from −honest
    mean towards a perpendicular). Honest Δs are a common mean plus noise `spread` times as large
    per coordinate (spread 1: honest Δs at cosine ≈ 0.5 to one another), tokens 900 to 1100 times
    the honest members' `speeds` in turn (a mixed-speed group spending its speed on batch: the
    fastest honest declaration raises the median the attacker is capped at)."""
    worst = 1.0
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        common = torch.randn(dim, generator=generator)
        honest = [Contribution(f"h{i}", speeds[i % len(speeds)] * float(900 + torch.randint(0, 201, (1,),
                                                                                          generator=generator)),
                               common + spread * torch.randn(dim, generator=generator))
                  for i in range(group_size - 1)]
        honest_mean = aggregate(honest, weighting=weighting).mean
        away = -honest_mean / honest_mean.norm()
        side = torch.randn(dim, generator=generator)
        side -= side.dot(away) * away
        side /= side.norm()
        for degrees in range(0, 91, 5):
            angle = math.radians(degrees)
            direction = math.cos(angle) * away + math.sin(angle) * side
            attacked = aggregate([*honest, Contribution("x", 1e30, 1e6 * direction)], weighting=weighting)
            assert "x" in attacked.clipped  # it reached the clip and the cap: the most it can pull
            cosine = float(torch.nn.functional.cosine_similarity(attacked.mean, honest_mean, dim=0))
            worst = min(worst, cosine)
    return worst


@contextmanager
def token_cap_multiple(multiple: float) -> Iterator[None]:
    """outer/aggregate.py's cap at `multiple` × the median for the measurement's duration."""
    before = aggregate_module.TOKEN_CAP_MULTIPLE
    aggregate_module.TOKEN_CAP_MULTIPLE = multiple
    try:
        yield
    finally:
        aggregate_module.TOKEN_CAP_MULTIPLE = before


def measure() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for cap in CAPS:
        with token_cap_multiple(cap):
            removed = {"/".join(map(str, s)): removed_share([float(v) for v in s], [1.0] * len(s)) for s in SPEEDS}
            cosines = {m: worst_case_cosine(m) for m in GROUPS}
        rows.append({"cap": cap, "removed": removed, "cosine": cosines})
    return rows


def measure_weightings() -> list[dict[str, object]]:
    """At today's cap: each --weighting's removed share (it is taken against that weighting's own
    shares) and its worst cosine, with honest members of equal speed and of speeds 4, 1, 2, 1, ..."""
    rows: list[dict[str, object]] = []
    for weighting in WEIGHTINGS:
        removed = {"/".join(map(str, s)): removed_share([float(v) for v in s], [1.0] * len(s), weighting=weighting)
                   for s in SPEEDS}
        cosines = {f"{m}{' mixed' if mixed else ''}": worst_case_cosine(m, weighting=weighting,
                                                                         speeds=MIXED if mixed else (1,))
                   for m in GROUPS for mixed in (False, True)}
        rows.append({"weighting": weighting, "removed": removed, "cosine": cosines})
    return rows


def table(rows: list[dict[str, object]]) -> str:
    speeds = ["/".join(map(str, s)) for s in SPEEDS]
    head = ["cap (× median)", *(f"removed, {s} on batch" for s in speeds),
            *(f"worst cos, M = {m}" + (f" (bound {BOUNDS[m]})" if m in BOUNDS else "") for m in GROUPS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        removed, cosines = row["removed"], row["cosine"]
        assert isinstance(removed, dict) and isinstance(cosines, dict)
        cells = [f"{row['cap']:g}", *(f"{100 * removed[s]:.1f} %" for s in speeds),
                 *(cosine_cell(cosines[m], m) for m in GROUPS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cosine_cell(cosine: float, group_size: int) -> str:
    """A worst cosine, marked ✗ below the bound of its group size (when one is set)."""
    return f"{cosine:.3f}" + (" ✗" if cosine < BOUNDS.get(group_size, -math.inf) else "")


def weighting_table(rows: list[dict[str, object]]) -> str:
    speeds = ["/".join(map(str, s)) for s in SPEEDS]
    groups = [f"{m}{' mixed' if mixed else ''}" for m in GROUPS for mixed in (False, True)]
    head = ["weighting", *(f"removed, {s} on batch" for s in speeds),
            *(f"worst cos, M = {g.replace(' mixed', ', honest speeds ' + '/'.join(map(str, MIXED)))}" for g in groups)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        removed, cosines = row["removed"], row["cosine"]
        assert isinstance(removed, dict) and isinstance(cosines, dict)
        cells = [str(row["weighting"]), *(f"{100 * removed[s]:.1f} %" for s in speeds),
                 *(cosine_cell(cosines[g], int(g.split()[0])) for g in groups)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    logging.disable(logging.WARNING)  # every attacked mean is capped and clipped: one log line each
    rows, weightings = measure(), measure_weightings()
    text = (f"# The token cap against one attacker ({dt.date.today().isoformat()})\n\n"
            "Removed: the share of the group's declared work the cap takes (equal norms: the clip takes "
            "nothing). Worst cos: one attacker at the cap and the clip, knowing the honest mean "
            "(✗: below the bound).\n\n" + table(rows) + "\n\n"
            "## Each weighting at the cap of 1 × the median\n\n"
            "Removed is taken against the weighting's own shares (`--weighting`, docs/architecture.md §13). "
            f"Mixed: the honest members' speeds are {'/'.join(map(str, MIXED))} in turn (at M = 3 a 4x "
            "and a 1x member), their tokens scaled alike, so a fast honest declaration sets the median "
            "the attacker is capped at.\n\n" + weighting_table(weightings) + "\n")
    write_results(RESULTS_DIR, NAME, {"machine": machine_info(), "rows": rows, "weightings": weightings}, text)


if __name__ == "__main__":
    main()
