"""The guard that keeps processes out of unit tests (``tests/support/noprocess.py``, turned on by
``tests/unit/conftest.py``): every way of starting one is refused with a message that says where
the test belongs, and a refusal the code under test swallows is still remembered."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
from collections.abc import Callable

import pytest

from tests.support.noprocess import GUARD, MESSAGE, StartedAProcess


def _fork() -> None:
    pid = os.fork()
    if pid == 0:  # only were the guard broken: the child must not go on running the suite
        os._exit(0)
    os.waitpid(pid, 0)


def _process() -> None:
    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()


STARTS: dict[str, Callable[[], object]] = {
    "subprocess": lambda: subprocess.run(["true"], check=False),
    "popen": lambda: os.popen("true").close(),
    "system": lambda: os.system("true"),
    "posix_spawn": lambda: os.waitpid(os.posix_spawn("/bin/true", ["true"], {}), 0),
    "fork": _fork,
    "multiprocessing": _process,
}


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_every_way_of_starting_a_process_is_refused(start: Callable[[], object]) -> None:
    with pytest.raises(StartedAProcess, match=MESSAGE):
        start()
    assert len(GUARD.take()) == 1  # taken here: this test's refusal is the expected one


async def test_an_asyncio_subprocess_is_refused() -> None:
    with pytest.raises(StartedAProcess, match=MESSAGE):
        await asyncio.create_subprocess_exec("true")
    assert GUARD.take() == ["subprocess true"]


def test_a_refusal_the_code_under_test_swallows_is_remembered() -> None:
    try:
        subprocess.run(["true"], check=False)
    except Exception:
        pass
    # the end of this phase fails the test on what is remembered; taken here to pass
    assert GUARD.take() == ["subprocess true"]
