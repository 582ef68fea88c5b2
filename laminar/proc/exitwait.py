"""Noticing that a child process has exited, whatever holds its pipes.

What a child starts (a rollout's vLLM engine core and workers) inherits its stdout and stderr, so
after a kill -9 the pipes stay open as long as those live, and CPython 3.11's ``Process.wait()``
resolves only once they close. So the exit is seen on a pidfd of the process;
``waitid(WNOWAIT)`` reads the status and leaves the reaping to the event loop's child watcher.
Without pidfds (``pidfd_open`` failing: a kernel before 5.3, gVisor, seccomp) or without
``waitid(P_PIDFD)`` (a kernel before 5.4), a thread blocks in ``waitid(P_PID, WNOWAIT)`` instead.
If the loop reaped the process first, its return code is the loop's. Used by
:mod:`laminar.proc.children`; ``docs/architecture.md``, *Dev mode and processes*.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Any, Protocol


class Watched(Protocol):
    """What is waited on: a child's current process and its pidfd (closed and cleared here)."""

    process: asyncio.subprocess.Process | None
    pidfd: int | None


def open_pidfd(proc: asyncio.subprocess.Process) -> int | None:
    """A pidfd of a child just started; None without pidfds, or if the loop reaped it already
    (then its returncode is set). Unless reaped, the pid still names this very process: we are
    its parent."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:
        return None
    if proc.returncode is not None:
        os.close(fd)
        return None
    return fd


def _status(info: Any) -> int | None:
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


async def fd_ready(fd: int, *, write: bool = False) -> None:
    """Until ``fd`` is readable (``write``: writable), on the running loop: no thread waits."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def returncode(proc: asyncio.subprocess.Process, timeout: float = 5.0) -> int | None:
    """The status the event loop's child watcher read (it reaped the process, or is about to).
    Polled: ``proc.wait()`` would also wait for the pipes to close (CPython 3.11)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while proc.returncode is None and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    return proc.returncode


async def _waitid_thread(proc: asyncio.subprocess.Process) -> int | None:
    """Wait for the exit in a thread (``waitid(P_PID, WNOWAIT)``: the loop still reaps it)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int | None] = loop.create_future()

    def settle(code: int | None) -> None:
        if not done.done():
            done.set_result(code)

    def wait() -> None:
        try:
            code = _status(os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT))
        except OSError:  # ECHILD: the loop reaped it first
            code = None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, code)

    # A daemon thread, not the loop's executor: it must not hold up the loop's shutdown.
    threading.Thread(target=wait, name=f"waitid-{proc.pid}", daemon=True).start()
    code = await done
    return code if code is not None else await returncode(proc)


async def exit_status(child: Watched) -> int | None:
    """Wait until the child's current process has exited, whatever holds its pipes; its exit
    status (negative: the signal), or None if it cannot be known. Closes the child's pidfd."""
    proc = child.process
    assert proc is not None
    fd = child.pidfd
    if fd is None:
        return await _waitid_thread(proc)
    try:
        await fd_ready(fd)  # readable once it has exited
        # It has exited, so this does not block (WNOHANG all the same).
        info = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOWAIT | os.WNOHANG)  # noqa: ASYNC222
    except ChildProcessError:  # the loop reaped it first: it has the status
        info = None
    except (OSError, AttributeError):  # EINVAL: no waitid(P_PIDFD) before Linux 5.4
        return await _waitid_thread(proc)
    finally:
        os.close(fd)
        child.pidfd = None
    code = _status(info)
    return code if code is not None else await returncode(proc)
