"""A wide-area network on one machine: "islands" in network namespaces joined by rate-limited links.

    with Islands(count=2, rate_mbit=10.0) as islands:
        a, b = islands
        server = b.run([sys.executable, "-m", "http.server", "--bind", b.address, "8000"])
        ...
        print(a.tx_bytes(), islands.measure_tcp_mbit(a, b))

Topology — a hub, not a chain from island 0. A namespace ``<prefix>-hub`` holds a Linux bridge;
each island ``<prefix>-i<N>`` gets one veth pair, ``eth0`` inside the island and ``p<N>`` inside the
hub, enslaved to the bridge. Why a hub: every island then has exactly one link of its own — its
"access line" to the internet — rate-limited in both directions (tbf on ``eth0`` for what the
island sends, tbf on ``p<N>`` for what it receives), so the island's ``eth0`` counters are exactly
that island's wire traffic whoever it talks to, any island reaches any other with the same rate
(not only through island 0), and adding islands is one more veth pair. Interface names live inside
our own namespaces, so they never clash with the host's or with a concurrent run's.

What tbf models and what it does not: ``rate`` and ``burst`` shape bandwidth; tbf's ``latency`` is
the longest a packet may wait in the queue (i.e. the queue size), NOT a propagation delay — this
kernel has no netem, so there is no added round-trip time and no random loss.

Addresses are 10.231.<run>.<N+1>/24 with <run> derived from the pid; they exist only inside these
namespaces (no route from the host), so traffic never leaves the machine. IPv6 is switched off inside
the islands so that router/neighbour solicitations do not add noise to the byte counters.

``IslandNode`` is a real `diloco-node join` inside an island (diloco_node/commands/launch.py's NodeProcess,
its command line wrapped by ``Island.command``), ``node_options`` its fast flags on the island's
address. Byte counters are read through harness/wire.py.

Cleanup: ``__exit__`` kills every process started with ``Island.run`` (and anything else still
inside the namespaces — they are ours) and deletes the namespaces, which deletes the veths and the
bridge with them; an ``atexit`` hook does the same if the with-block never exits normally, and
``Islands.__enter__`` first removes namespaces left by crashed earlier runs (``dln-<pid>-*`` whose
pid no longer exists — never a concurrent live run's).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from diloco_node.commands.launch import NodeProcess
from harness import wire
from harness.nodes import FAST

PREFIX = "dln"
IFACE = "eth0"
SUBNET = "10.231"
NAT_SUBNET = "10.232"  # the LANs behind masquerading routers (Islands.behind_nat)
COMMAND_TIMEOUT = 20.0

_NAME = re.compile(rf"^{PREFIX}-(\d+)-\S+")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=COMMAND_TIMEOUT)


def _netns_names() -> list[str]:
    result = _ip("netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    """Every process still inside one of our namespaces was started by us there: SIGKILL it by pid."""
    result = _ip("netns", "pids", ns, check=False)
    for pid in (int(p) for p in result.stdout.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    _ip("netns", "delete", ns, check=False)


def remove_leftovers() -> list[str]:
    """Delete namespaces of earlier runs that died without cleaning up (their pid is gone)."""
    removed = []
    for ns in _netns_names():
        match = _NAME.match(ns)
        if match and not _pid_alive(int(match[1])):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


def default_burst_kb(rate_mbit: float) -> float:
    """A tbf bucket of 10 ms at the rate, at least 32 KiB (tbf needs rate/HZ and a GSO super-packet)."""
    return max(32.0, rate_mbit * 1e6 / 8 * 0.010 / 1024)


def require_netns() -> str | None:
    """None when this process can create network namespaces, veths and tbf qdiscs; else why not."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, not {sys.platform}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        try:
            _ip("netns", "add", probe)
            _ip("-n", probe, "link", "add", "vp0", "type", "veth", "peer", "name", "vp1")
            subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "vp0", "root", "tbf", "rate", "1mbit",
                            "burst", "32kb", "latency", "50ms"], capture_output=True, text=True, check=True,
                           timeout=COMMAND_TIMEOUT)
        finally:
            _ip("netns", "delete", probe, check=False)
    except subprocess.CalledProcessError as exc:
        return f"`{' '.join(exc.cmd)}` failed: {(exc.stderr or '').strip() or exc.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"probing network namespaces failed: {exc}"
    return None


class Island:
    """One network namespace with one rate-limited link (``eth0``) to the hub."""

    def __init__(self, islands: Islands, index: int, namespace: str, address: str):
        self.index = index
        self.namespace = namespace
        self.address = address
        self.interface = IFACE
        self._islands = islands

    def __repr__(self) -> str:
        return f"Island({self.namespace}, {self.address})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv, run inside this island."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv inside this island; it is killed at teardown if still running."""
        process = subprocess.Popen(self.command(argv), **popen_kwargs)
        self._islands._processes.append(process)
        return process

    def check_output(self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> str:
        return subprocess.run(self.command(argv), capture_output=True, text=True, check=True,
                              timeout=timeout).stdout

    def cut(self) -> None:
        """Take the island off the network as an upstream failure does: its link stays up, but the
        hub no longer bridges it, so whatever it sends (and whatever is sent to it) is lost silently."""
        _ip("-n", self._islands.hub, "link", "set", f"p{self.index}", "nomaster")

    def heal(self) -> None:
        """Put a cut island back on the network."""
        _ip("-n", self._islands.hub, "link", "set", f"p{self.index}", "master", "br0")

    def counters(self) -> wire.Counters:
        """Bytes this island put on its link and took off it (all of it: IP/TCP headers, handshakes, ACKs...)."""
        return wire.counters(self.interface, self.namespace)

    def tx_bytes(self) -> int:
        """Bytes this island put on its link."""
        return self.counters().tx

    def rx_bytes(self) -> int:
        """Bytes this island took off its link."""
        return self.counters().rx


class Islands:
    """``count`` islands around a hub, each link shaped to ``rate_mbit`` in both directions.

    burst_kb: tbf bucket size (default: 10 ms at the rate, at least 32 KiB — tbf needs at least
    rate/HZ and a GSO super-packet). latency_ms: tbf queue limit as a waiting time (see module doc).
    """

    def __init__(self, count: int = 2, rate_mbit: float = 10.0, burst_kb: float | None = None,
                 latency_ms: float = 50.0):
        if not 1 <= count <= 200:
            raise ValueError("count must be within 1..200")
        self.count = count
        self.rate_mbit = rate_mbit
        self.burst_kb = burst_kb if burst_kb is not None else default_burst_kb(rate_mbit)
        self.latency_ms = latency_ms
        self.prefix = f"{PREFIX}-{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.hub = f"{self.prefix}-hub"
        self.islands: list[Island] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._namespaces: list[str] = []
        self._closed = False
        # one /24 per live run (by pid), so concurrent runs never share a subnet inside their islands
        self._subnet = f"{SUBNET}.{os.getpid() % 250 + 1}"

    # --- set-up / teardown --------------------------------------------------------------------

    def __enter__(self) -> Islands:
        remove_leftovers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        for key in ("all", "default"):
            subprocess.run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", f"net.ipv6.conf.{key}.disable_ipv6=1"],
                           capture_output=True, check=False, timeout=COMMAND_TIMEOUT)

    def _shape(self, ns: str, dev: str, rate_mbit: float | None = None, verb: str = "add") -> None:
        rate = self.rate_mbit if rate_mbit is None else rate_mbit
        burst_kb = self.burst_kb if rate_mbit is None else default_burst_kb(rate)
        subprocess.run(["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf",
                        "rate", f"{rate}mbit", "burst", f"{int(burst_kb * 1024)}",
                        "latency", f"{self.latency_ms}ms"],
                       capture_output=True, text=True, check=True, timeout=COMMAND_TIMEOUT)

    def set_rate(self, island: Island, rate_mbit: float) -> None:
        """Give one island's access line another rate, both ways (a home uplink beside a datacentre's)."""
        self._shape(island.namespace, IFACE, rate_mbit, "change")
        self._shape(self.hub, f"p{island.index}", rate_mbit, "change")

    def _build(self) -> None:
        self._add_namespace(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for index in range(self.count):
            ns = f"{self.prefix}-i{index}"
            address = f"{self._subnet}.{index + 1}"
            self._add_namespace(ns)
            port = f"p{index}"
            _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns)
            _ip("-n", self.hub, "link", "set", port, "master", "br0")
            _ip("-n", self.hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            self._shape(ns, IFACE)      # what the island sends
            self._shape(self.hub, port)  # what the island receives
            self.islands.append(Island(self, index, ns, address))

    def behind_nat(self, router: Island) -> Island:
        """A namespace whose only way out is `router`, which masquerades it as a home router does:
        it reaches every island, and no island can open a connection to it (no route to its LAN)."""
        index = len(self.islands)
        ns, lan = f"{self.prefix}-n{index}", f"{NAT_SUBNET}.{os.getpid() % 250 + 1}"
        self._add_namespace(ns)
        _ip("-n", router.namespace, "link", "add", f"lan{index}", "type", "veth", "peer", "name", IFACE, "netns", ns)
        _ip("-n", router.namespace, "addr", "add", f"{lan}.1/24", "dev", f"lan{index}")
        _ip("-n", router.namespace, "link", "set", f"lan{index}", "up")
        _ip("-n", ns, "addr", "add", f"{lan}.2/24", "dev", IFACE)
        _ip("-n", ns, "link", "set", IFACE, "up")
        _ip("-n", ns, "route", "add", "default", "via", f"{lan}.1")
        for argv in (["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
                     ["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24", "-o", IFACE,
                      "-j", "MASQUERADE"]):
            router.check_output(argv)
        island = Island(self, index, ns, f"{lan}.2")
        self.islands.append(island)
        return island

    def close(self) -> None:
        """Kill what runs in the islands and delete every namespace (idempotent, never raises)."""
        if self._closed:
            return
        self._closed = True
        for process in self._processes:
            if process.poll() is None:
                try:
                    process.kill()
                except OSError:
                    pass
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._namespaces):
            try:
                _delete_namespace(ns)
            except Exception:  # cleanup goes on with the next namespace
                pass
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def leftovers(self) -> list[str]:
        """Namespaces of this run that still exist (empty after close)."""
        return [ns for ns in _netns_names() if ns.startswith(self.prefix + "-")]

    # --- access -------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> Island:
        return self.islands[index]

    def __iter__(self) -> Iterator[Island]:
        return iter(self.islands)

    def __len__(self) -> int:
        return len(self.islands)

    # --- measuring ----------------------------------------------------------------------------

    def measure_tcp_mbit(self, src: Island, dst: Island, seconds: float = 3.0) -> float:
        """Raw TCP goodput src → dst in Mbit/s: one connection, bulk send for `seconds`."""
        receiver = dst.run([sys.executable, "-c", _RECEIVER, dst.address], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        sender = None
        try:
            assert receiver.stdout
            port = receiver.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError(f"TCP receiver did not start: {port!r} {receiver.stderr and receiver.stderr.read()}")
            sender = src.run([sys.executable, "-c", _SENDER, dst.address, port, str(seconds)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _, sender_err = sender.communicate(timeout=seconds + 30)
            if sender.returncode != 0:
                raise RuntimeError(f"TCP sender failed: {sender_err}")
            out, err = receiver.communicate(timeout=30)
            if receiver.returncode != 0:
                raise RuntimeError(f"TCP receiver failed: {err}")
            received, elapsed = out.split()
            return int(received) * 8 / float(elapsed) / 1e6
        finally:
            for process in (sender, receiver):
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)


# Receiver: prints its port, then counts bytes from the first to the last one received.
_RECEIVER = textwrap.dedent("""
    import socket, sys, time
    server = socket.create_server((sys.argv[1], 0))
    server.settimeout(30)
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.settimeout(30)
    total, first, last = 0, None, None
    while chunk := conn.recv(1 << 20):
        last = time.monotonic()
        if first is None:
            first = last
        total += len(chunk)
    print(total, max((last or 0) - (first or 0), 1e-6))
""")

# Sender: writes zeros as fast as the link takes them for `seconds`, then closes.
_SENDER = textwrap.dedent("""
    import socket, sys, time
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    block = bytes(1 << 16)
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        conn.sendall(block)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    conn.close()
""")


# --- nodes inside islands ---------------------------------------------------------------------

_GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


@dataclass
class IslandNode(NodeProcess):
    """A node inside an island (its command wrapped by the island's); its status server is on the
    island's loopback, so reads go through the island."""

    island: Island | None = None

    def __post_init__(self) -> None:
        assert self.island is not None and self.wrap is None
        self.wrap = self.island.command  # killed with the islands at teardown if still running

    def get(self, path: str) -> Any:
        assert self.island is not None and self.status_url
        return json.loads(self.island.check_output([sys.executable, "-c", _GET, f"{self.status_url}{path}"]))


def node_options(island: Island, run_id: str) -> list[str]:
    """Fast test-node flags, listening on the island's address; no checkpoints, runs until stopped."""
    options = list(FAST)
    options[options.index("--listen") + 1] = f"/ip4/{island.address}/tcp/0"
    return [*options, "--run-id", run_id, "--min-peers", "2", "--checkpoint-dir", "", "--max-outer-steps", "0"]
