"""The status server: aiohttp on its own thread and event loop, reading Telemetry snapshots.

Read-only by construction (GET routes only) and bound to 127.0.0.1 unless the operator says
otherwise; responses carry training state and public peer ids, never paths or keys.

Every request must name in its Host header an IP address, `localhost`, or a name of ours (the
status host the server was given, the DNS names the node announces, the machine's hostname);
others get 421 (docs/architecture.md §9). A DNS-rebinding page (evil.example re-resolved to
127.0.0.1) is same-origin with our address in its victim's browser, but its requests still say
`Host: evil.example`: without this check it could read /api/status. Prometheus and curl by IP, and
the dashboard opened at the URL the node prints, pass.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from diloco_node.errors import NodeError
from diloco_node.forks import close_in_helpers
from diloco_node.telemetry import metrics
from diloco_node.telemetry.meter import Telemetry

STATIC_DIR = Path(__file__).parent / "static"

logger = logging.getLogger(__name__)

TELEMETRY_KEY = web.AppKey("telemetry", Telemetry)
MISDIRECTED = 421  # RFC 9110: this server does not answer for the host the request names
LOCAL_NAMES = frozenset({"localhost"})
MAX_LOGGED_HOSTS = 64  # refused hosts named in the log, once each; more are refused silently


class StatusServerError(NodeError, RuntimeError):
    """The server could not start (e.g. its port is in use), phrased as one line for the user."""


async def healthz(request: web.Request) -> web.Response:
    """200 while the node works; 503 with the reason once it cannot (it is stopping, exit 1)."""
    why = request.app[TELEMETRY_KEY].unhealthy()
    if why is not None:
        return web.json_response({"ok": False, "reason": why}, status=503)
    return web.json_response({"ok": True})


async def api_status(request: web.Request) -> web.Response:
    snapshot = await asyncio.to_thread(request.app[TELEMETRY_KEY].snapshot, fresh=True)
    snapshot["uptime_seconds"] = round(time.time() - snapshot.pop("started_at"), 1)
    return web.json_response(snapshot)


async def api_history(request: web.Request) -> web.Response:
    telemetry = request.app[TELEMETRY_KEY]
    return web.json_response({"run_id": telemetry.snapshot().get("run_id"), "rounds": telemetry.history()})


async def api_peers(request: web.Request) -> web.Response:
    telemetry = request.app[TELEMETRY_KEY]
    return web.json_response({"run_id": telemetry.snapshot().get("run_id"), "peers": telemetry.peers()})


async def prometheus_metrics(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(metrics.render, request.app[TELEMETRY_KEY])
    return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


def host_name(header: str) -> str:
    """The host of a Host header, without its port and brackets, lower case, no trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):  # [v6]:port
        return header[1:header.find("]")] if "]" in header else header
    name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header  # a bare v6 has several
    return name.rstrip(".")


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])  # a v6 zone (fe80::1%eth0) is no part of the address
    except ValueError:
        return False
    return True


def announced_hosts(multiaddrs: Iterable[str]) -> list[str]:
    """The DNS names in --announce multiaddrs (/dns4/<name>/tcp/…): names peers and people reach us by."""
    names = []
    for address in multiaddrs:
        parts = address.split("/")
        names += [parts[i + 1] for i, part in enumerate(parts[:-1]) if part in ("dns", "dns4", "dns6")]
    return names


def allowed_hosts(bound: str, announced: Iterable[str] = ()) -> frozenset[str]:
    """The host names (besides IP literals, always allowed) a request may name: `localhost`, the
    host the server is bound to, the announced names, and the machine's hostname; a rebinding
    page's Host is its own domain, which is none of these."""
    names = {host_name(bound), *(host_name(name) for name in announced), host_name(socket.gethostname())}
    return LOCAL_NAMES | {name for name in names if name}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_check(allowed: frozenset[str]) -> Middleware:
    """The middleware answering 421 to a request whose Host is neither an IP literal nor in
    `allowed` (a request with no Host at all comes from no browser, and passes)."""
    logged: set[str] = set()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Host")
        host = host_name(header) if header is not None else None
        if host is None or is_ip_literal(host) or host in allowed:
            return await handler(request)
        if host not in logged and len(logged) < MAX_LOGGED_HOSTS:
            logged.add(host)
            logger.warning("status server refused host=%r path=%s: not one of ours (a DNS-rebinding page?); "
                           "to serve it by that name, give it as the --status host", host[:100], request.path)
        return web.Response(status=MISDIRECTED, text="this status server answers to its IP addresses, localhost "
                                                     "and its own host names only\n")

    return check


def build_app(telemetry: Telemetry, hosts: frozenset[str] | None = None) -> web.Application:
    """`hosts`: the names requests may give as Host besides IP literals (`allowed_hosts`; default:
    localhost and this machine's hostname)."""
    app = web.Application(middlewares=[host_check(allowed_hosts("localhost") if hosts is None else hosts)])
    app[TELEMETRY_KEY] = telemetry
    app.router.add_get("/", dashboard)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/status", api_status)
    app.router.add_get("/api/history", api_history)
    app.router.add_get("/api/peers", api_peers)
    app.router.add_get("/metrics", prometheus_metrics)
    app.router.add_static("/static/", STATIC_DIR, follow_symlinks=False)
    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, with SO_REUSEADDR: a client that read a page with
    `Connection: close` leaves the closed connection in TIME-WAIT on our side for a minute, and
    without it a node restarted at once could not bind its port. On Linux it never lets two live
    servers share a port (that is SO_REUSEPORT, left off): a port really taken is still refused."""
    family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                            flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, protocol)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class StatusServer:
    """Starts synchronously (so a busy port is reported before training starts), then serves."""

    def __init__(self, telemetry: Telemetry, host: str, port: int, announced: Iterable[str] = ()):
        """`announced`: further names the node is reached by (announced_hosts of --announce)."""
        self._app = build_app(telemetry, allowed_hosts(host, announced))
        self._host, self._requested_port = host, port
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self._app, access_log=None)
        self._thread = threading.Thread(target=self._loop.run_forever, name="status-server", daemon=True)
        self.port = port
        self._socket: socket.socket | None = None

    def start(self) -> str:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._bind(), self._loop)
        try:
            self.port = future.result(timeout=30)
        except OSError as exc:
            raise StatusServerError(
                f"cannot serve status on {self._host}:{self._requested_port}: {(exc.strerror or str(exc)).lower()}"
            ) from None
        return f"http://{self._host}:{self.port}"

    async def _bind(self) -> int:
        await self._runner.setup()
        self._socket = listening_socket(self._host, self._requested_port)
        close_in_helpers(self._socket.fileno())  # hivemind forks its helpers after this (forks.py)
        await web.SockSite(self._runner, self._socket).start()
        return int(self._socket.getsockname()[1])  # the real port when 0 asked for a free one

    def stop(self) -> None:
        if self._socket is not None:
            close_in_helpers(self._socket.fileno(), close=False)
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()  # an unclosed loop is closed by the GC at exit, which prints a traceback
