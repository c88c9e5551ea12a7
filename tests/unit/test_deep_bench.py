"""The pure parts of the deep headline (benchmarks/deep.py): its corpus order (harness/corpus.py), how it
reads a row's points against the target, and how it sizes a run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from harness.corpus import HELD_OUT_SHARE, held_out, order_by_file, write_stdlib_corpus
from harness.nodes import node_args
from tests.benchmark_scripts import load


@pytest.fixture(scope="module")
def deep() -> ModuleType:
    return load("deep")


# --- corpus ----------------------------------------------------------------------------------

def test_held_out_files_come_last_and_the_choice_does_not_depend_on_the_others() -> None:
    files = [f"pkg/mod{i}.py" for i in range(200)]
    ordered = order_by_file(list(reversed(files)), 8)
    flags = [held_out(f, 8) for f in ordered]
    assert sorted(ordered) == sorted(files)
    assert flags == sorted(flags)  # training files (False) first, then held-out (True)
    assert 10 <= sum(flags) <= 40  # about one in 8
    assert order_by_file(files[:100], 8) == [f for f in ordered if f in files[:100]]


def test_stdlib_corpus_caps_training_text_and_keeps_the_held_out_share(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    for i in range(120):
        (root / f"p{i % 5}").mkdir(parents=True, exist_ok=True)
        (root / f"p{i % 5}" / f"m{i}.py").write_text(f"x = {i}\n" * 50)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "other.py").write_text("never = 1\n")
    (root / "p0" / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
    out = tmp_path / "corpus.jsonl"
    counts = write_stdlib_corpus(out, max_bytes=20_000, root=root)
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    paths = [d["path"] for d in docs]
    assert not any("site-packages" in p or "latin" in p for p in paths)
    assert counts["train_bytes"] <= 20_000
    assert counts["held_out_files"] >= 1
    kinds = [held_out(p, 8) for p in paths]
    assert kinds == sorted(kinds)
    # held-out files stop once they hold the share, one file's worth past it at most
    total = counts["train_bytes"] + counts["held_out_bytes"]
    assert HELD_OUT_SHARE * total <= counts["held_out_bytes"] <= HELD_OUT_SHARE * total + 400


def test_node_args_leave_inner_steps_out_for_rounds_by_time() -> None:
    assert "--inner-steps" not in node_args(0, 3, "r", "ck", ["--round-seconds", "5"])
    assert node_args(7, 3, "r", "ck")[node_args(7, 3, "r", "ck").index("--inner-steps") + 1] == "7"


# --- reading the rows ------------------------------------------------------------------------

def point(seconds: float, loss: float, averaged: int, tokens: float = 100.0, bytes_: int = 1000) -> dict[str, Any]:
    return {"seconds": seconds, "eval_loss": loss, "averaged": averaged, "tokens_per_node": tokens, "bytes": bytes_}


def test_reach_needs_an_average_in_a_node_row_and_takes_ratios(deep: ModuleType) -> None:
    ddp = {"kind": "ddp", "points": [point(100, 5.0, 10, 400, 10**9), point(1000, 4.0, 100, 4000, 10**10)]}
    alone = {"kind": "alone", "points": [point(50, 4.5, 0, 4000, 0), point(90, 3.9, 0, 8000, 0)]}
    row = {"kind": "candidate", "points": [point(10, 3.5, 0), point(20, 3.9, 1, 2000, 10**6), point(30, 3.0, 2)]}
    deep.reach(ddp, 4.0, None, None)
    deep.reach(ddp, 4.0, ddp, None)
    deep.reach(alone, 4.0, ddp, None)
    deep.reach(row, 4.0, ddp, alone)
    hit = row["reached"]
    assert hit["seconds"] == 20  # the point at 10 s holds no average
    assert hit["time_ratio"] == pytest.approx(50.0)
    assert hit["bytes_ratio"] == pytest.approx(10_000.0)
    assert hit["alone_ratio"] == pytest.approx(4.0)
    assert deep.score(row) == pytest.approx(min(50 / 10, 10_000 / 3000, 4.0 / 2.5))
    assert row["best_eval_loss"] == 3.0


def test_judge_leaves_alone_without_ratios_against_ddp_and_marks_one_best(deep: ModuleType) -> None:
    ddp = {"kind": "ddp", "points": [point(1000, 4.0, 100, 4000, 10**10)]}
    alone = {"kind": "alone", "points": [point(90, 3.9, 0, 8000, 0)]}
    slow = {"kind": "candidate", "points": [point(500, 3.9, 9, 4000, 10**6)]}
    fast = {"kind": "candidate", "points": [point(50, 3.9, 9, 2000, 10**6)], "best": True}
    rows = [ddp, alone, slow, fast]
    alone["points"][0]["time_ratio"] = 11.1  # as a run before this rule wrote it: judged afresh
    deep.judge(rows, 4.0)
    assert alone["reached"] is not None and not {"time_ratio", "bytes_ratio"} & set(alone["reached"])
    assert "best" not in slow and fast["best"] is True
    fast["points"][0]["seconds"] = 5000  # judged again (--report-only): the other is now the best
    deep.judge(rows, 4.0)
    assert slow["best"] is True and "best" not in fast


def test_reproduce_names_the_flags_a_run_changed(deep: ModuleType) -> None:
    args = deep.json_args(deep.parse_args(["--steps", "300", "--candidates",
                                           "30:--compression int4;60:--compression int4"]))  # as in the json
    assert deep.reproduce(args) == ("benchmarks/deep.py --steps 300 "
                                    "--candidates '30:--compression int4;60:--compression int4'")
    assert deep.reproduce({**args, "quick": True}) == "benchmarks/deep.py --quick"


def test_rows_added_to_a_run_are_judged_with_its_own_and_noted(deep: ModuleType, tmp_path: Path) -> None:
    ddp = {"kind": "ddp", "points": [point(1000, 4.0, 100, 4000, 10**10)]}
    alone = {"kind": "alone", "points": [point(90, 3.9, 0, 8000, 0)]}
    int4 = {"kind": "candidate", "method": "int4", "points": [point(500, 3.9, 9, 4000, 10**8)]}
    base = {"run": {"rows": [ddp, alone, int4], "target_eval_loss": 4.0}, "args": {}}
    deep.judge(base["run"]["rows"], 4.0)
    sign = {"kind": "candidate", "method": "sign", "points": [point(400, 3.9, 9, 4000, 10**7)]}
    args = deep.parse_args(["--rows", "candidates", "--add-to", str(tmp_path / "deep.json"),
                            "--candidates", "30:--compression sign"])
    merged = deep.add_rows(base, {"rows": [sign], "raw_tcp_mbit": 9.6, "seconds": 600.0}, args)
    assert [r["method"] for r in merged["run"]["rows"] if r.get("best")] == ["sign"]  # fewer bytes: the best now
    assert sign["reached"]["time_ratio"] == pytest.approx(2.5)  # against the run's own DDP
    added = merged["added"][0]
    assert added["rows"] == ["sign"] and "--add-to" in added["reproduce"] and "--rows candidates" in added["reproduce"]
    with pytest.raises(SystemExit):
        deep.parse_args(["--rows", "ddp,candidates", "--add-to", "deep.json"])


def test_reach_against_an_alone_that_never_got_there_is_a_lower_bound(deep: ModuleType) -> None:
    alone = {"kind": "alone", "points": [point(50, 4.5, 0, 4000, 0)]}
    row = {"kind": "noloco", "points": [point(20, 3.9, 1, 1000)]}
    deep.reach(alone, 4.0, None, None)
    deep.reach(row, 4.0, None, alone)
    assert alone["reached"] is None
    assert row["reached"]["alone_ratio_at_least"] == pytest.approx(4.0)
    assert "alone_ratio" not in row["reached"]


def test_a_row_that_never_reaches_scores_lowest(deep: ModuleType) -> None:
    row = {"kind": "candidate", "points": [point(20, 4.5, 3)]}
    deep.reach(row, 4.0, None, None)
    assert row["reached"] is None and deep.score(row) == -math.inf


def test_nodes_stop_once_all_are_at_the_target_after_an_average(deep: ModuleType) -> None:
    def nodes(*losses_per_node: dict[int, float]) -> list[Any]:
        return [SimpleNamespace(rounds={r: SimpleNamespace(eval_loss=loss) for r, loss in losses.items()})
                for losses in losses_per_node]

    assert not deep.reached_in(nodes({1: 3.0}, {1: 3.0}), 4.0)  # round 1: no average yet under eager
    assert not deep.reached_in(nodes({1: 5.0, 2: 3.0}, {1: 5.0, 2: 4.5}), 4.0)
    assert not deep.reached_in(nodes({2: 3.0}, {1: 3.0}), 4.0)  # no round both logged
    assert deep.reached_in(nodes({1: 5.0, 2: 3.0, 3: 3.5}, {1: 5.0, 2: 4.5, 3: 3.9}), 4.0)


def test_labelled_candidate_is_eager_unless_told(deep: ModuleType) -> None:
    label, h, options = deep.labelled_candidate("50:--compression int4 --block-size 256")
    assert (h, options[:2]) == (50, ["--sync", "eager"])
    assert label == "DiLoCo eager int4 (block size 256) H=50"
    assert deep.labelled_candidate("30:--sync blocking")[2] == ["--sync", "blocking"]


# --- sizing a run ----------------------------------------------------------------------------

def test_rows_selector_and_estimate(deep: ModuleType) -> None:
    args = deep.parse_args(["--rows", "alone,blocking", "--target", "4.2", "--steps", "100"])
    assert args.rows == ["alone", "blocking"]
    estimated = deep.estimate(args, 0.5, 1_000_000, 2)
    assert set(estimated) == {"alone", "blocking"}
    assert estimated["alone"] == pytest.approx(5.0 * 100 * 0.5 + 15)
    # four nodes on two cores: a step takes twice as long as alone
    assert estimated["blocking"] == pytest.approx(deep.NODE_STARTUP + 2.0 * 100 * 1.0)


def test_mixed_round_seconds_fit_the_fastest_nodes_steps(deep: ModuleType) -> None:
    args = deep.parse_args(["--mixed-h", "40", "--steps", "100"])
    # speeds 4, 2, 1, 1 want 2 cores of 2: the fastest keeps its step time (and the pace's margin)
    assert deep.round_seconds(args, 0.5, 2) == pytest.approx(40 * 0.5 * deep.PACE_MARGIN)
    assert deep.round_seconds(args, 0.5, 1) == pytest.approx(40 * 1.0 * deep.PACE_MARGIN)
    # each node's pace: 1/speed of the fastest's
    paces = deep.mixed_paces(0.5, 2)
    assert [p / paces[0] for p in paces] == pytest.approx([deep.SPEEDS[0] / s for s in deep.SPEEDS])
    assert deep.mixed_rounds(args) == 5
    assert deep.round_seconds(deep.parse_args(["--round-seconds", "7"]), 0.5, 2) == 7.0


@pytest.mark.parametrize(("argv", "says"), [(["--rows", "ddp,bogus"], "unknown rows bogus"),
                                            (["--rows", "alone"], "give the target loss (--target)")])
def test_bad_rows_are_refused(deep: ModuleType, argv: list[str], says: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        deep.parse_args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


# --- DDP ranks for any world (harness/ddp.py) ------------------------------------------------

def test_ddp_rank_command_keeps_the_pairs_form_and_carries_the_rest() -> None:
    from harness.ddp import worker_command

    pair = worker_command(0, "10.0.0.1", 29500, 30, 5, 2, None, "eth0")
    assert pair[1:] == ["-m", "harness.ddp", "0", "10.0.0.1", "29500", "30", "5", "--iface", "eth0"]
    alone = worker_command(0, "127.0.0.1", 1234, 8, 2, 1, {"model": "llama-2m"}, "lo", 3.5)
    assert alone[alone.index("--world") + 1] == "1"
    assert json.loads(alone[alone.index("--config") + 1]) == {"model": "llama-2m"}
    assert float(alone[alone.index("--stop-below") + 1]) == 3.5


def test_a_ddp_rank_stops_at_a_target_only_alone() -> None:
    from harness.ddp import link_worker

    with pytest.raises(ValueError, match="world 1"):
        link_worker(0, "127.0.0.1", 1, 10, 2, world=2, stop_below=3.0)
