"""The manager's admin HTTP API and dashboard (aiohttp).

Routes, models and the OpenAPI document are in ``openapi.py`` (one table, so the document cannot
drift from what is served); what ``/v1/status`` and the scrape-time gauges show is assembled in
``cluster_view.py``. Choices worth knowing:

* **Auth.** The cluster token is the bearer token (``Authorization: Bearer <token>``), compared
  in constant time; 401 with ``WWW-Authenticate: Bearer`` otherwise. The dashboard page and its
  static files, ``/healthz`` and ``/v1/openapi.json`` hold no cluster data and are served without
  it: the page takes the token from ``?token=`` once, keeps it in ``sessionStorage`` and sends it
  as a bearer token. A browser's ``EventSource`` cannot set headers, so ``/v1/events`` (and only
  it) also accepts ``?token=``. The server binds loopback by default (``manager.admin``).
* **Never a 500 for a missing role.** ``/v1/status`` asks the data role, the trainer and every
  relay concurrently, each with a short timeout; whoever does not answer is null and named in
  ``errors``. Rollouts are described from their heartbeats (no call), refined by their ``state``
  endpoint when it answers in time.
* **Errors** are JSON ``{"error", "detail"}`` for every status, aiohttp's own 404/405 included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from laminar.repack import RepackPolicy, plan_repack
from laminar.roles.rollout.api import DrainRequest, RolloutApi
from laminar.roles.trainer.api import LEARNING_MAX_POINTS, LearningRequest
from laminar.runtime.errors import CallTimeout, PeerUnavailable, RemoteError, UnknownMethod

from .cluster_view import ScrapeGauges, cluster_status, learning_view
from .openapi import (
    ROUTES,
    DrainBody,
    PlanView,
    PolicyPatch,
    RolloutActionResult,
    openapi_document,
)
from .view import ManagerView

DASHBOARD = Path(__file__).with_name("dashboard")
ACTION_TIMEOUT_S = 10.0  # drain / resume
SSE_HEARTBEAT_S = 15.0


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: Any = None) -> None:
        super().__init__(error)
        self.status, self.error, self.detail = status, error, detail


def _error(status: int, error: str, detail: Any = None, **headers: str) -> web.Response:
    return web.json_response(
        {"error": error, "detail": detail}, status=status, headers=headers or None
    )


def _json(model: BaseModel | Sequence[BaseModel] | dict[str, Any]) -> web.Response:
    if isinstance(model, BaseModel):
        text = model.model_dump_json()
    elif isinstance(model, list):
        text = "[" + ",".join(m.model_dump_json() for m in model) + "]"
    else:
        text = json.dumps(model)
    return web.Response(text=text, content_type="application/json")


def _int(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        out = int(value)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer", value) from None
    if out < 0:
        raise ApiError(400, f"{name} must be >= 0", value)
    return out


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminServer:
    def __init__(self, manager: ManagerView) -> None:
        self.manager = manager
        self._runner: web.AppRunner | None = None
        self._gauges: ScrapeGauges | None = None
        self._streams: set[asyncio.Task[Any]] = set()
        self._closing = asyncio.Event()
        self.url = ""

    @property
    def _token(self) -> bytes:
        return self.manager.ctx.options.token or b""

    async def start(self, bind: str) -> str:
        """Serve on ``host:port``; returns the base URL."""
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=1 << 20)
        for route in ROUTES:
            app.router.add_route(route.method, route.path, getattr(self, route.handler))
        app.router.add_static("/dashboard/", DASHBOARD, show_index=False)
        self._gauges = ScrapeGauges(self.manager)
        self.manager.ctx.registry.register(self._gauges)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        host, _, port = bind.rpartition(":")
        site = web.TCPSite(self._runner, host or "127.0.0.1", int(port or 0))
        await site.start()
        # ignored below: aiohttp shows a site's bound socket only on its private server
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        h, p = sock.getsockname()[:2]
        self.url = f"http://{h}:{p}"
        return self.url

    async def stop(self) -> None:
        self._closing.set()
        for task in list(self._streams):
            task.cancel()
        if self._gauges is not None:
            with contextlib.suppress(KeyError):
                self.manager.ctx.registry.unregister(self._gauges)
            self._gauges = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middlewares -------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return _error(exc.status, exc.error, exc.detail)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {}
            if isinstance(exc, web.HTTPMethodNotAllowed):
                headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
                return _error(405, "method not allowed", {"allowed": sorted(exc.allowed_methods)},
                              **headers)  # fmt: skip
            if exc.status == 404:
                return _error(404, "not found", {"path": request.path})
            return _error(exc.status, exc.reason, exc.text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.manager.log.exception("admin API error", path=request.path)
            return _error(500, "internal error", f"{type(exc).__name__}: {exc}")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        public = path in ("/", "/healthz", "/v1/openapi.json", "/favicon.ico") or path.startswith(
            "/dashboard/"
        )
        if not public:
            given = ""
            header = request.headers.get("Authorization", "")
            scheme, _, value = header.partition(" ")
            if scheme.lower() == "bearer":
                given = value.strip()
            elif path == "/v1/events" and "token" in request.query:
                given = request.query["token"]
            if not given:
                return _error(401, "missing bearer token", None, **{"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(given.encode(), self._token):
                return _error(
                    401,
                    "wrong token",
                    None,
                    **{"WWW-Authenticate": 'Bearer error="invalid_token"'},
                )
        return await handler(request)

    # -- small routes ------------------------------------------------------------------------

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _openapi(self, _: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.url or None))

    async def _index(self, _: web.Request) -> web.StreamResponse:
        return web.FileResponse(DASHBOARD / "index.html", headers={"Cache-Control": "no-cache"})

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.manager.ctx.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- status ------------------------------------------------------------------------------

    async def _status(self, _: web.Request) -> web.Response:
        return _json(await cluster_status(self.manager))

    async def _learning(self, request: web.Request) -> web.Response:
        q = request.query
        since = _int(q.get("since"), "since") or 0
        limit = _int(q.get("limit"), "limit")
        if limit is not None and not 1 <= limit <= LEARNING_MAX_POINTS:
            raise ApiError(400, f"limit must be 1 to {LEARNING_MAX_POINTS}", limit)
        # clamped, not refused: no version reaches it, and the wire carries 64-bit integers
        ask = LearningRequest(since=min(since, 2**62))
        if limit is not None:
            ask.limit = limit
        return _json(await learning_view(self.manager, ask))

    # -- repack ------------------------------------------------------------------------------

    async def _plan(self, _: web.Request) -> web.Response:
        repack = self.manager.repack
        loads = repack.loads()
        return _json(PlanView(plan=plan_repack(loads, repack.policy), loads=loads,
                              policy=repack.policy))  # fmt: skip

    async def _repack(self, _: web.Request) -> web.Response:
        return _json(await self.manager.repack.repack("operator"))

    async def _get_policy(self, _: web.Request) -> web.Response:
        return _json(self.manager.repack.policy)

    async def _put_policy(self, request: web.Request) -> web.Response:
        body = await _body(request, required=True)
        if not isinstance(body, dict):
            raise ApiError(422, "the policy must be a JSON object", {"got": type(body).__name__})
        try:  # the patch as documented first (types, bounds, no nulls), then the whole policy
            patch = PolicyPatch.model_validate(body).model_dump(exclude_unset=True)
            policy = RepackPolicy.model_validate(
                {**self.manager.repack.policy.model_dump(), **patch}
            )
        except ValidationError as exc:
            raise ApiError(422, "invalid policy", _pydantic_errors(exc)) from None
        self.manager.repack.set_policy(policy, by="operator")
        return _json(policy)

    # -- rollouts ----------------------------------------------------------------------------

    async def _drain(self, request: web.Request) -> web.Response:
        body = await _body(request, required=False)
        try:
            reason = DrainBody.model_validate(body if body is not None else {}).reason
        except ValidationError as exc:
            raise ApiError(422, "invalid drain request", _pydantic_errors(exc)) from None
        return await self._rollout_action(request.match_info["id"], "drain", reason)

    async def _resume(self, request: web.Request) -> web.Response:
        return await self._rollout_action(request.match_info["id"], "resume", "")

    async def _rollout_action(
        self, rid: str, action: Literal["drain", "resume"], reason: str
    ) -> web.Response:
        member = self.manager.members.get(rid)
        if member is None or member.role != "rollout":
            raise ApiError(404, "unknown rollout", {"rollout": rid})
        if member.state != "alive":
            detail = {"rollout": rid, "reason": member.reason}
            raise ApiError(409, f"rollout is {member.state}", detail)
        api = self.manager.ctx.connect(RolloutApi, member.address)
        try:
            if action == "drain":
                state = await api.drain.options(timeout=ACTION_TIMEOUT_S).call(
                    DrainRequest(reason=reason or "operator")
                )
            else:
                state = await api.resume.options(timeout=ACTION_TIMEOUT_S).call()
        except CallTimeout as exc:
            raise ApiError(504, f"{rid} did not answer", str(exc)) from None
        except UnknownMethod as exc:
            raise ApiError(502, f"{rid} does not support {action}", str(exc)) from None
        except (PeerUnavailable, RemoteError, OSError) as exc:
            cause = f"{type(exc).__name__}: {exc}"
            raise ApiError(502, f"{action} failed on {rid}", cause) from None
        event = self.manager.events.publish(
            action,
            self.manager.ctx.clock.wall(),
            rollout=rid,
            by="operator",
            reason=reason,
            phase=state.phase,
            in_flight=state.in_flight,
            version=state.version,
        )
        self.manager.log.info(f"rollout {action}", rollout=rid, reason=reason)
        result = RolloutActionResult(
            rollout=rid,
            action=action,
            state=state,
            event=event.seq,
        )
        return _json(result)

    # -- events ------------------------------------------------------------------------------

    async def _events(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        since = _int(q.get("since"), "since")
        last_id = _int(request.headers.get("Last-Event-ID"), "Last-Event-ID")
        start = max(x for x in (since, last_id, 0) if x is not None)
        fmt = q.get("format", "sse")
        if fmt == "json":
            kinds = {k for k in q.get("kind", "").split(",") if k} or None
            limit = _int(q.get("limit"), "limit")
            return _json(self.manager.events.recent(start, kinds, limit or None))
        if fmt != "sse":
            raise ApiError(400, "format must be sse or json", fmt)
        return await self._sse(request, start)

    async def _sse(self, request: web.Request, since: int) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=10_000)

        async def pump() -> None:
            async for event in self.manager.events.follow(since):
                await queue.put(event)

        me = asyncio.current_task()
        if me is not None:
            self._streams.add(me)
        feeder = asyncio.create_task(pump())
        clock = self.manager.ctx.clock
        try:
            await resp.write(b"retry: 1000\n: connected\n\n")
            last_write = clock.time()
            while not self._closing.is_set():
                timeout = max(0.0, SSE_HEARTBEAT_S - (clock.time() - last_write))
                try:
                    async with asyncio.timeout(timeout):
                        event = await queue.get()
                except TimeoutError:
                    await resp.write(b": keepalive\n\n")
                    last_write = clock.time()
                    continue
                data = event.model_dump_json()
                chunk = f"id: {event.seq}\nevent: {event.kind}\ndata: {data}\n\n"
                await resp.write(chunk.encode())
                last_write = clock.time()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            feeder.cancel()
            await asyncio.wait([feeder])  # not `await feeder` under a suppressed CancelledError
            if not feeder.cancelled():
                feeder.exception()  # retrieved: the stream ends either way
            if me is not None:
                self._streams.discard(me)
        return resp


async def _body(request: web.Request, *, required: bool) -> Any:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise ApiError(400, "a JSON body is required")
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "malformed JSON", str(exc)) from None


def _pydantic_errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [
        {"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"], "type": e["type"],
         "input": e.get("input") if isinstance(e.get("input"), (int, float, str, bool)) else None}
        for e in exc.errors()
    ]  # fmt: skip
