"""The manager's admin HTTP API and dashboard (aiohttp)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .service import ManagerService


class AdminServer:
    def __init__(self, manager: ManagerService) -> None:
        self.manager = manager
        self._runner: web.AppRunner | None = None

    async def start(self, bind: str) -> str:
        """Serve on ``host:port``; returns the base URL."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host, _, port = bind.rpartition(":")
        site = web.TCPSite(self._runner, host or "127.0.0.1", int(port or 0))
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        h, p = sock.getsockname()[:2]
        return f"http://{h}:{p}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})
