"""The reward worker processes of a :class:`.rewards.RewardPool`: start, call, end.

A reward is user code, and it may run code the model wrote: it may be slow, raise, loop forever,
leak memory, fork, or go looking for the cluster token. So it never runs on the data role's
event loop or even in its process. Each worker is an exec'd process
(:mod:`laminar.roles.data.reward_worker`)
serving one job at a time over a pair of pipes; the parent waits with ``loop.add_reader`` (no
thread per job).

What a worker gets (:class:`RewardSandbox`): an environment without the cluster token, without any
other ``LAMINAR_*`` variable (the run's and the role's process marks aside), without any variable
holding the token's value and without those named in ``drop_env``; a process group of its own;
resource limits (address space, CPU time, optionally processes) that what it starts inherits. A
job that overruns its timeout gets its worker's whole process group killed, then every process
still carrying the worker's mark (one that called ``setsid`` too), and the worker replaced: a
reward that forks leaves nothing behind (nor when the data role dies: ``laminar run`` then kills
what carries the role's incarnation mark). Replies are JSON read without blocking, at most 64
KiB; one that is not a well-formed reply (a result per item: a finite reward or a reason, and
extras that are finite numbers) retires the worker (never unpickled: a worker's bytes are not
code the role runs). The user's guide is ``docs/rewards.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Annotated, Any

from pydantic import Field

from laminar.proc import procfs
from laminar.proc.exitwait import fd_ready
from laminar.roles.data.reward_worker import MAX_REPLY_BYTES, WORKER_MARK
from laminar.runtime.config import Strict
from laminar.runtime.executor import Executor

MALFORMED = "worker sent a malformed reply"
#: Seconds a new worker may take to start and load the reward (not counted in ``timeout_s``).
STARTUP_S = 60.0

#: Thread pools a worker starts with one thread unless the environment says otherwise: a worker
#: runs one call at a time (``reward_workers`` is the parallelism), and every idle thread's
#: arena counts against ``memory_mib``.
ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class RewardSandbox(Strict):
    """What a reward worker may use. Limits are per process, inherited by what it starts."""

    memory_mib: Annotated[int, Field(ge=64)] | None = Field(
        8192,
        description="Address-space limit (RLIMIT_AS) of each reward worker process, MiB: an "
        "allocation beyond it raises MemoryError in the reward (no reward, the worker lives on). "
        "Virtual memory, so a reward importing torch or CUDA libraries needs more; null: none.",
    )
    cpu_s: Annotated[int, Field(ge=1)] | None = Field(
        600,
        description="CPU seconds any reward worker process may use (RLIMIT_CPU). A worker past "
        "half of it is replaced after its call, so every call has at least half; a call over it "
        "is killed (SIGXCPU, no reward). Bounds what a reward leaves running too; null: none.",
    )
    max_processes: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="RLIMIT_NPROC of the workers (a fork-bomb guard). The kernel counts every "
        "process and thread of the user, not only the worker's, and not at all for root: set it "
        "only when the data role runs as a user of its own. null: none.",
    )
    drop_env: list[str] = Field(
        default_factory=list,
        description="More environment variables kept from reward workers: names or fnmatch "
        "patterns (e.g. `AWS_*`, `WANDB_API_KEY`). The cluster token's variable, any variable "
        "holding its value and every `LAMINAR_*` (but the run's and the role's process marks) are "
        "always dropped.",
    )


@dataclass(frozen=True, slots=True)
class RewardResult:
    reward: float | None
    error: str | None = None
    extras: Mapping[str, float] = field(default_factory=dict)  # numeric fields of a dict result


def worker_env(token_env: str, drop: list[str], mark: str) -> dict[str, str]:
    """The data role's environment, less what a reward must not see (see :class:`RewardSandbox`)."""
    token = os.environ.get(token_env) or None
    env = {}
    marks = (procfs.MARK_ENV, procfs.INCARNATION_ENV)  # how a run ends what a reward left
    for name, value in os.environ.items():
        secret = name == token_env or (name.startswith("LAMINAR_") and name not in marks)
        if secret or (token and token in value) or any(fnmatchcase(name, p) for p in drop):
            continue
        env[name] = value
    for name in ONE_THREAD:
        env.setdefault(name, "1")
    name, _, value = mark.partition("=")
    env[name] = value
    return env


class WorkerFailed(Exception):
    """The worker cannot answer: it died (``died``: the message comes from its exit status), or
    broke the protocol, or did not start."""

    def __init__(self, message: str = "", *, died: bool = False) -> None:
        super().__init__(message)
        self.died = died


def exit_text(code: int | None) -> str:
    if code == -signal.SIGXCPU:
        return f"worker died (exit {code}: SIGXCPU, over its CPU limit cpu_s)"
    return f"worker died (exit {code})" if code is not None else "worker died"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _result(item: dict[str, Any]) -> RewardResult:
    """One item of a worker's reply, checked: a finite reward or a reason (exactly one), and
    extras that are finite numbers under metric names. Anything else is a ``ValueError``."""
    reward, error, extras = item["reward"], item["error"], item["extras"]
    if (
        not (reward is None or _number(reward))
        or not (error is None or isinstance(error, str))
        or (reward is None) == (error is None)
        or not isinstance(extras, dict)
        or not all(isinstance(k, str) and len(k) <= 160 and _number(v) for k, v in extras.items())
    ):
        raise ValueError(item)
    number = None if reward is None else float(reward)
    return RewardResult(number, error, {k: float(v) for k, v in extras.items()})


class RewardWorker:
    def __init__(
        self, scoring: dict[str, Any], sandbox: RewardSandbox, token_env: str, executor: Executor
    ) -> None:
        """``scoring``: what the worker scores with (its functions, their kinds, the
        ``reward_kwargs``, the prompt's key), as :func:`laminar.roles.data.reward_worker.main`
        reads it."""
        self.executor = executor  # where :meth:`finish` blocks
        self.mark = f"{WORKER_MARK}={secrets.token_hex(8)}"
        jobs_r, self.jobs = os.pipe()
        self.results, results_w = os.pipe()
        args = {
            **scoring,
            "parent": os.getpid(),
            "jobs": jobs_r,
            "results": results_w,
            "path": sys.path,
            "limits": sandbox.model_dump(include={"memory_mib", "cpu_s", "max_processes"}),
        }
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "laminar.roles.data.reward_worker", json.dumps(args)],
                env=worker_env(token_env, sandbox.drop_env, self.mark),
                stdin=subprocess.DEVNULL,
                stdout=2,  # a reward's print() goes to the role's stderr, never its stdout
                pass_fds=(jobs_r, results_w),
                process_group=0,  # its own group: killed whole on a timeout
            )
        except BaseException:
            for fd in (self.jobs, self.results):
                os.close(fd)
            raise
        finally:
            os.close(jobs_r)
            os.close(results_w)
        os.set_blocking(self.jobs, False)
        os.set_blocking(self.results, False)
        self.ready = False  # its ready line is read before its first job is sent
        self.ending: asyncio.Future[int | None] | None = None  # once it is being ended

    async def start(self) -> None:
        """Wait for its ready line (the reward function loaded), at most ``STARTUP_S``: a call's
        timeout counts the call, not the interpreter starting on a busy machine."""
        if self.ready:
            return
        try:
            async with asyncio.timeout(STARTUP_S):
                line = await self._line()
        except TimeoutError:
            raise WorkerFailed(f"worker did not start within {STARTUP_S:g}s") from None
        try:
            self.ready = json.loads(line) == {"ready": True}
        except ValueError:
            pass
        if not self.ready:
            raise WorkerFailed(MALFORMED)

    async def call(self, payload: bytes, n: int) -> tuple[list[RewardResult], float]:
        """Send one job of ``n`` items, read its reply: a result per item, and the worker's CPU
        seconds used."""
        view = memoryview(payload)
        while view:
            try:
                view = view[os.write(self.jobs, view) :]
            except BlockingIOError:
                await fd_ready(self.jobs, write=True)
            except OSError:  # EPIPE: it is gone
                raise WorkerFailed(died=True) from None
        line = await self._line()
        try:
            reply = json.loads(line)
            items, cpu = reply["results"], float(reply["cpu_s"])
            results = [_result(item) for item in items]
        except (ValueError, TypeError, KeyError, AttributeError):
            raise WorkerFailed(MALFORMED) from None
        if len(results) != n:
            raise WorkerFailed(MALFORMED)
        return results, cpu

    async def _line(self) -> bytes:
        """One line from the results pipe, without blocking the loop; nothing may follow it (the
        worker waits for its next job), and it is at most ``MAX_REPLY_BYTES``."""
        buffer = bytearray()
        while (end := buffer.find(b"\n")) < 0:
            try:
                chunk = os.read(self.results, MAX_REPLY_BYTES)
            except BlockingIOError:
                await fd_ready(self.results)
                continue
            if not chunk:
                raise WorkerFailed(died=True)
            buffer += chunk
            if len(buffer) > MAX_REPLY_BYTES:
                raise WorkerFailed(f"worker sent a reply over {MAX_REPLY_BYTES} bytes")
        if end != len(buffer) - 1:
            raise WorkerFailed(MALFORMED)
        return bytes(buffer[:end])

    def kill_group(self) -> None:
        """SIGKILL its process group, at once. Only while it is not reaped: until then its pid,
        which names the group, cannot be anyone else's."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def finish(self, died: bool = False) -> int | None:
        """End it and everything it started; its exit status. Blocks (reaps, reads ``/proc``):
        run it in the pool's executor. A worker that died gets a moment to report its own status
        first."""
        if died:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1.0)
        self.kill_group()
        procfs.signal_marked(self.mark, signal.SIGKILL)  # what left the group or outlived it
        code = self.process.wait()
        os.close(self.jobs)
        os.close(self.results)
        return code

    def end(self, died: bool = False) -> asyncio.Future[int | None]:
        """End it (once, however many ask): its group killed at once unless it died by itself,
        the rest (:meth:`finish`) in the executor. Await the result for its exit status."""
        if self.ending is None:
            if not died:
                self.kill_group()
            self.ending = asyncio.ensure_future(self.executor.run(self.finish, died))
        return self.ending
