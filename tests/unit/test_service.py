"""The service runtime: metrics served, owned tasks, graceful stop (a service's own tasks end
before its ``on_stop``), crash propagation."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import aiohttp
import pytest

from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.service import Service, ServiceHost
from tests.support.poll import STOP_S, until
from tests.support.roles import Calculator, Pair, Sleep


async def test_metrics_endpoint_counts_rpc_calls(serve, options) -> None:  # type: ignore[no-untyped-def]
    host, _ = await serve(Calculator, config=Calculator.config_model(metrics="127.0.0.1:0"))
    client = RpcClient(host.ctx.address, options)
    for i in range(3):
        await remote(Calculator, client).add.call(Pair(a=i, b=1))
    await client.close()
    metrics = host.metrics_address  # "host:port"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{metrics}/metrics") as resp:
            text = await resp.text()
        async with session.get(f"http://{metrics}/healthz") as resp:
            assert (await resp.json()) == {"ok": True}
    line = next(
        x
        for x in text.splitlines()
        if x.startswith("laminar_rpc_calls_total{") and 'method="add"' in x
    )
    assert 'outcome="ok"' in line and line.endswith(" 3.0")


async def test_healthz_says_whether_the_event_loop_runs(serve) -> None:  # type: ignore[no-untyped-def]
    """The metrics server answers on a thread of its own; ``/healthz`` asks the service's event
    loop to run a callback. Asked from a thread, the loop runs it: 200. Asked synchronously from
    the loop itself (so the loop is blocked until the answer comes): 503, after the wait."""
    import json
    import urllib.error
    import urllib.request

    host, _ = await serve(Calculator, config=Calculator.config_model(metrics="127.0.0.1:0"))
    url = f"http://{host.metrics_address}/healthz"

    def get() -> tuple[int, dict[str, object]]:
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    assert await asyncio.to_thread(get) == (200, {"ok": True})
    code, body = get()  # on the loop's own thread: the loop cannot answer
    assert code == 503 and body["ok"] is False, body
    assert "event loop" in str(body["error"])
    assert await asyncio.to_thread(get) == (200, {"ok": True})  # and it answers again


async def sleep_until_cancelled(events: list[str]) -> None:
    """A background task's life: nothing until it is cancelled, which ``events`` records."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        events.append("task cancelled")
        raise


class Lifecycle(Service):
    role: ClassVar[str] = "lifecycle"
    events: ClassVar[list[str]] = []

    async def on_start(self) -> None:
        self.spawn(self._forever(), name="forever")

    async def _forever(self) -> None:
        await sleep_until_cancelled(Lifecycle.events)

    async def on_stop(self) -> None:
        Lifecycle.events.append("on_stop")


class Crashing(Service):
    role: ClassVar[str] = "crashing"
    events: ClassVar[list[str]] = []

    async def on_start(self) -> None:
        self.spawn(self._boom(), name="boom")

    async def _boom(self) -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("background task failed")

    async def on_stop(self) -> None:
        await asyncio.sleep(0)  # on_stop may await, though its task is being cancelled
        Crashing.events.append("on_stop")


def _host(cls: type[Service], cluster, options) -> ServiceHost:  # type: ignore[no-untyped-def]
    ctx = ServiceContext(
        role=cls.role,
        instance=f"{cls.role}-0",
        cluster=cluster,
        config=ServiceConfig(metrics=None),
        options=options,
    )
    return ServiceHost(cls, ctx)


async def test_graceful_stop_ends_owned_tasks_then_runs_on_stop(cluster, options) -> None:  # type: ignore[no-untyped-def]
    Lifecycle.events.clear()
    before = len(asyncio.all_tasks())
    host = _host(Lifecycle, cluster, options)
    task = asyncio.create_task(host.run())
    await host.started()
    host.stop()
    await asyncio.wait_for(task, 5)
    assert Lifecycle.events == ["task cancelled", "on_stop"]
    assert len(asyncio.all_tasks()) == before  # nothing left behind


async def test_crashing_owned_task_stops_the_service_and_runs_on_stop(cluster, options) -> None:  # type: ignore[no-untyped-def]
    Crashing.events.clear()
    host = _host(Crashing, cluster, options)
    with pytest.raises(ExceptionGroup) as info:
        await asyncio.wait_for(host.run(), 5)
    assert info.group_contains(RuntimeError, match="background task failed")
    assert Crashing.events == ["on_stop"]  # what on_start acquired is released on a crash too


async def test_cancelled_run_still_runs_on_stop(cluster, options) -> None:  # type: ignore[no-untyped-def]
    Lifecycle.events.clear()
    host = _host(Lifecycle, cluster, options)
    task = asyncio.create_task(host.run())
    await host.started()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert Lifecycle.events == ["task cancelled", "on_stop"]


async def test_local_notifies_are_owned_by_their_service(cluster, options) -> None:  # type: ignore[no-untyped-def]
    """A local ``notify`` is not left running when the service that received it stops."""
    host = _host(Calculator, cluster, options)
    task = asyncio.create_task(host.run())
    service = await host.started()
    before = len(asyncio.all_tasks())
    service.sleep.notify(Sleep(seconds=3600, tag="local"))
    await until(_async(lambda: service.started == ["local"]), 5)
    assert len(asyncio.all_tasks()) == before + 1
    host.stop()
    await asyncio.wait_for(task, 5)
    assert service.cancelled == ["local"]


class Promising(Service):
    """Work promised to a caller (``run_to_end``: the data role's report, a rollout's migration)
    under way when the service is told to stop, beside a background task."""

    role: ClassVar[str] = "promising"
    events: ClassVar[list[str]] = []

    async def on_start(self) -> None:
        self.spawn(self._forever(), name="forever")

    async def _forever(self) -> None:
        await sleep_until_cancelled(Promising.events)

    async def promised(self, started: asyncio.Event) -> str:
        started.set()
        await asyncio.sleep(0.3)
        self.spawn(self._forever(), name="started by promised work")  # still allowed
        Promising.events.append("promised work done")
        return "done"

    async def on_stop(self) -> None:
        try:
            self.spawn(asyncio.sleep(0), name="late")
        except RuntimeError as exc:
            Promising.events.append(f"on_stop: {exc}")


async def test_a_stop_lets_promised_work_finish_then_ends_tasks_and_refuses_new_ones(
    cluster, options
) -> None:  # type: ignore[no-untyped-def]
    """The stop's order: work promised to a caller finishes (and may start a task meanwhile),
    then every owned task is cancelled, then ``on_stop`` runs. From the stop on, new promised
    work is refused, and once the tasks are being ended new tasks are too, each with an error
    that says so (an endpoint's caller gets it), not a task left running into ``on_stop``."""
    Promising.events.clear()
    host = _host(Promising, cluster, options)
    task = asyncio.create_task(host.run())
    service = await host.started()
    assert isinstance(service, Promising)
    started = asyncio.Event()
    caller = asyncio.create_task(service.ctx.run_to_end(service.promised(started), name="p"))
    await started.wait()
    host.stop()
    # the stop has begun: it waits for the promised work
    await until(lambda: asyncio.sleep(0, service.ctx._no_new_work), STOP_S)
    with pytest.raises(RuntimeError, match="promising-0 is stopping: refused not started"):
        await service.ctx.run_to_end(asyncio.sleep(0), name="refused")
    assert await asyncio.wait_for(caller, 5) == "done"
    await asyncio.wait_for(task, 5)
    assert Promising.events == [
        "promised work done",
        "task cancelled",  # both: the one from on_start and the one the promised work started
        "task cancelled",
        "on_stop: promising-0 is stopping: late not started",
    ]


def _async(probe):  # type: ignore[no-untyped-def]
    async def run():  # type: ignore[no-untyped-def]
        return probe()

    return run


class SlowStart(Service):
    """A role whose on_start takes a while (a rollout starting vLLM)."""

    role: ClassVar[str] = "slow"
    release: ClassVar[asyncio.Event]
    entered: ClassVar[asyncio.Event]
    stop_s: ClassVar[float] = 0.0

    async def on_start(self) -> None:
        SlowStart.entered.set()
        await SlowStart.release.wait()

    async def on_stop(self) -> None:
        if SlowStart.stop_s:  # else no await at all: the leave is the next thing that yields
            await asyncio.sleep(SlowStart.stop_s)


@pytest.mark.parametrize("stop_s", [0.0, 0.5], ids=["quick-stop", "slow-stop"])
async def test_a_role_stopped_while_it_starts_leaves_and_is_not_lost(
    serve, cluster, options, stop_s
):  # type: ignore[no-untyped-def]
    """Ctrl-C (or a run's budget) during a rollout's vLLM start: the role stops as soon as
    on_start is done; the manager must see it leave (or never join), not lose its connection (a
    warning "member dead" for every rollout of a run stopped while they started: the leave went
    out before the join). With a slow on_stop (a rollout closing its engine) the join is made
    meanwhile, then the leave."""
    from laminar.roles.manager import ManagerConfig, ManagerService

    manager_host, manager = await serve(
        ManagerService, config=ManagerConfig(bind="tcp://127.0.0.1:0", metrics=None, admin=None)
    )
    SlowStart.release, SlowStart.entered, SlowStart.stop_s = (
        asyncio.Event(),
        asyncio.Event(),
        stop_s,
    )
    ctx = ServiceContext(
        role="slow", instance="slow-0", cluster=cluster,
        config=ServiceConfig(metrics=None), options=options,
    )  # fmt: skip
    host = ServiceHost(SlowStart, ctx, manager=manager_host.ctx.address)
    task = asyncio.create_task(host.run())
    await asyncio.wait_for(SlowStart.entered.wait(), 10)  # in on_start
    host.stop()  # the signal arrives while it starts
    SlowStart.release.set()
    await asyncio.wait_for(task, 10)
    member = manager.members.get("slow-0")
    if stop_s:
        assert member is not None and member.state == "left", member
    else:
        assert member is None or member.state == "left", member


async def test_run_to_end_outlives_its_caller_and_says_what_failed_after(cluster, options) -> None:  # type: ignore[no-untyped-def]
    """``ServiceContext.run_to_end``: the work goes on when its caller is cancelled (an endpoint
    whose connection closed), an error reaches a caller still waiting, and an error with no
    caller left is logged, not lost."""
    from structlog.testing import capture_logs

    gate, finished = asyncio.Event(), []

    async def work(fail: bool) -> int:
        await gate.wait()
        finished.append(fail)
        if fail:
            raise ValueError("bad item")
        return 7

    with capture_logs() as logs:  # before the context binds its logger
        ctx = ServiceContext(
            role="r", instance="r-0", cluster=cluster, config=ServiceConfig(), options=options
        )
        caller = asyncio.ensure_future(ctx.run_to_end(work(False), name="ok"))
        failing = asyncio.ensure_future(ctx.run_to_end(work(True), name="bad"))
        await asyncio.sleep(0)
        caller.cancel()
        failing.cancel()
        gate.set()
        for _ in range(5):
            await asyncio.sleep(0)
    assert sorted(finished) == [False, True]  # both ran to their end without their callers
    assert [(e["event"], e["task"]) for e in logs] == [("failed after its caller left", "r-0:bad")]
    assert "bad item" in logs[0]["error"]
    with pytest.raises(ValueError, match="bad item"):  # a caller still there gets the error
        await ctx.run_to_end(work(True), name="bad")
    assert await ctx.run_to_end(work(False), name="ok") == 7
    assert not ctx._tasks  # finished work is forgotten; what still runs is the stop's to cancel
