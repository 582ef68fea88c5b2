"""Running untrusted tool code (an agent's Python or calculator call): limits, no network, no token.

Why its own module: an agentic episode hands a model's text to an interpreter, and the model is
being trained to do whatever earns reward. Whatever it writes (an infinite loop, a fork bomb, a
gigabyte of output, a connection to the cluster, a read of the cluster's token) must fail that
turn with a reason, and nothing else: not the data role, not the machine, not the run.

:func:`run_python` hands the code to this process's jail server (:mod:`.jailserver`: :mod:`.jail`
run as a fork server, started on first use), which forks a jail for it: the tool runs in new
network and PID namespaces, under CPU, memory, process and file-size limits and (as root) a user
of its own (claimed: :mod:`.uids`), isolated (``-I -S``), in a fresh directory the jail makes and
removes, with a minimal environment (``PATH``, ``HOME`` = that directory, ``LANG``; nothing of the
caller's, so no token). A call costs a fork of a small warm interpreter, not the start of two
(:mod:`.jail` says why), and the caller's event loop does next to nothing for it: no files, no
scan of ``/proc`` when the jail ends by itself (a tool-calling data role spent most of its CPU
on them otherwise: docs/benchmarks.md, *Learning*). Here, in the caller:

* **wall clock**: past ``wall_s`` the jail is told to stop, kills the tool and reaps it, and the
  tool's death empties its PID namespace (a jail that does not stop is killed; the tool then
  dies by its parent-death signal); a call whose task is cancelled kills its jail at once;
* **output**: stdout and stderr are read as they come, at most ``output_bytes`` each; past that the
  tool is killed and the turn fails (``output over N bytes``), so a flood costs bounded memory;
* **afterwards**: a jail that ended by itself has killed what its tool left and removed the
  directory; after one that was stopped (or whose server died), every process still running as
  the tool's uid is killed (as root) and the directory removed, on a worker thread.

A result always comes back (:class:`ToolResult`): ``ok`` with the output, or not with a
``reason`` (``timed out after 5 s``, ``cpu limit (5 s)``, ``killed by SIGKILL``, ``exit status
1``, ``output over 65536 bytes``, ``sandbox unavailable: ...``).

Where isolation is impossible (not root and no unprivileged user namespaces), every call fails
with the jail's reason; :func:`check_sandbox` says so up front (``laminar doctor`` can ask).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field

from laminar.runtime.config import Strict

from .jail import SETUP_FAILED
from .jailserver import JailCall, JailServer, JailServerGone
from .uids import CLAIMS, SANDBOX_UIDS

__all__ = ["SANDBOX_UIDS", "SandboxLimits", "ToolResult", "check_sandbox", "run_python"]


class SandboxLimits(Strict):
    """What one tool call may use."""

    wall_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        10.0, description="Wall-clock seconds before the call is killed."
    )
    cpu_s: Annotated[int, Field(ge=1)] = Field(5, description="CPU seconds (RLIMIT_CPU).")
    memory_mib: Annotated[int, Field(ge=64)] = Field(
        512, description="Address space per process, MiB (RLIMIT_AS)."
    )
    max_processes: Annotated[int, Field(ge=1)] = Field(
        16, description="Processes and threads (RLIMIT_NPROC, for the tool's own uid)."
    )
    file_mib: Annotated[int, Field(ge=1)] = Field(
        16, description="Largest file the tool may write, MiB (RLIMIT_FSIZE)."
    )
    output_bytes: Annotated[int, Field(ge=1024)] = Field(
        65536, description="Most bytes of stdout (and of stderr) kept; more fails the call."
    )


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    stdout: str
    stderr: str
    exit_status: int | None  # None: killed by the sandbox before it exited
    reason: str | None  # why it failed (None when ok)
    wall_s: float
    uid: int | None = None  # the user it ran as (as root: its own, unused by anything else)


class _Overflow(Exception):
    pass


async def _read(stream: asyncio.StreamReader, limit: int, into: bytearray) -> None:
    while chunk := await stream.read(65536):
        into += chunk[: limit + 1 - len(into)]
        if len(into) > limit:
            raise _Overflow


def _others_may_run(path: str) -> bool:
    """Whether a user of no group of ours may execute ``path`` (every directory on the way
    searchable, the file readable and executable by others)."""
    real = Path(os.path.realpath(path))
    try:
        for parent in real.parents:
            if not parent.stat().st_mode & stat.S_IXOTH:
                return False
        mode = real.stat().st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)


@functools.cache
def interpreter(root: bool) -> str:
    """The Python the jail server and so the tool run: this process's, unless (as root, the tool
    running as a user of its own) that user cannot reach it (e.g. under a ``/root`` of mode 700):
    then the system's ``python3``. The tool needs the standard library only."""
    if not root or _others_may_run(sys.executable):
        return sys.executable
    for name in ("python3", "python"):
        found = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        if found and _others_may_run(found):
            return found
    raise RuntimeError("no Python interpreter that an unprivileged user may run was found")


def _uid_processes(uid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry.path).st_uid == uid:
                    found.append(int(entry.name))
    return found


def _kill_uid(uid: int, wait_s: float = 5.0) -> None:
    """SIGKILL every process running as ``uid`` (the tool's own: nothing else uses it) until
    none is left: a process killed is listed until it is reaped, and one may fork meanwhile."""
    deadline = time.monotonic() + wait_s
    while (pids := _uid_processes(uid)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _status_reason(status: int, limits: SandboxLimits, stderr: str) -> str | None:
    if status == 0:
        return None
    if status == SETUP_FAILED and stderr.startswith("sandbox:"):
        return f"sandbox unavailable: {stderr.strip().splitlines()[-1]}"
    if status > 128:
        sig = signal.Signals(status - 128)
        if sig == signal.SIGXCPU:
            return f"cpu limit ({limits.cpu_s} s)"
        return f"killed by {sig.name}"
    if "MemoryError" in stderr:
        return f"memory limit ({limits.memory_mib} MiB)"
    return f"exit status {status}"


async def run_python(code: str, limits: SandboxLimits | None = None) -> ToolResult:
    """Run ``code`` sandboxed, with this process's jail server; see the module docstring."""
    limits = limits or SandboxLimits()
    start = time.perf_counter()
    uid = CLAIMS.claim() if os.geteuid() == 0 else None  # a uid no other call holds
    spec = _spec(code, limits, uid)
    work = str(spec["workdir"])
    loop = asyncio.get_running_loop()
    try:
        result = await _run(spec, limits, uid, start)
    except BaseException:  # cancelled: its jail is killed; the rest goes off this task
        loop.run_in_executor(None, _cleanup, work, uid)
        raise
    # stopped by us, or its init did not finish: what it left is ours (off the event loop)
    if result.exit_status is None or os.path.lexists(work):  # noqa: ASYNC240 - one lstat
        await loop.run_in_executor(None, _cleanup, work, uid)
    elif uid is not None:  # its init killed what it left and removed its directory
        CLAIMS.release(uid)
    return result


def _spec(code: str, limits: SandboxLimits, uid: int | None) -> dict[str, object]:
    """The jail's spec: the tool's code and the directory its jail makes for it (nothing is
    written here: the jail writes as the tool's user)."""
    owner = "" if uid is None else f"{uid}-"  # as root: whose it is, at a glance
    work = os.path.join(tempfile.gettempdir(), f"laminar-tool-{owner}{secrets.token_hex(8)}")
    return {
        "code": code,
        "workdir": work,
        "env": {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"},
        "uid": uid,
        "gid": uid,
        "cpu_s": limits.cpu_s,
        "memory_mib": limits.memory_mib,
        "max_processes": limits.max_processes,
        "file_mib": limits.file_mib,
    }


def _cleanup(work: str, uid: int | None) -> None:
    """After a jail that did not finish by itself: every process of its uid, its directory, and
    then its uid's claim."""
    if uid is not None:
        _kill_uid(uid)
    shutil.rmtree(work, ignore_errors=True)
    if uid is not None:
        CLAIMS.release(uid)


async def _run(
    spec: dict[str, object], limits: SandboxLimits, uid: int | None, start: float
) -> ToolResult:
    loop = asyncio.get_running_loop()
    server = JailServer.get(interpreter(uid is not None))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        call = server.start(spec, out_w, err_w)
    except JailServerGone as exc:
        os.close(out_r)
        os.close(err_r)
        wall = time.perf_counter() - start
        return ToolResult(False, "", "", None, f"sandbox unavailable: {exc}", wall, uid)
    finally:
        os.close(out_w)  # the jail holds them now: EOF once it and everything it started end
        os.close(err_w)
    unread = [out_r, err_r]
    pipes: list[asyncio.BaseTransport] = []
    readers: list[asyncio.Future[None]] = []
    out, err = bytearray(), bytearray()
    reason = None
    try:
        try:
            for into in (out, err):
                stream, pipe = await _reader(loop, unread.pop(0))
                pipes.append(pipe)
                readers.append(asyncio.ensure_future(_read(stream, limits.output_bytes, into)))
            async with asyncio.timeout(limits.wall_s):
                await asyncio.gather(*readers, asyncio.shield(call.status))
        except TimeoutError:
            reason = f"timed out after {limits.wall_s:g} s"
        except _Overflow:
            reason = f"output over {limits.output_bytes} bytes"
        except JailServerGone as exc:
            reason = f"sandbox unavailable: {exc}"
        except BaseException:  # cancelled: the jail goes now, nothing more awaited
            call.signal(signal.SIGKILL)
            raise
        if not call.status.done():
            await _stop(call)
        # the rest (a pipe's worth at most), then EOF: nothing holds the pipes any more
        await asyncio.wait(readers, timeout=5.0)
    finally:
        for task in readers:
            task.cancel()
        for pipe in pipes:
            pipe.close()
        for fd in unread:
            os.close(fd)
    stdout = out[: limits.output_bytes].decode(errors="replace")
    stderr = err[: limits.output_bytes].decode(errors="replace")
    status = None
    if reason is None:
        status = call.status.result()
        reason = _status_reason(status, limits, stderr)
    wall = time.perf_counter() - start
    return ToolResult(reason is None, stdout, stderr, status, reason, wall, uid)


async def _reader(
    loop: asyncio.AbstractEventLoop, fd: int
) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """An asyncio stream over the read end ``fd`` of a pipe (closed with its transport)."""
    stream = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(fd, "rb", buffering=0)
    )
    return stream, transport


async def _stop(call: JailCall) -> None:
    """End the jail and its tool. SIGTERM first: the jail SIGKILLs the tool's init (whose exit
    empties the tool's namespace) and exits; one that has not exited within 5 s is killed (its
    init, then the namespace, die by their parent-death signal)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        call.signal(sig)
        with contextlib.suppress(TimeoutError, JailServerGone):
            async with asyncio.timeout(5.0):
                await asyncio.shield(call.status)
            return


def check_sandbox() -> str | None:
    """None if tools can be sandboxed here, else why not (one sandboxed ``pass``)."""
    try:
        result = asyncio.run(run_python("pass", SandboxLimits(wall_s=30)))
    except OSError as exc:  # the jail could not even start (its interpreter, a limit)
        return f"the jail did not start: {exc}"
    finally:
        JailServer.close_current()  # the caller (laminar doctor, laminar run) runs no tools
    return None if result.ok else result.reason


def main() -> int:
    """``python -m laminar.tools.sandbox``: whether tool code can be sandboxed here (exit 0), or
    why not (exit 1); ``make run`` picks its example by it."""
    problem = check_sandbox()
    if problem is None:
        print("tool code can be sandboxed here")
        return 0
    print(f"tool code cannot be sandboxed here: {problem}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
