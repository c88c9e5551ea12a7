"""The status server: aiohttp on its own thread and event loop, reading Telemetry snapshots.

Read-only by construction (GET routes only) and bound to 127.0.0.1 unless the operator says
otherwise; responses carry training state and public peer ids, never paths or keys.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path

from aiohttp import web

from diloco_node.errors import NodeError
from diloco_node.lifecycle import close_in_helpers
from diloco_node.telemetry import metrics
from diloco_node.telemetry.meter import Telemetry

STATIC_DIR = Path(__file__).parent / "static"

logger = logging.getLogger(__name__)

TELEMETRY_KEY = web.AppKey("telemetry", Telemetry)


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


def build_app(telemetry: Telemetry) -> web.Application:
    app = web.Application()
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

    def __init__(self, telemetry: Telemetry, host: str, port: int):
        self._app = build_app(telemetry)
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
        close_in_helpers(self._socket.fileno())  # hivemind forks its helpers after this (lifecycle.py)
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
