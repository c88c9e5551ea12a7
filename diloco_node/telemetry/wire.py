"""What this node's swarm traffic costs the link: bytes on the wire, control traffic and headers included.

`bytes_sent` / `bytes_received` count the payloads this node exchanged, which is what codecs are
judged by. A volunteer's link also carries hivemind's DHT and matchmaking chatter, libp2p framing
and TCP/IP headers. All of it flows through the node's libp2p daemon (p2pd), so the kernel's
per-connection TCP counters of that daemon (the tcp_info of each of its sockets) give the true
cost: payload bytes of every segment, plus one header per segment.

The counters come from the kernel over netlink (sock_diag, through pyroute2), and the daemon's
sockets from /proc/<pid>/fd. Nothing here starts a process: hivemind forks its helpers from
other threads of this process, and a fork taken while a subprocess was being spawned inherits
the spawn's pipe and can freeze it (seen with `ss` as a subprocess, see issue 12).

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
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DAEMON_NAME = "p2pd"
SAMPLE_SECONDS = 1.0
FRESH_SECONDS = 0.5  # `refresh` reuses a sample this young, so a flood of readers can't flood the kernel
# The egress and ingress rates shown against the caps (docs/architecture.md §14) are measured over
# the last samples spanning at least this long: one second would swing with each burst of a round.
# The span of our streams' own rates (peer_traffic.WINDOW_SAMPLES), so the two "now" figures agree;
# at 3 s a pair exchanging every ~3 s read 4 Mbit/s, then 0.05, then 4 again as a window fell
# between two exchanges.
RATE_SECONDS = 5.0
ETHERNET_HEADER = 14  # what Linux interface counters (and the veth ground truth) include per frame
TCP_HEADER, TCP_TIMESTAMPS = 20, 12
_INET_DIAG_INFO = 2  # the tcp_info extension of an inet_diag request


@dataclass(frozen=True)
class Connection:
    """One TCP connection's counters, as link-layer bytes (payload + one set of headers per segment)."""

    sent: int
    received: int


def link_bytes(info: Mapping[str, int], ipv6: bool) -> Connection:
    """A socket's tcp_info (tcpi_* fields) as link-layer bytes: every segment gets its headers."""
    header = ETHERNET_HEADER + _ip_and_tcp_header(info.get("tcpi_pmtu", 0), info.get("tcpi_snd_mss", 0), ipv6)
    sent = info.get("tcpi_bytes_sent") or info.get("tcpi_bytes_acked", 0)  # bytes_sent needs Linux ≥ 4.19
    return Connection(sent=sent + header * info.get("tcpi_segs_out", 0),
                      received=info.get("tcpi_bytes_received", 0) + header * info.get("tcpi_segs_in", 0))


def _ip_and_tcp_header(pmtu: int, mss: int, ipv6: bool) -> int:
    """Per-segment IP + TCP header bytes, options included: the path MTU less the segment size."""
    if 0 < pmtu - mss <= 120:
        return pmtu - mss
    return (40 if ipv6 else 20) + TCP_HEADER + TCP_TIMESTAMPS  # Linux's default: timestamps on


def tcp_connections(inodes: set[int]) -> dict[tuple[str, str, int], Connection]:
    """{(local, peer, inode): counters} of the TCP sockets among `inodes`, from the kernel."""
    from pyroute2 import DiagSocket  # imported here: only a running node samples
    from pyroute2.netlink.diag import SS_CONN

    connections: dict[tuple[str, str, int], Connection] = {}
    with DiagSocket() as diag:
        diag.bind()
        for family in (socket.AF_INET, socket.AF_INET6):
            for message in diag.get_sock_stats(family=family, states=SS_CONN, extensions=1 << (_INET_DIAG_INFO - 1)):
                info: Any = message.get_attr("INET_DIAG_INFO")
                if message["idiag_inode"] not in inodes or info is None:
                    continue
                local = f"{message['idiag_src']}:{message['idiag_sport']}"
                peer = f"{message['idiag_dst']}:{message['idiag_dport']}"
                connections[(local, peer, message["idiag_inode"])] = link_bytes(info, family == socket.AF_INET6)
    return connections


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open (empty when it is gone)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


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
        self._lock = threading.Lock()  # guards the counts
        self._sampling = threading.Lock()  # one sample at a time
        self._sampled_at = -float("inf")  # time.monotonic() of the last sample
        self._finished = [0, 0]  # sent, received by connections that have closed
        self._open: dict[tuple[str, str, int], Connection] = {}
        self._history: deque[tuple[float, int, int]] = deque(maxlen=64)  # (monotonic, sent, received)
        self._daemons: set[int] = set()  # pids of our p2pd(s), found once they exist
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wire-meter", daemon=True)
        self.available = _netlink_available()

    def start(self) -> WireMeter:
        if not self.available:
            logger.warning("the kernel's socket statistics (netlink sock_diag) cannot be read: "
                           "wire bytes (control traffic, headers) are not measured")
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
            return self._totals_locked()

    def _totals_locked(self) -> tuple[int, int]:
        sent = self._finished[0] + sum(c.sent for c in self._open.values())
        received = self._finished[1] + sum(c.received for c in self._open.values())
        return sent, received

    def rates(self, span: float = RATE_SECONDS) -> tuple[float, float] | None:
        """(egress, ingress) link-layer bytes/s over the newest samples spanning at least `span`
        seconds (all there are, early on); None until two samples exist."""
        with self._lock:
            if len(self._history) < 2:
                return None
            end = self._history[-1]
            start = next((h for h in reversed(self._history) if end[0] - h[0] >= span), self._history[0])
        seconds = end[0] - start[0]
        if seconds <= 0:
            return None
        return (end[1] - start[1]) / seconds, (end[2] - start[2]) / seconds

    def refresh(self, max_age: float = FRESH_SECONDS) -> None:
        """Sample now unless the last sample is younger than `max_age` seconds."""
        if self.available and time.monotonic() - self._sampled_at >= max_age:
            self.sample()

    def sample(self) -> None:
        with self._sampling:
            self._daemons = {pid for pid in self._daemons if _name(pid) == DAEMON_NAME} or self._find_daemons()
            inodes = set().union(*(socket_inodes(pid) for pid in self._daemons))
            try:
                connections = tcp_connections(inodes) if inodes else {}
            except OSError as error:
                logger.debug("sock_diag failed: %s", error)
                return
            self.absorb(connections)
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
            self._history.append((time.monotonic(), *self._totals_locked()))
        if self._on_sample:
            totals = self.totals()
            assert totals is not None
            self._on_sample(*totals)

    def _find_daemons(self) -> set[int]:
        pids = (int(entry) for entry in os.listdir("/proc") if entry.isdigit())
        return {pid for pid in pids if _name(pid) == DAEMON_NAME and descends_from(pid, self._root)}

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.sample()


def _netlink_available() -> bool:
    try:
        tcp_connections(set())
    except (ImportError, OSError):
        return False
    return True
