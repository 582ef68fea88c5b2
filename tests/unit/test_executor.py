"""Executors (:mod:`laminar.runtime.executor`): the in-loop one the in-process cluster runs roles on, the
thread one production uses, and the context that owns a role's executors.

The in-loop executor is what makes an in-process run repeatable, so its promises are checked on
virtual time, exactly: a call runs ``cost_s`` after it was submitted, in submission order, its
exception reaches the caller, and a call whose caller gave up never runs.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, ClassVar

import pytest

from laminar.runtime.clock import run_virtual
from laminar.runtime.config import ServiceConfig
from laminar.runtime.context import ServiceContext
from laminar.runtime.executor import (
    LOOP_DEFAULT,
    Executor,
    ExecutorClosed,
    InLoopExecutor,
    ThreadExecutor,
)
from laminar.runtime.service import Service, ServiceHost

# -- in the loop, on virtual time -----------------------------------------------------------------


def test_in_loop_calls_run_in_submission_order_after_their_cost() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        ex = InLoopExecutor("store", cost_s=0.001)
        ran: list[tuple[str, float]] = []

        def call(name: str) -> str:
            ran.append((name, loop.time()))
            return name.upper()

        async def later(name: str, delay: float) -> str:
            await asyncio.sleep(delay)
            return await ex.run(call, name)

        # submitted at t=0 (a, b, c: one instant, in this order) and at t=0.0005 (d)
        results = await asyncio.gather(
            ex.run(call, "a"), later("d", 0.0005), ex.run(call, "b"), ex.run(call, "c")
        )
        assert results == ["A", "D", "B", "C"]
        return ran

    ran = run_virtual(main())
    assert [name for name, _ in ran] == ["a", "b", "c", "d"]
    assert [round(t, 9) for _, t in ran] == [0.001, 0.001, 0.001, 0.0015]


def test_in_loop_exceptions_reach_the_caller_and_the_queue_goes_on() -> None:
    async def main() -> None:
        ex = InLoopExecutor(cost_s=0.01)

        def fail() -> None:
            raise ValueError("disk full")

        failing = asyncio.ensure_future(ex.run(fail))
        after = asyncio.ensure_future(ex.run(lambda: "next"))
        with pytest.raises(ValueError, match="disk full"):
            await failing
        assert await after == "next"

    run_virtual(main())


def test_in_loop_call_of_a_cancelled_caller_never_runs_and_close_cancels_the_rest() -> None:
    async def main() -> None:
        ex = InLoopExecutor(cost_s=1.0)
        ran: list[str] = []
        gave_up = asyncio.ensure_future(ex.run(ran.append, "gave up"))
        kept = asyncio.ensure_future(ex.run(ran.append, "kept"))
        await asyncio.sleep(0.5)
        gave_up.cancel()
        assert await kept is None
        assert ran == ["kept"]

        pending = asyncio.ensure_future(ex.run(ran.append, "pending"))
        await asyncio.sleep(0)
        ex.close()
        with pytest.raises(asyncio.CancelledError):
            await pending
        with pytest.raises(ExecutorClosed, match="closed"):
            await ex.run(ran.append, "late")
        await asyncio.sleep(2.0)
        assert ran == ["kept"]

    run_virtual(main())


# -- threads ------------------------------------------------------------------------------------


async def test_one_thread_runs_every_call_in_order_in_its_named_thread() -> None:
    ex = ThreadExecutor("data-store", workers=1)
    try:
        seen: list[tuple[int, str]] = []

        def call(i: int) -> int:
            seen.append((i, threading.current_thread().name))
            return i * i

        results = await asyncio.gather(*(ex.run(call, i) for i in range(8)))
        assert results == [i * i for i in range(8)]
        assert [i for i, _ in seen] == list(range(8))
        names = {name for _, name in seen}
        assert len(names) == 1 and names.pop().startswith("data-store")
        assert threading.current_thread().name not in {name for _, name in seen}
    finally:
        ex.close()


async def test_threads_run_side_by_side_carry_context_and_raise_to_the_caller() -> None:
    ex = ThreadExecutor("crc", workers=2)
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    var.set("caller's")
    meet = threading.Barrier(2, timeout=10)  # two workers: both calls are in at once

    def call() -> str:
        meet.wait()
        return var.get()

    try:
        assert await asyncio.gather(ex.run(call), ex.run(call)) == ["caller's", "caller's"]
        with pytest.raises(ZeroDivisionError):
            await ex.run(lambda: 1 / 0)
    finally:
        ex.close()
    with pytest.raises(ExecutorClosed):
        await ex.run(call)


async def test_the_loop_default_runs_off_the_loop() -> None:
    assert await LOOP_DEFAULT.run(threading.current_thread) is not threading.current_thread()


# -- owned by the service context ---------------------------------------------------------------


class Recorder:
    made: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, name: str, workers: int) -> None:
        Recorder.made.append((name, workers))
        self.inner = InLoopExecutor(name, cost_s=0.0)
        self.closed = False

    async def run(self, fn: Any, *args: Any) -> Any:
        return await self.inner.run(fn, *args)

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class UsesAnExecutor(Service):
    role: ClassVar[str] = "uses"

    async def on_start(self) -> None:
        self.executor = self.ctx.executor("work", workers=2)
        assert await self.executor.run(sum, [1, 2, 3]) == 6


async def test_the_context_makes_names_once_through_its_factory_and_closes_them_at_stop(
    cluster: Any, options: Any
) -> None:
    Recorder.made.clear()
    ctx = ServiceContext(
        role="uses",
        instance="uses-0",
        cluster=cluster,
        config=ServiceConfig(bind="inproc://*", metrics=None),
        options=options,
        executors=Recorder,
    )
    host = ServiceHost(UsesAnExecutor, ctx)
    task = asyncio.create_task(host.run())
    service = await host.started()
    executor = service.executor  # type: ignore[attr-defined]
    assert isinstance(executor, Executor)
    assert ctx.executor("work", workers=2) is executor  # one executor per name
    with pytest.raises(ValueError, match="2 workers, not 1"):
        ctx.executor("work")
    assert Recorder.made == [("work", 2)]
    assert not executor.closed
    host.stop()
    await asyncio.wait_for(task, 10)
    assert executor.closed


def test_threads_unless_the_host_says_otherwise(cluster: Any, options: Any) -> None:
    ctx = ServiceContext(
        role="uses", instance="uses-0", cluster=cluster, config=ServiceConfig(), options=options
    )
    executor = ctx.executor("data-store")
    try:
        assert isinstance(executor, ThreadExecutor) and executor.workers == 1
    finally:
        ctx.close_executors()
