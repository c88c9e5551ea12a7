"""The dashboard in a real browser: Debian's chromium, headless, against a real two-node swarm.

Chromium runs the page's scripts (fetches, canvas drawing) for a few seconds of virtual time and
dumps the resulting DOM; the test reads what the page shows from stable ids and data attributes.
A screenshot goes to test-artifacts/dashboard.png for humans.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

from diloco_node.commands.launch import NodeProcess
from harness.nodes import FAST

pytestmark = pytest.mark.integration

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHARTS = ("bytes", "rate", "compression", "loss", "utilization", "round-time")
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                 "--disable-component-update", "--disable-sync", "--virtual-time-budget=8000"]


def find_chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary:
        return binary
    message = "chromium not found: install Debian's `chromium` package (apt-get install -y chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}; CI must run the browser test")
    pytest.skip(f"!!! BROWSER TEST SKIPPED: {message} !!!")


def run_chromium(binary: str, profile: Path, *args: str) -> str:
    result = subprocess.run([binary, *BROWSER_FLAGS, f"--user-data-dir={profile}", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"chromium failed ({result.returncode}):\n{result.stderr[-2000:]}"
    return result.stdout


class Page(HTMLParser):
    """The parts of the dumped DOM the test looks at: texts by id, canvases, swarm table rows."""

    def __init__(self, html: str):
        super().__init__()
        self.text_by_id: dict[str, str] = {}
        self.canvas_points: dict[str, int] = {}
        self.hidden: set[str] = set()  # ids of elements with the hidden attribute
        self.rows: list[dict[str, str]] = []  # per row: its data-peer-id as "row", and each cell's data-value by column
        self._open: list[str | None] = []  # ids of the open elements, to collect text by id
        self._in_tbody = False
        self._cell: str | None = None  # the data-col of the open table cell: its text goes in as "text:<col>"
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {key: value or "" for key, value in attrs}
        if "hidden" in a and a.get("id"):
            self.hidden.add(a["id"])
        if tag == "canvas" and "data-chart" in a:
            self.canvas_points[a["data-chart"]] = int(a.get("data-points") or 0)
        elif tag == "canvas" and "data-timeline" in a:
            self.canvas_points[f"timeline-{a['data-timeline']}"] = int(a.get("data-points") or 0)
        elif tag == "tbody":
            self._in_tbody = True
        elif tag == "tr" and self._in_tbody:
            self.rows.append({"row": a.get("data-peer-id", "")})
        elif tag == "td" and self._in_tbody and self.rows and "data-col" in a:
            self.rows[-1][a["data-col"]] = a.get("data-value", "")
            self._cell = a["data-col"]
        if tag not in {"canvas", "meta", "link", "br", "img", "input"}:
            self._open.append(a.get("id"))

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_tbody = False
        if tag == "td":
            self._cell = None
        if tag not in {"canvas", "meta", "link", "br", "img", "input"} and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._cell and self.rows:
            self.rows[-1][f"text:{self._cell}"] = self.rows[-1].get(f"text:{self._cell}", "") + data
        for element_id in filter(None, self._open):
            self.text_by_id[element_id] = self.text_by_id.get(element_id, "") + data


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    # two fragments and an upload cap: the fragment timeline and each peer's egress against its cap;
    # eager, so that each payload is served spread across the round (docs/architecture.md §15): 10
    # steps a round, so that even on a fast machine the pace (a fragment over 3/4 of the first inner
    # phase) stays under the cap
    options = [*FAST, "--run-id", "browser-test", "--min-peers", "2", "--inner-steps", "20", "--checkpoint-dir", "",
               "--fragments", "2", "--upload-limit", "50mbit", "--sync", "eager"]
    first = NodeProcess("a", options, tmp_path).start()
    nodes = [first]
    try:
        nodes.append(NodeProcess("b", [*options, "--peer", first.wait_for_address()], tmp_path).start())
        for node in nodes:
            node.wait_for_round(3)
        yield nodes
    finally:
        try:
            for node in nodes:
                node.stop("sigterm", within=30)  # fails the test if a node does not stop cleanly
        finally:
            for node in nodes:
                node.kill()  # only a node that failed to stop is still there


def peer_id(node: NodeProcess) -> str:
    assert node.address, f"{node.name} printed no peer address"
    match = re.search(r"/p2p/(\w+)$", node.address)
    assert match, node.address
    return match[1]


def live_rates(page: Page) -> dict[tuple[str, str], float]:
    """The swarm table's live rates as the page shows them: (peer id, column) → bytes/s."""
    return {(row["row"], column): float(row[column]) for row in page.rows for column in ("live_egress", "live_ingress")
            if row.get(column)}


def test_dashboard_shows_the_swarm(swarm: list[NodeProcess], tmp_path: Path) -> None:
    binary = find_chromium()
    url = swarm[0].status_url
    assert url, "the first node printed no status URL"
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "dashboard.png"
    run_chromium(binary, tmp_path / "profile-shot", f"--screenshot={screenshot}", "--window-size=1400,1700", f"{url}/")
    assert screenshot.stat().st_size > 0
    page = Page(run_chromium(binary, tmp_path / "profile-dom", "--dump-dom", f"{url}/"))

    assert page.text_by_id.get("run-id") == "browser-test"
    assert page.text_by_id.get("connection", "").startswith("live"), page.text_by_id.get("connection")
    ids = {peer_id(node) for node in swarm}
    assert {row["row"] for row in page.rows} == ids, page.rows
    assert len(page.rows) == 2
    for row in page.rows:
        assert float(row.get("bytes_sent") or 0) > 0, row
        assert float(row.get("bytes_received") or 0) > 0, row
        # what each node trained in its last round (docs/architecture.md §13)
        assert float(row.get("steps") or 0) >= 1 and float(row.get("tokens_per_second") or 0) > 0, row
        assert 0 < float(row.get("weight") or 0) <= 1, row  # its share of the mean it applied
        # its link against its own caps, as it published them (docs/architecture.md §14)
        assert row.get("text:egress", "").endswith(" / 50.00 Mbit/s"), row
        assert row.get("text:ingress", "").endswith("no cap"), row
    # live, per peer: our streams' rates to and from it against our caps, its caps below (and on our
    # own row, the total of our streams); they appear, and a later page shows them changed
    first_live = live_rates(page)
    for row in page.rows:
        assert " / 50.00 Mbit/s" in row.get("text:live_egress", ""), row  # against our upload cap
        assert "no cap" in row.get("text:live_ingress", ""), row
        if row["row"] != peer_id(swarm[0]):
            assert row.get("text:live_egress", "").endswith("its ↓ cap none"), row  # its download cap
            assert row.get("text:live_ingress", "").endswith("its ↑ cap 50.00 Mbit/s"), row
    changed = first_live
    for attempt in range(3):  # a later page: the 5-s window has moved on with the rounds
        changed = live_rates(Page(run_chromium(binary, tmp_path / f"profile-live-{attempt}", "--dump-dom", f"{url}/")))
        if changed != first_live:
            break
    assert changed != first_live, (first_live, changed)
    # the rates come from payloads served across the round at a pace under the cap, said once by each
    for node in swarm:
        # (a node whose first round was a fraction of a second, as a round alone at start-up can be, finds
        # that pace over the cap and says it serves at the cap instead: the same line, the other ending)
        spread = re.search(r"serving each payload across the round: [\d.]+ MB x 1 receiver\(s\) over [\d.]+s of a "
                           r"[\d.]+s round = [\d.]+ [kMG]?bit/s( \(under the upload cap 50 Mbit/s\)|, not under the "
                           r"upload cap 50 Mbit/s \(its streams' share\): served at the cap)", node.log_text())
        assert spread, node.log_text()[-3000:]
        assert node.log_text().count("serving each payload across the round") == 1
    assert any(value > 0 for value in [*first_live.values(), *changed.values()]), (first_live, changed)
    # the same rates in /metrics, one series per peer (the other node's id) beside the total
    metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    assert f'diloco_peer_stream_egress_bytes_per_second{{peer="{peer_id(swarm[1])}",run="browser-test"}}' in metrics
    assert 'diloco_stream_ingress_bytes_per_second{run="browser-test"}' in metrics
    # the fragment timeline: a mark for each round the page's history holds, in both fragments' rows
    assert page.canvas_points.get("timeline-fragments", 0) >= 2, page.canvas_points
    # throughput per node: the page collects a point per node and round while it is open
    assert page.canvas_points.get("throughput", 0) >= 1, page.canvas_points
    for chart in CHARTS:
        assert page.canvas_points.get(chart, 0) >= 2, f"chart {chart!r}: {page.canvas_points}"


def test_dashboard_shows_a_cut_off_node_as_isolated(swarm: list[NodeProcess], tmp_path: Path) -> None:
    """b freezes (as a cut link looks from a: silence); a pauses, and its page says so until b is back."""
    binary = find_chromium()
    a, b = swarm
    assert a.status_url
    page = Page(run_chromium(binary, tmp_path / "profile-connected", "--dump-dom", f"{a.status_url}/"))
    assert "isolated" in page.hidden
    b.signal(signal.SIGSTOP)
    try:
        a.wait_until(lambda: a.status()["isolated"] is True, 60, "a reporting itself isolated")
        page = Page(run_chromium(binary, tmp_path / "profile-isolated", "--dump-dom", f"{a.status_url}/"))
        assert "isolated" not in page.hidden
        assert page.text_by_id.get("isolated", "").startswith("isolated from the swarm since"), page.text_by_id
        ARTIFACTS.mkdir(exist_ok=True)
        run_chromium(binary, tmp_path / "profile-shot", f"--screenshot={ARTIFACTS / 'dashboard-isolated.png'}",
                     "--window-size=1400,1000", f"{a.status_url}/")
    finally:
        b.signal(signal.SIGCONT)
    a.wait_until(lambda: a.status()["isolated"] is False, 60, "a back in the swarm")


def test_dashboard_shows_a_state_download_in_progress(tmp_path: Path) -> None:
    """A joiner at --download-limit 2mbit takes ~15 s over the tiny model's state (φ and the
    momentum, 3.7 MB): its page says how far, at what rate and how long is left, and nothing once
    the state is in. The run's rounds are longer than that (400 steps), so the state it takes is
    the run's (a joiner of a run that moves on faster than it can download never catches up)."""
    binary = find_chromium()
    options = [*FAST, "--run-id", "browser-download", "--inner-steps", "400", "--checkpoint-dir", ""]
    server = NodeProcess("server", options, tmp_path).start()
    nodes = [server]

    def downloading() -> dict | None:
        try:
            return joiner.status()["state_download"] if joiner.status_url else None
        except OSError:  # the status server is not up yet
            return None

    try:
        server.wait_for_round(1)  # before, its state is the one a joiner makes itself: nothing to download
        joiner = NodeProcess("joiner", [*options, "--peer", server.wait_for_address(), "--download-limit", "2mbit"],
                             tmp_path).start()
        nodes.append(joiner)
        joiner.wait_until(lambda: (downloading() or {}).get("bytes", 0) > 0, 90, "the state download under way")
        status = downloading()
        assert status is not None and status["peer"] == peer_id(server) and status["total_bytes"] > status["bytes"]
        page = Page(run_chromium(binary, tmp_path / "profile-download", "--dump-dom", f"{joiner.status_url}/"))
        assert "state-download" not in page.hidden
        shown = page.text_by_id.get("state-download", "")
        assert re.fullmatch(r"downloading the run's state: [\d.]+ [kM]?B of [\d.]+ MB at [\d.]+ Mbit/s, .+ left",
                            shown), shown
        ARTIFACTS.mkdir(exist_ok=True)
        run_chromium(binary, tmp_path / "profile-shot", f"--screenshot={ARTIFACTS / 'dashboard-download.png'}",
                     "--window-size=1400,700", f"{joiner.status_url}/")
        joined = joiner.wait_joined(120)
        assert joined > 0 and downloading() is None, (joined, downloading())  # the run's state, not its own
        page = Page(run_chromium(binary, tmp_path / "profile-joined", "--dump-dom", f"{joiner.status_url}/"))
        assert "state-download" in page.hidden
    finally:
        try:
            for node in nodes:
                node.stop("sigterm", within=30)
        finally:
            for node in nodes:
                node.kill()
