"""The jail's fork server (``laminar/tools/jailserver.py``, ``jail.py --serve``): one per process,
shared by every event loop; a call whose task is cancelled, a server that dies, a caller killed
with -9: each ends its tools and leaves no process behind, and the next call works.

Real servers, real jails, real kills. "Behind" is counted as the processes below the server (its
jails, their inits and tools), so tests of other modules using the sandbox meanwhile do not count.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from laminar.proc.procfs import alive, descendants
from laminar.tools.jailserver import JailServer
from laminar.tools.sandbox import SandboxLimits, check_sandbox, interpreter, run_python

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("sandbox")]

SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(600)"
LONG = SandboxLimits(wall_s=60.0)


def server() -> JailServer:
    return JailServer.get(interpreter(os.geteuid() == 0))


def wait_for(probe, timeout: float = 30.0, interval: float = 0.02):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (result := probe()):
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(interval)
    return result


def tools_of(pid: int) -> list[int]:
    return descendants(pid)


def test_calls_from_several_event_loops_share_one_server() -> None:
    first = asyncio.run(run_python("print(6 * 7)"))
    pid = server().process.pid
    found: list[object] = []
    worker = threading.Thread(target=lambda: found.append(asyncio.run(run_python("print(1)"))))
    worker.start()
    worker.join()

    async def many() -> list[str]:  # concurrent calls on one loop
        results = await asyncio.gather(*(run_python(f"print({i} * {i})") for i in range(12)))
        return [r.stdout for r in results]

    assert first.ok and first.stdout == "42\n"
    assert found[0].ok and found[0].stdout == "1\n"  # type: ignore[attr-defined]
    assert asyncio.run(many()) == [f"{i * i}\n" for i in range(12)]
    assert server().process.pid == pid and alive(pid)
    wait_for(lambda: not tools_of(pid))  # every jail reaped


def test_a_cancelled_call_kills_its_tool_at_once() -> None:
    async def scenario() -> None:
        call = asyncio.create_task(run_python(SLEEPER, LONG))
        pid = server().process.pid
        while len(tools_of(pid)) < 3:  # noqa: ASYNC110 - another process: jail, init, tool
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(scenario())
    wait_for(lambda: not tools_of(server().process.pid))


def test_a_killed_server_fails_its_calls_and_the_next_call_starts_another() -> None:
    async def scenario() -> tuple[object, int, list[int]]:
        call = asyncio.create_task(run_python(SLEEPER, LONG))
        old = server().process.pid
        while len(below := tools_of(old)) < 3:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.01)
        os.kill(old, signal.SIGKILL)
        return await call, old, below

    result, old, below = asyncio.run(scenario())
    assert not result.ok and result.reason.startswith("sandbox unavailable: ")  # type: ignore[attr-defined]
    wait_for(lambda: not any(alive(p) for p in [old, *below]))  # its jails died with it
    again = asyncio.run(run_python("print('again')"))
    assert again.ok and again.stdout == "again\n"
    assert server().process.pid != old


def test_closing_the_server_ends_its_process_and_the_next_call_starts_another() -> None:
    assert check_sandbox() is None  # one probe, then the server is closed (laminar doctor)
    assert JailServer._current is None
    first = server()
    JailServer.close_current()
    first.process.wait(timeout=30)  # it read EOF and exited
    assert asyncio.run(run_python("print(2)")).stdout == "2\n"
    assert server() is not first and alive(server().process.pid)


CALLER = """
import asyncio, os, sys
from laminar.tools.jailserver import JailServer
from laminar.tools.sandbox import SandboxLimits, check_sandbox, interpreter, run_python

async def main():
    call = asyncio.create_task(run_python({code!r}, SandboxLimits(wall_s=600)))
    while True:
        server = JailServer._current
        if server is not None:
            print(server.process.pid, flush=True)
            break
        await asyncio.sleep(0.01)
    await call

asyncio.run(main())
"""


def test_the_server_and_its_tools_die_with_a_caller_killed_by_sigkill() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="laminar-jail-test-", dir="/tmp"))
    tmp.chmod(0o1777)  # as /tmp: the tool's user makes its directory here
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER.format(code=SLEEPER)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        assert caller.stdout is not None
        pid = int(caller.stdout.readline())
        below = wait_for(lambda: (found := tools_of(pid)) and len(found) >= 3 and found)
        assert len(list(tmp.iterdir())) == 1  # the tool's directory
        caller.kill()  # SIGKILL: no clean-up of any kind in the caller
        caller.wait()
        wait_for(lambda: not any(alive(p) for p in [pid, *below]))
        assert list(tmp.iterdir()) == []  # the server removed it on its way out
    finally:
        caller.kill()
        caller.wait()
        shutil.rmtree(tmp, ignore_errors=True)


CANCELLER = """
import asyncio, os, threading
from concurrent.futures import ThreadPoolExecutor
from laminar.tools.jailserver import JailServer
from laminar.tools.sandbox import SandboxLimits, run_python

async def main():
    loop = asyncio.get_running_loop()
    busy = threading.Event()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    loop.run_in_executor(None, busy.wait)  # the executor's one thread is taken
    call = asyncio.create_task(run_python({code!r}, SandboxLimits(wall_s=600)))
    while not os.listdir(os.environ["TMPDIR"]):  # the jail made the tool's directory
        await asyncio.sleep(0.01)
    print(JailServer._current.process.pid, flush=True)
    input()  # the test has seen the tool's processes
    call.cancel()
    await asyncio.sleep(0.1)  # the cancellation runs: the jail is killed, its clean-up queued
    print("cancelled", flush=True)
    input()  # the test has seen the server reap the jail
    os._exit(0)  # as a role exits: the queued clean-up never ran

asyncio.run(main())
"""


def test_a_call_cancelled_by_a_caller_that_exits_before_its_clean_up_leaves_no_directory() -> None:
    """A role stops by cancelling its episodes and leaving with ``os._exit``; the clean-up its
    cancelled calls queue off the event loop may not have run (here its executor is busy). The
    server removes what the jails it was told to stop left: the tools' directories stayed in
    /tmp before."""
    tmp = Path(tempfile.mkdtemp(prefix="laminar-jail-test-", dir="/tmp"))
    tmp.chmod(0o1777)
    caller = subprocess.Popen(
        [sys.executable, "-c", CANCELLER.format(code=SLEEPER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        assert caller.stdin is not None and caller.stdout is not None
        pid = int(caller.stdout.readline())
        below = wait_for(lambda: (found := tools_of(pid)) and len(found) >= 3 and found)
        caller.stdin.write("\n")
        caller.stdin.flush()
        assert caller.stdout.readline() == "cancelled\n"
        wait_for(lambda: not tools_of(pid))  # the jail is reaped (no zombie left either)
        caller.stdin.write("\n")
        caller.stdin.flush()
        assert caller.wait(timeout=30) == 0
        wait_for(lambda: not any(alive(p) for p in [pid, *below]))
        assert list(tmp.iterdir()) == []
    finally:
        caller.kill()
        caller.wait()
        shutil.rmtree(tmp, ignore_errors=True)
