from __future__ import annotations

import asyncio
import os
import secrets

import pytest

import laminar.transport  # noqa: F401  (registers the schemes)
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import ServiceContext, transport_options
from laminar.runtime.service import ServiceHost
from laminar.transport.shm import SHM_TAG_ENV
from tests.support.poll import STOP_S
from tests.support.procs import TOKEN

TRANSPORTS = ["tcp://127.0.0.1:0", "inproc://*", "shm://*"]

# Every shared-memory segment this session (and every process it starts) creates carries this tag
# (transport/shm.py), so the leak checks below see only this session's segments, not those of a
# benchmark, a dev run or another test session (a parallel worker) sharing /dev/shm.
# Set in every process that loads this file (each pytest-xdist worker too, not inherited).
SHM_TAG = os.environ[SHM_TAG_ENV] = secrets.token_hex(4)

#: Where a directory's tests go in the run order: the longest first.
_FIRST = ("slow", "integration")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first. Under pytest-xdist (``make test``: ``-n 3 --dist loadgroup``) a worker takes
    the next test whenever it has fewer than three waiting, in this order; a slow test that came
    last (the SFT seeds, a vLLM start: one to three minutes each) ran alone at the end while the
    other worker idled. The sort is stable: a module's tests keep their order (the scenarios of
    ``tests/slow/test_vllm_cluster.py`` depend on it)."""

    def rank(item: pytest.Item) -> int:
        parts = item.path.parts
        return next((i for i, d in enumerate(_FIRST) if d in parts), len(_FIRST))

    items.sort(key=rank)


def session_segments() -> set[str]:
    """This session's shared-memory segments now (see SHM_TAG)."""
    return {
        n
        for n in os.listdir("/dev/shm")
        if n.startswith("laminar-") and n.split("-", 2)[-1].startswith(SHM_TAG)
    }


@pytest.fixture
def cluster() -> ClusterConfig:
    return ClusterConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, rpc_timeout_s=5.0)


@pytest.fixture
def options(cluster):  # type: ignore[no-untyped-def]
    return transport_options(cluster, TOKEN.encode())


@pytest.fixture
async def serve(cluster, options):  # type: ignore[no-untyped-def]
    """Start services in this event loop: ``host, service = await serve(Cls, bind)``."""
    hosts: list[tuple[ServiceHost, asyncio.Task[None]]] = []

    async def start(cls, bind="tcp://127.0.0.1:0", *, instance=None, manager=None, config=None):
        cfg = config or cls.config_model(bind=bind, metrics=None)
        ctx = ServiceContext(
            role=cls.role,
            instance=instance or f"{cls.role}-{len(hosts)}",
            cluster=cluster,
            config=cfg,
            options=options,
        )
        host = ServiceHost(cls, ctx, manager=manager)
        task = asyncio.create_task(host.run())
        hosts.append((host, task))
        started = asyncio.create_task(host.started())
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            started.cancel()
            hosts.remove((host, task))  # raised here: nothing to stop at teardown
            task.result()  # raises the startup error
        return host, started.result()

    yield start
    for host, task in reversed(hosts):
        host.stop()
        await asyncio.wait_for(task, STOP_S)


def _owner_alive_elsewhere(name: str) -> bool:
    """Segments are named ``laminar-<owner pid, 8 hex>-<random>``. One whose owner is another
    live process (a benchmark or a dev run beside the suite) is not this test's leak; a dead
    owner's segment, or this process's, is."""
    try:
        pid = int(name.split("-")[1], 16)
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(autouse=True)
def _no_leaked_shm():  # type: ignore[no-untyped-def]
    before = session_segments()
    yield
    after = session_segments()
    leaked = sorted(n for n in after - before if not _owner_alive_elsewhere(n))
    assert not leaked, f"shared-memory segments leaked: {leaked}"
