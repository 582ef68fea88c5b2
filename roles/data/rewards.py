"""Reward functions as plug-ins, run in worker processes with a hard timeout.

A task's reward is a plain function ``reward(record: dict, response: str) -> float`` named as
``module:function`` (importable) or ``path/to/file.py:function``. It is user code: it may be slow,
raise, loop forever, or leak memory. So it never runs on the data role's event loop or even in its
process. Each :class:`RewardPool` worker is a spawned process serving one job at a time over a
pipe; the parent waits with ``loop.add_reader`` (no thread per job). A job that overruns
``timeout_s`` gets its worker killed and replaced, which a ``concurrent.futures`` pool cannot do.

Outcomes are values, never exceptions: :class:`RewardResult` has either a reward or the reason
there is none ("raised ValueError: ...", "timed out after 5.0s", "returned 'abc', not a number",
"worker died (exit -9)"). The data role records the reason beside the trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from laminar.errors import ConfigError
from laminar.plugins import load_object


@dataclass(frozen=True, slots=True)
class RewardResult:
    reward: float | None
    error: str | None = None


def load_function(spec: str) -> Callable[..., Any]:
    """Resolve ``module:function`` or ``path.py:function`` (relative to the working directory)."""
    fn = load_object(spec, what="reward")
    if not callable(fn):
        raise ConfigError(f"reward {spec!r} is not a function")
    return fn


def _worker_main(conn: Connection, spec: str) -> None:
    fn = load_function(spec)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        record, response = job
        try:
            value = fn(record, response)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                conn.send((None, f"returned {value!r}, not a number"))
            elif not math.isfinite(value):
                conn.send((None, f"returned {value!r}, not a finite number"))
            else:
                conn.send((float(value), None))
        except Exception as exc:
            conn.send((None, f"raised {type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, spec: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, spec), daemon=True)
        self.process.start()
        child.close()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    def __init__(self, spec: str, *, workers: int = 1, timeout_s: float = 10.0) -> None:
        load_function(spec)  # fail fast, in the parent, with a clear error
        self.spec = spec
        self.timeout_s = timeout_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        for _ in range(workers):
            self._add_worker()

    def _add_worker(self) -> None:
        worker = _Worker(self.spec)
        self._all.add(worker)
        self._idle.put_nowait(worker)

    def _retire(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.kill()
        self._add_worker()

    async def score(self, record: dict[str, Any], response: str) -> RewardResult:
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RewardResult] = loop.create_future()

        def readable() -> None:
            try:
                reward, error = worker.conn.recv()
                result = RewardResult(reward, error)
            except (EOFError, OSError):
                worker.process.join(timeout=1)
                result = RewardResult(None, f"worker died (exit {worker.process.exitcode})")
            if not done.done():
                done.set_result(result)

        try:
            worker.conn.send((record, response))
        except (BrokenPipeError, OSError):
            self._retire(worker)
            return RewardResult(None, "worker died before the job was sent")
        loop.add_reader(worker.conn.fileno(), readable)
        try:
            result = await asyncio.wait_for(done, self.timeout_s)
        except TimeoutError:
            result = RewardResult(None, f"timed out after {self.timeout_s}s")
        except asyncio.CancelledError:  # the job may still run: this worker is not reusable
            loop.remove_reader(worker.conn.fileno())
            self._retire(worker)
            raise
        loop.remove_reader(worker.conn.fileno())
        if result.error is not None and (
            result.error.startswith(("timed out", "worker died")) or not worker.process.is_alive()
        ):
            self._retire(worker)
        else:
            self._idle.put_nowait(worker)
        return result

    async def close(self) -> None:
        for worker in list(self._all):
            with contextlib.suppress(Exception):
                worker.conn.send(None)
            worker.kill()
        self._all.clear()
