"""Progress of long waits: a line at most every tenth of the total (every INTERVAL_SECONDS where
the total is unknown), or a tqdm bar on a terminal.

A joiner's state download of a large model over a slow link takes minutes, and `diloco-node
tokenize`, `tokenizer train` and `export` of large inputs as long: silent, they look hung
(docs/architecture.md §4). `Progress` says how far a wait has got, its rate and, when the total is
known, the time left, in a line such as `state download: 12.5/48.0 MB at 1.2 MB/s, ~30 s left`,
throttled so that a log stays readable; `meter` picks a tqdm bar instead where stderr is a
terminal. A leaf: it imports nothing of the package, so swarm/ and the CLI both may use it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import IO, Any, Protocol

logger = logging.getLogger(__name__)

INTERVAL_SECONDS = 5.0  # a wait shorter than this stays silent; without a total, the pace of its lines
STEP = 0.1  # with a total, a line each tenth of it: at most ten lines in a log, however long the wait


def time_left(seconds: float) -> str:
    """`seconds` as the rough time left a progress line ends on: `~30 s left`, `~4 min left`,
    `~1.5 h left` (a rate measured over seconds predicts no better than that)."""
    if seconds < 120:
        return f"~{max(1, round(seconds))} s left"
    if seconds < 7200:
        return f"~{round(seconds / 60)} min left"
    return f"~{seconds / 3600:.1f} h left"


class Meter(Protocol):
    """What a long wait reports to: the amount done so far (`update`) or an increment (`add`), and
    the total once the wait learns it (`expect`)."""

    total: float | None

    def expect(self, total: float) -> None: ...
    def update(self, done: float, count: int | None = None) -> None: ...
    def add(self, amount: float, count: int = 1) -> None: ...
    def close(self) -> None: ...


class Progress:
    """Throttled progress lines of one long wait (`label`), each handed to `emit` (by default logged
    at INFO): amount done in `unit` (`scale` units of the raw amount, MB of bytes by default; whole
    numbers at scale 1), of `total` when known, the mean rate since the start and, with a total, the
    time left; `count_unit` adds a count (`12,345 tokens`). With a total a line goes out as each
    tenth of it is passed, without one every `interval` seconds of `clock`; nothing before
    `interval` has passed (a short wait stays silent)."""

    def __init__(self, label: str, total: float | None = None, unit: str = "MB", scale: float = 1e6,
                 count_unit: str | None = None, interval: float = INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic, emit: Callable[[str], None] | None = None) -> None:
        self.label, self.total, self.unit, self.scale, self.count_unit = label, total, unit, scale, count_unit
        self.interval, self._clock = interval, clock
        self._emit = emit or (lambda line: logger.info("%s", line))
        self.started = self._last = clock()
        self.done, self.count = 0.0, 0
        self._tenths = 0  # tenths of the total already said

    def amount(self, raw: float) -> str:
        """`raw` in this wait's unit: whole numbers of a count (`1,200`), one decimal of a scaled one."""
        return f"{raw:,.0f}" if self.scale == 1 else f"{raw / self.scale:.1f}"

    def line(self, done: float, now: float, count: int | None = None) -> str:
        """The progress line for `done` (and `count`) at `now`; the mean rate since the start, so
        that one slow or fast read does not swing the time left."""
        elapsed = now - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        of = f"/{self.amount(self.total)}" if self.total else ""
        text = f"{self.label}: {self.amount(done)}{of} {self.unit} at {self.amount(rate)} {self.unit}/s"
        if self.total and rate > 0 and done < self.total:
            text += f", {time_left((self.total - done) / rate)}"
        if count is not None and self.count_unit:
            text += f", {count:,} {self.count_unit}"
        return text

    def figures(self) -> dict[str, float | None]:
        """Where the wait stands now, for a status reader: the amount `done` (raw units), its `total`,
        the mean rate since the start `per_second`, and `seconds_left` (None without a total or rate)."""
        elapsed = self._clock() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if self.total and rate > 0 else None
        return {"done": self.done, "total": self.total, "per_second": rate, "seconds_left": left}

    def expect(self, total: float) -> None:
        """The wait's total, learnt after it began (how many documents a dataset holds) or grown (the
        weights export writes after the checkpoint it read): the tenths count from it on."""
        self.total = total
        self._tenths = min(10, int(self.done / total / STEP)) if total else 0

    def update(self, done: float, count: int | None = None) -> None:
        """`done` so far; a line goes out when a new tenth of the total is passed (without a total:
        when `interval` has passed since the last line), and never within `interval` of the start."""
        self.done = done
        if count is not None:
            self.count = count
        now = self._clock()
        if now - self.started < self.interval:
            return
        if self.total:
            tenths = min(10, int(done / self.total / STEP))
            if tenths <= self._tenths:
                return
            self._tenths = tenths
        elif now - self._last < self.interval:
            return
        self._last = now
        self._emit(self.line(done, now, self.count))

    def add(self, amount: float, count: int = 1) -> None:
        """`amount` more done (and `count` more items): what a stream of pieces reports."""
        self.update(self.done + amount, self.count + count)

    def close(self) -> None:
        """Nothing to end: the caller says in its own line how the wait ended."""


class Bar:
    """tqdm's bar on a terminal, for the same reports as `Progress` (tqdm throttles its redraws).
    Drawn from the first report on: a command refused before any work prints its one error line
    alone (docs/architecture.md §10)."""

    def __init__(self, label: str, total: float | None, unit: str, count_unit: str | None, stream: IO[str]) -> None:
        from tqdm import tqdm  # ImportError where it is not installed: `meter` falls back to lines

        self.total: float | None = total
        self._make = lambda: tqdm(desc=label, total=self.total, unit=unit, unit_scale=True, unit_divisor=1000,
                                  file=stream, leave=True, dynamic_ncols=True)
        self._bar: Any = None
        self.count_unit, self.done, self.count = count_unit, 0.0, 0

    def expect(self, total: float) -> None:
        """The wait's total, learnt after it began."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, done: float, count: int | None = None) -> None:
        """`done` so far (and `count`)."""
        if self._bar is None:
            self._bar = self._make()
        if count is not None:
            self.count = count
            if self.count_unit:
                self._bar.postfix = f"{count:,} {self.count_unit}"  # drawn at tqdm's next redraw
        self._bar.update(done - self.done)
        self.done = done

    def add(self, amount: float, count: int = 1) -> None:
        """`amount` more done (and `count` more items)."""
        self.update(self.done + amount, self.count + count)

    def close(self) -> None:
        """Draws the bar's last state and moves to the next line (nothing when never drawn)."""
        if self._bar is not None:
            self._bar.close()


def terminal_bar(label: str, total: float | None = None, bar_unit: str = "B", count_unit: str | None = None,
                 stream: IO[str] | None = None) -> Bar | None:
    """A tqdm bar (`bar_unit`, raw amounts) where `stream` (stderr) is a terminal and tqdm is
    installed; None elsewhere (a log file, a pipe, a container), since a bar's carriage returns make
    one unreadable line of a log."""
    out = stream if stream is not None else sys.stderr
    if not out.isatty():
        return None
    try:
        return Bar(label, total, bar_unit, count_unit, out)
    except ImportError:
        return None


def meter(label: str, total: float | None = None, unit: str = "MB", scale: float = 1e6,
          count_unit: str | None = None, bar_unit: str = "B", stream: IO[str] | None = None,
          emit: Callable[[str], None] | None = None) -> Meter:
    """A bar on a terminal (`terminal_bar`), Progress's plain lines elsewhere."""
    return terminal_bar(label, total, bar_unit, count_unit, stream) or \
        Progress(label, total, unit, scale, count_unit, emit=emit)
