"""Progress of long waits (telemetry/progress.py): the line's rate and time left, one line per
interval of an injected clock, and a bar only on a terminal."""

from __future__ import annotations

import io
from pathlib import Path

from diloco_node.telemetry.progress import Bar, Progress, meter, terminal_bar, time_left


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_line_says_how_far_at_what_rate_and_how_long_is_left() -> None:
    clock, lines = Clock(), []
    progress = Progress("state download", total=48e6, clock=clock, emit=lines.append)
    clock.now += 10
    assert progress.line(12.5e6, clock.now) == "state download: 12.5/48.0 MB at 1.2 MB/s, ~28 s left"
    # no total: no time left; a count where asked
    tokens = Progress("tokenize", unit="M tokens", count_unit="documents", clock=clock)
    clock.now += 4
    assert tokens.line(6e6, clock.now, count=12345) == "tokenize: 6.0 M tokens at 1.5 M tokens/s, 12,345 documents"
    assert (time_left(0.2), time_left(90), time_left(600), time_left(3 * 3600)) == \
        ("~1 s left", "~90 s left", "~10 min left", "~3.0 h left")


def test_the_figures_a_status_reader_gets() -> None:
    clock = Clock()
    progress = Progress("state download", total=48e6, clock=clock, emit=lambda line: None)
    assert progress.figures() == {"done": 0.0, "total": 48e6, "per_second": 0.0, "seconds_left": None}
    clock.now += 10
    progress.update(12e6)
    assert progress.figures() == {"done": 12e6, "total": 48e6, "per_second": 1.2e6, "seconds_left": 30.0}
    assert Progress("tokenize", clock=clock).figures()["seconds_left"] is None  # no total, no time left


def test_a_line_each_tenth_of_a_known_total_and_none_in_a_short_wait() -> None:
    clock, lines = Clock(), []
    progress = Progress("state download", total=10e6, clock=clock, emit=lines.append)
    for _ in range(19):  # a chunk every 0.25 s for 4.75 s: a short wait stays silent
        clock.now += 0.25
        progress.update(progress.done + 0.25e6)
    assert lines == []
    for _ in range(21):  # to 10 s: the first line at 5 s (the tenths passed so far), then each tenth
        clock.now += 0.25
        progress.update(progress.done + 0.25e6)
    assert len(lines) == 6, lines  # 5.0 MB, 6, 7, 8, 9, 10: however many reports came
    assert lines[0].startswith("state download: 5.0/10.0 MB at 1.0 MB/s, ~5 s left"), lines
    assert lines[-1] == "state download: 10.0/10.0 MB at 1.0 MB/s", lines  # done: nothing left to say
    clock.now += 60
    progress.update(10e6)
    assert len(lines) == 6  # no tenth passed, however long


def test_without_a_total_one_line_per_interval_until_the_total_is_learnt() -> None:
    clock, lines = Clock(), []
    progress = Progress("tokenize", unit="documents", scale=1, count_unit="tokens", interval=5.0, clock=clock,
                        emit=lines.append)
    for _ in range(40):  # a document every 0.25 s for 10 s: one line at 5 s, one at 10 s
        clock.now += 0.25
        progress.add(1, 300)
    assert lines == ["tokenize: 20 documents at 4 documents/s, 6,000 tokens",
                     "tokenize: 40 documents at 4 documents/s, 12,000 tokens"], lines
    progress.expect(400)  # a dataset's rows, known once it is open: from now on each tenth not yet passed
    for _ in range(40):
        clock.now += 0.25
        progress.add(1, 300)
    assert lines[2:] == ["tokenize: 80/400 documents at 4 documents/s, ~80 s left, 24,000 tokens"], lines


def test_add_counts_pieces_and_items() -> None:
    clock, lines = Clock(), []
    progress = Progress("tokenize", unit="M tokens", count_unit="documents", clock=clock, emit=lines.append)
    for _ in range(1000):
        progress.add(2000)
    clock.now += 5
    progress.add(0, count=0)
    assert lines == ["tokenize: 2.0 M tokens at 0.4 M tokens/s, 1,000 documents"]


def test_a_bar_only_on_a_terminal_and_drawn_only_once_there_is_progress(tmp_path: Path) -> None:
    lines: list[str] = []
    assert isinstance(meter("tokenize", stream=io.StringIO(), emit=lines.append), Progress)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    # the state download draws a bar of its own beside the figures it reports (swarm/statesync.py)
    assert terminal_bar("state download", 10.0, stream=io.StringIO()) is None
    assert isinstance(terminal_bar("state download", 10.0, stream=terminal), Bar)
    bar = meter("tokenize", count_unit="documents", bar_unit="tok", stream=terminal)
    assert isinstance(bar, Bar)
    bar.close()
    assert terminal.getvalue() == ""  # refused before any work: the error line stands alone
    bar = meter("tokenize", count_unit="documents", bar_unit="tok", stream=terminal)
    bar.add(1500)
    bar.expect(6000)  # the total learnt after the first report: the bar gets it
    bar.add(1500)
    bar.close()
    drawn = terminal.getvalue()
    assert "3.00k/6.00k" in drawn and "2 documents" in drawn and "50%" in drawn, drawn
