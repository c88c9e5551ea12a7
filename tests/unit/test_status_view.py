"""`diloco-node status`: the pure text view, and the command against bad URLs and a real server."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from click.testing import CliRunner

from diloco_node.cli import main
from diloco_node.commands import status_view
from diloco_node.telemetry.server import StatusServer
from tests.unit.test_server import filled_telemetry, peer_row

NOW = 1_700_000_100.0


def run_status(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command in a subprocess, end to end."""
    return subprocess.run([sys.executable, "-m", "diloco_node", "status", *args],
                          capture_output=True, text=True, timeout=60)


def status_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`diloco-node status` through the CLI's own `main` in this process: the bad-URL cases, which
    would each cost a subprocess its torch import (the CLI's option defaults read the codecs'); the
    real command runs in test_status_against_a_real_status_server."""
    done = CliRunner().invoke(main, ["status", *args])
    crashed = "" if done.exception is None or isinstance(done.exception, SystemExit) else \
        "Traceback " + repr(done.exception)  # an exception the CLI let escape: a traceback for a user
    return subprocess.CompletedProcess(["diloco-node", "status", *args], done.exit_code, done.stdout,
                                       done.stderr + crashed)


def test_human_units() -> None:
    assert status_view.human_bytes(0) == "0 B"
    assert status_view.human_bytes(1023) == "1023 B"
    assert status_view.human_bytes(1536) == "1.5 KiB"
    assert status_view.human_bytes(3 * 1024**3) == "3.0 GiB"
    assert status_view.human_bytes(None) == "-"
    assert status_view.human_bytes(float("nan")) == "-"
    assert status_view.human_bytes("12") == "-"
    assert status_view.mbit_per_s(8_000_000) == "8.00"
    assert status_view.percent(0.873) == "87.3%"
    assert status_view.percent(True) == "-"
    assert status_view.ago(NOW - 12.4, NOW) == "12s ago"
    assert status_view.ago(NOW + 5, NOW) == "0s ago"  # a peer's clock slightly ahead
    assert status_view.ago(None, NOW) == "-"


def test_short_peer_id_keeps_both_ends() -> None:
    short = status_view.short_peer_id("12D3KooWAbcdefghijklmnopqrstuvwxyz")
    assert short.startswith("12D3..") and short.endswith("vwxyz") and len(short) == status_view.PEER_ID_CHARS
    assert status_view.short_peer_id("QmShort") == "QmShort"
    assert status_view.short_peer_id(None) == "-"


def test_status_block_shows_every_field() -> None:
    text = status_view.format_status({
        "run_id": "run-a", "peer_id": "12D3KooWFull", "maddrs": ["/ip4/1.2.3.4/tcp/31337"], "outer_step": 7,
        "inner_step": 280, "loss": 3.21234, "eval_loss": 3.5, "bytes_sent": 5 * 1024**2,
        "bytes_received": 10 * 1024**2, "compression": "int8", "bytes_per_param": 1.03, "utilization": 0.95,
        "round_seconds": 12.34, "peers": 3, "group_size": 2, "label": "gpu-box"})
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in text.splitlines())
    assert lines["run"] == "run-a"
    assert lines["peer id"] == "12D3KooWFull"
    assert lines["loss"] == "3.2123 (eval 3.5000)"
    assert lines["sent"] == "5.0 MiB" and lines["received"] == "10.0 MiB"  # no wire figures: payload alone
    measured = status_view.format_status({"bytes_sent": 5 * 1024**2, "wire_bytes_sent": 6 * 1024**2})
    sent = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in measured.splitlines())["sent"]
    assert sent == "5.0 MiB payload, 6.0 MiB on the wire"
    assert "algorithm" not in lines  # DiLoCo: nothing more to say
    gossip = status_view.format_status({"algorithm": "noloco", "consensus_distance": 0.00123})
    assert gossip.splitlines()[-1].split(None, 1)[1] == "noloco (consensus distance 1.23e-03)"
    assert lines["compression"] == "int8 (1.030 B/param)"
    assert lines["utilization"] == "95.0%"
    assert lines["round time"] == "12.3s"
    assert lines["peers"] == "3 (last group 2)"
    assert "7 (inner step 280)" in text and "/ip4/1.2.3.4/tcp/31337" in text and "gpu-box" in text
    first_two = text.splitlines()[:2]
    values_column = {line.index(value) for line, value in zip(first_two, ["run-a", "12D3KooWFull"], strict=True)}
    assert len(values_column) == 1  # values start in one column


def test_status_block_survives_missing_and_null_fields() -> None:
    text = status_view.format_status({"run_id": "run-a", "loss": None, "maddrs": None, "bytes_per_param": None})
    assert "run-a" in text
    assert "loss" in text and "- (eval -)" in text
    assert "None" not in text and "nan" not in text.lower()
    assert status_view.format_status({}).count("-") >= 10


def test_swarm_line_says_when_a_node_is_isolated_and_since_when() -> None:
    def swarm(status: dict) -> str:  # type: ignore[type-arg]
        lines = status_view.format_status(status, now=1_000_100.0).splitlines()
        return next(line for line in lines if line.startswith("swarm")).split(None, 1)[1]

    assert swarm({"isolated": False}) == "connected"
    assert swarm({"isolated": True, "isolated_since": 1_000_000.0}) == (
        "ISOLATED since 100s ago; training paused, retrying peers")
    assert swarm({}) == "-"


def test_peer_table_is_aligned_and_marks_self() -> None:
    rows = [peer_row(0, is_self=True), peer_row(1)]
    rows[0]["last_seen"], rows[1]["last_seen"] = NOW - 3, NOW - 70
    table = status_view.format_peers(rows, NOW).splitlines()
    assert table[0].split() == ["PEER", "LABEL", "ROUNDS", "SENT", "RECEIVED", "MBIT/S", "UTIL", "LAST", "SEEN"]
    assert len(table) == 3
    assert " *" in table[1] and " *" not in table[2]
    assert "node-1" in table[2] and "1.9 MiB" in table[2] and "3.8 MiB" in table[2]
    assert "8.00" in table[2] and "90.0%" in table[2]
    assert table[1].endswith("3s ago") and table[2].endswith("70s ago")
    assert table[1].index("node-0") == table[2].index("node-1") == table[0].index("LABEL")
    assert table[1].index("MiB") == table[2].index("MiB")  # right-aligned numbers line up


def test_peer_table_empty_and_partial_rows() -> None:
    assert status_view.format_peers([], NOW) == "no peers seen yet"
    table = status_view.format_peers([{"peer_id": "QmOnlyAnId"}], NOW)
    assert "QmOnlyAnId" in table and "None" not in table


def test_render_tolerates_odd_peer_payloads() -> None:
    for peers in ({}, {"peers": None}, {"peers": "oops"}, {"peers": [1, None]}):
        text = status_view.render({"run_id": "r"}, peers, NOW)
        assert "swarm (0 peers)" in text and "no peers seen yet" in text
    text = status_view.render({"run_id": "r"}, {"peers": [peer_row(0)]}, NOW)
    assert "swarm (1 peers)" in text


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco-node: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("url", ["127.0.0.1:abc", "ftp://127.0.0.1/", "http://[::1", "http://127.0.0.1:abc",
                                 "http://127.0.0.1:99999", "http://"])
def test_malformed_url_is_one_line_exit_2(url: str) -> None:
    _assert_one_line_error(status_in_process(url), "not an http(s) URL")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("scheme", ["http://", ""])  # HOST:PORT as --status takes it, too
def test_unreachable_url_is_one_line_exit_2(scheme: str) -> None:
    _assert_one_line_error(status_in_process(f"{scheme}127.0.0.1:{_free_port()}"), "cannot reach")


@pytest.fixture()
def not_a_node() -> Iterator[str]:
    """A plain HTTP server that answers HTML for every path, like a wrong port would."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            body = b"<html>hello</html>" if self.path != "/missing/api/status" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_non_json_answer_is_one_line_exit_2(not_a_node: str) -> None:
    _assert_one_line_error(status_in_process(not_a_node), "did not answer JSON")
    _assert_one_line_error(status_in_process(not_a_node + "/missing"), "HTTP 404")


def test_status_against_a_real_status_server() -> None:
    server = StatusServer(filled_telemetry(), "127.0.0.1", 0)
    url = server.start()
    try:
        result = run_status(url + "/")  # a trailing slash is fine
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "test-run" in out and "12D3KooWabcdefghijklmnopPeer0000" in out
    assert "2 (inner step 80)" in out and "3.9000 (eval 4.1000)" in out
    assert "1.9 MiB" in out and "3.8 MiB" in out and "int8 (1.030 B/param)" in out
    assert "swarm (2 peers)" in out and "node-1" in out and "90.0%" in out and "s ago" in out


# --- what a peer or a server sends is shown escaped and bounded -----------------------------------

HOSTILE = ("\x1b[2J\x1b[31mpwned\x1b]0;title\x07\r\nPEER  fake-row\u202etxt\x00\x7f\u2028\\x1b "
           + "A" * 10_000)


def _is_safe(line: str) -> bool:
    return all(char.isprintable() for char in line)


def test_a_peer_label_with_escapes_is_shown_escaped_and_bounded() -> None:
    rows = [peer_row(0, is_self=True), {**peer_row(1), "label": HOSTILE}]
    table = status_view.format_peers(rows, NOW).splitlines()
    assert len(table) == 3  # no forged row: the CR/LF is shown, not obeyed
    assert all(_is_safe(line) for line in table)
    hostile_row = table[2]
    assert "\\x1b[2J\\x1b[31mpwned" in hostile_row and "\\r\\n" in hostile_row and "\\u202e" in hostile_row
    assert "..." in hostile_row and "AAAA" not in hostile_row  # cut at LABEL_CHARS
    assert len(table[2]) <= len(table[1]) - len("node-0") + status_view.LABEL_CHARS


def test_every_string_of_the_status_block_is_shown_escaped_and_bounded() -> None:
    status: dict[str, Any] = {key: HOSTILE for key in ("run_id", "peer_id", "label", "compression", "outer_step",
                                                       "peers")}
    status["maddrs"] = [HOSTILE]
    text = status_view.render(status, {"peers": [{"peer_id": HOSTILE, "label": HOSTILE}]}, NOW)
    assert all(_is_safe(line) for line in text.splitlines())
    assert "\x1b" not in text and "\r" not in text
    assert max(len(line) for line in text.splitlines()) < 2 * status_view.TEXT_CHARS


def test_shown_keeps_honest_text_and_never_cuts_an_escape_in_half() -> None:
    assert status_view.shown("gpu-box (eu-west, Zürich) 東京") == "gpu-box (eu-west, Zürich) 東京"
    assert status_view.shown("x" * 64, 64) == "x" * 64
    cut = status_view.shown("\x1b" * 50, 20)
    assert cut == "\\x1b" * 4 + "..." and len(cut) <= 20
    assert status_view.shown("a\\x1b") == "a\\\\x1b"  # a backslash sent is doubled: never taken for an escape
    assert status_view.text("") == "-" and status_view.text(None) == "-"
