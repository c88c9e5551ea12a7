"""What this node's swarm traffic costs the link: bytes on the wire, control traffic and headers included.

`bytes_sent` / `bytes_received` count the payloads this node exchanged, which is what codecs are
judged by. A volunteer's link also carries hivemind's DHT and matchmaking chatter, libp2p framing
and TCP/IP headers. All of it flows through the node's libp2p daemon (p2pd), so the kernel's
per-connection TCP counters of that daemon (read with iproute2's `ss`, the tcp_info of each socket)
give the true cost: payload bytes of every segment, plus one header per segment.

Counters vanish with their connection, so a background thread samples every second and keeps the
last value of every connection it has seen; libp2p keeps connections open, so at most the traffic
of a connection's final second can be missed. Readers that want the figure of this moment (the
status API, the round's statistics) call `refresh`, which samples again unless a sample is fresh.

Linux interface counters (a veth's, a NIC's with TSO) count a segmentation-offloaded burst as one
packet with one set of headers, so on bulk transfers they read a few percent below these figures,
which give every segment its headers as the link carries them.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DAEMON_NAME = "p2pd"
SAMPLE_SECONDS = 1.0
FRESH_SECONDS = 0.5  # `refresh` reuses a sample this young, so a flood of readers can't flood `ss`
ETHERNET_HEADER = 14  # what Linux interface counters (and the veth ground truth) include per frame
TCP_HEADER, TCP_TIMESTAMPS = 20, 12

_OWNERS = re.compile(r"\(\"[^\"]*\",pid=(\d+),fd=\d+\)")
_COUNTERS = {name: re.compile(rf"\b{name}:(\d+)") for name in ("bytes_sent", "bytes_acked", "bytes_received",
                                                               "segs_out", "segs_in")}


@dataclass(frozen=True)
class Connection:
    """One TCP connection's counters, as link-layer bytes (payload + one set of headers per segment)."""

    sent: int
    received: int


def parse_ss(output: str) -> dict[tuple[str, str, int], Connection]:
    """`ss -tinpH` output → {(local, peer, owner pid): counters}. Sockets without counters are skipped."""
    connections: dict[tuple[str, str, int], Connection] = {}
    lines = output.splitlines()
    for head, info in zip(lines, lines[1:], strict=False):
        if head[:1].isspace() or not info[:1].isspace():
            continue  # `head` must be a socket line and `info` its indented tcp_info line
        fields = head.split()
        owners = _OWNERS.findall(head)
        counters = {name: int(m.group(1)) for name, pattern in _COUNTERS.items() if (m := pattern.search(info))}
        if len(fields) < 5 or not owners or "segs_out" not in counters or "bytes_received" not in counters:
            continue
        local, peer = fields[3], fields[4]
        header = ETHERNET_HEADER + _ip_and_tcp_header(info, ipv6=local.startswith("["))
        sent = counters.get("bytes_sent", counters.get("bytes_acked", 0))  # bytes_sent needs Linux ≥ 4.19
        connections[(local, peer, int(owners[0]))] = Connection(
            sent=sent + header * counters["segs_out"],
            received=counters["bytes_received"] + header * counters.get("segs_in", 0))
    return connections


def _ip_and_tcp_header(info: str, ipv6: bool) -> int:
    """Per-segment IP + TCP header bytes, options included: the path MTU less the segment size."""
    pmtu, mss = re.search(r"\bpmtu:(\d+)", info), re.search(r"\bmss:(\d+)", info)
    if pmtu and mss and 0 < int(pmtu.group(1)) - int(mss.group(1)) <= 120:
        return int(pmtu.group(1)) - int(mss.group(1))
    return (40 if ipv6 else 20) + TCP_HEADER + TCP_TIMESTAMPS  # Linux's default: timestamps on


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def descends_from(pid: int, ancestor: int) -> bool:
    seen = 0
    current: int | None = pid
    while current and seen < 64:
        if current == ancestor:
            return True
        current, seen = _parent(current), seen + 1
    return False


class WireMeter:
    """Cumulative link-layer bytes of every TCP connection of the libp2p daemon(s) this process started."""

    def __init__(self, root_pid: int, on_sample: Callable[[int, int], None] | None = None):
        self._root = root_pid
        self._on_sample = on_sample
        self._ss = shutil.which("ss")
        self._lock = threading.Lock()  # guards the counts
        self._sampling = threading.Lock()  # one `ss` at a time
        self._sampled_at = -float("inf")  # time.monotonic() of the last sample
        self._finished = [0, 0]  # sent, received by connections that have closed
        self._open: dict[tuple[str, str, int], Connection] = {}
        self._ours: dict[int, bool] = {}  # pid → is it our daemon; pids that own no socket any more are forgotten
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wire-meter", daemon=True)

    @property
    def available(self) -> bool:
        return self._ss is not None

    def start(self) -> WireMeter:
        if not self.available:
            logger.warning("iproute2's `ss` is not installed: wire bytes (control traffic, headers) are not measured")
        else:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def totals(self) -> tuple[int, int] | None:
        """(sent, received) link-layer bytes since start, or None when they cannot be measured."""
        if not self.available:
            return None
        with self._lock:
            sent = self._finished[0] + sum(c.sent for c in self._open.values())
            received = self._finished[1] + sum(c.received for c in self._open.values())
        return sent, received

    def refresh(self, max_age: float = FRESH_SECONDS) -> None:
        """Sample now unless the last sample is younger than `max_age` seconds."""
        if self.available and time.monotonic() - self._sampled_at >= max_age:
            self.sample()

    def sample(self) -> None:
        assert self._ss is not None
        with self._sampling:
            try:
                output = subprocess.run([self._ss, "-tinpH"], capture_output=True, text=True, timeout=10,
                                        check=True).stdout
            except (OSError, subprocess.SubprocessError) as error:
                logger.debug("ss failed: %s", error)
                return
            connections = parse_ss(output)
            self.absorb({key: value for key, value in connections.items() if self._is_ours(key[2])})
            owners = {pid for _, _, pid in connections}
            self._ours = {pid: ours for pid, ours in self._ours.items() if pid in owners}  # bounded by live pids
            self._sampled_at = time.monotonic()

    def absorb(self, current: dict[tuple[str, str, int], Connection]) -> None:
        """Take one sample of our open connections; those gone since the last one keep their last counts."""
        with self._lock:
            for key, old in self._open.items():
                new = current.get(key)
                if new is None or new.sent < old.sent or new.received < old.received:
                    # closed, or the same address pair reused by a new connection
                    self._finished[0] += old.sent
                    self._finished[1] += old.received
            self._open = current
        if self._on_sample:
            totals = self.totals()
            assert totals is not None
            self._on_sample(*totals)

    def _is_ours(self, pid: int) -> bool:
        if pid not in self._ours:
            self._ours[pid] = _name(pid) == DAEMON_NAME and descends_from(pid, self._root)
        return self._ours[pid]

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.sample()
