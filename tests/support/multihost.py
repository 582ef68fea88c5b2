"""A Laminar cluster spread over emulated hosts (``laminar.harness.netns.NetLab``), for the multi-host test.

Each host is a network namespace *and* a UTS namespace with its own hostname, as separate machines
have: roles find "the relay on my host" by the hostname they report when joining, so hosts that
shared one hostname would all look like one machine. Only the network and the hostname are
separated; the file system (and so /dev/shm, the config and the data role's store) is shared,
which matters only to the test's own checks, never to how the roles find each other.

The test process lives in the root namespace, which has no route to the lab's 198.18.0.0/24, so
``on_host`` runs a coroutine on a thread that has entered one host's network namespace (what
``ip netns exec`` does before it execs): the test asks the roles what they report from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from laminar.harness.launch import ProcessCluster
from laminar.harness.netns import NetLab
from laminar.roles.manager.api import RelayChainApi
from laminar.roles.relay.api import RelayApi
from laminar.roles.rollout import RolloutService
from laminar.roles.trainer.service import TrainerService
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import transport_options
from laminar.runtime.errors import CallTimeout, PeerUnavailable
from laminar.runtime.membership import MembershipApi
from laminar.runtime.rpc.client import RpcClient, remote

from .poll import until
from .procs import ROOT, TOKEN, env

T = TypeVar("T")

# `sh -c SCRIPT NAME ARGS...`: $0 is NAME, "$@" the role's command, exec'd so signals reach it.
_SET_HOSTNAME = 'hostname "$0" && exec "$@"'
_CLONE_NEWNET = 0x40000000


def host_prefix(lab: NetLab, i: int, hostname: str) -> tuple[str, ...]:
    """Command prefix that runs a command on emulated host ``i``, named ``hostname``."""
    return ("ip", "netns", "exec", lab.namespace(i), "unshare", "--uts", "sh", "-c",
            _SET_HOSTNAME, hostname)  # fmt: skip


def on_host(lab: NetLab, i: int, main: Callable[[], Awaitable[T]], timeout: float) -> T:
    """Run ``main()`` in a fresh event loop on a thread inside host ``i``'s network namespace.

    A network namespace belongs to a thread (setns(2) moves only the caller), so the test's own
    threads stay in the root namespace; sockets the thread opens live in the host's.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{lab.namespace(i)}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns failed")
            finally:
                os.close(fd)
            box["result"] = asyncio.run(main())  # type: ignore[arg-type]
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"on-host-{i}", daemon=True)
    thread.start()
    thread.join(timeout + 30)
    if thread.is_alive():
        raise TimeoutError(f"on_host({i}) still running after {timeout + 30} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


class MultiHostCluster:
    """``ProcessCluster`` whose roles run on NetLab hosts, each bound to its host's address."""

    def __init__(self, lab: NetLab, tmp: Path, config: Path, hostname: str = "lmhost") -> None:
        self.lab = lab
        self.hostname = hostname
        self.procs = ProcessCluster(config, tmp / "logs", env=env(), cwd=ROOT)
        self.started: dict[str, subprocess.Popen[str]] = {}
        self.exits: dict[str, tuple[int | None, float]] = {}

    def serve(self, role: str, name: str, host: int, timeout: float = 180.0) -> str:
        """Start ``role`` as ``name`` on ``host``, listening on that host's lab address."""
        address = self.lab.address(host)
        args: tuple[str, ...] = ("--bind", f"tcp://{address}:0")
        if role == "relay":
            args += ("--set", f"relay.weights_bind=tcp://{address}:0")
        prefix = host_prefix(self.lab, host, f"{self.hostname}{host}")
        info = self.procs.serve(role, name, args=args, prefix=prefix, timeout=timeout)
        self.started[name] = self.procs.procs[name]
        return info["address"]

    def serve_all(self, roles: list[tuple[str, str, int]]) -> None:
        """Start several (role, name, host) at once: their start-ups (imports) overlap."""
        with ThreadPoolExecutor(len(roles)) as pool:
            for future in [pool.submit(self.serve, *r) for r in roles]:
                future.result()

    def address(self, name: str) -> str:
        return self.procs.info[name]["address"]

    def dead(self) -> dict[str, int]:
        """Roles that exited, with their exit codes (a healthy run has none)."""
        return {n: p.returncode for n, p in self.started.items() if p.poll() is not None}

    def connections(self, host: int) -> list[tuple[str, str, int]]:
        """Established TCP connections on ``host``: (local, peer, pid) for each holder."""
        done = self.lab.run(
            host,
            ["ss", "-tnpH", "state", "established"],
            capture_output=True,
            text=True,
            check=True,
        )
        out = []
        for line in done.stdout.splitlines():
            fields = line.split()
            if len(fields) < 4 or "pid=" not in fields[-1]:
                continue
            local, peer = fields[-3], fields[-2]
            for part in fields[-1].split("pid=")[1:]:
                out.append((local, peer, int(part.split(",")[0])))
        return out

    def shutdown(self, tiers: list[list[str]], grace: float = 20.0) -> None:
        """SIGTERM the roles tier by tier (each tier gets ``grace`` s), then any not named;
        record how and when each exited. Stopping consumers before what they report to (rollouts
        before data, the manager last) is the order a cluster is taken down in."""
        t0 = time.monotonic()
        named = {n for tier in tiers for n in tier}
        rest = [n for n in self.started if n not in named]
        for tier in [*tiers, rest]:
            for name in tier:
                if self.started[name].poll() is None:
                    self.started[name].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for name in tier:
                proc = self.started[name]
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
                self.exits[name] = (proc.returncode, round(time.monotonic() - t0, 2))
        self.procs.shutdown()  # nothing is left running: this only closes its bookkeeping


# -- what the roles report, asked from host 0 ----------------------------------------------------


def _dump(model: Any) -> Any:
    return model.model_dump(mode="json")


async def observe(addresses: dict[str, str], published: int, timeout: float) -> dict[str, Any]:
    """Wait until the trainer published ``published``, every rollout loaded it and every relay
    verified it; then what the manager, the relays, the trainer and the rollouts report."""
    options = transport_options(ClusterConfig(), TOKEN.encode())
    clients = {name: RpcClient(a, options, timeout=10.0) for name, a in addresses.items()}
    try:
        trainer = remote(TrainerService, clients["trainer"])
        rollouts = {n: remote(RolloutService, c) for n, c in clients.items() if "rollout" in n}
        relays = {n: remote(RelayApi, c) for n, c in clients.items() if n.startswith("relay")}

        # A probe that cannot reach its peer this time says "not yet": on a loaded 2-core
        # machine a handshake into a namespace can take over its 5 s (seen in the full suite);
        # the state must still be reached within ``timeout``.
        async def trained() -> Any:
            with contextlib.suppress(PeerUnavailable, CallTimeout):
                s = await trainer.status.call()
                return s if not s.training and s.published >= published else None
            return None

        status = await until(trained, timeout, 0.25)

        async def caught_up() -> bool:
            with contextlib.suppress(PeerUnavailable, CallTimeout):
                hs = [await r.weights.call() for r in rollouts.values()]
                return all(h.loads and h.loads[-1].version == published for h in hs)
            return False

        await until(caught_up, timeout, 0.25)

        async def everywhere() -> bool:
            with contextlib.suppress(PeerUnavailable, CallTimeout):
                states = [await r.status.call() for r in relays.values()]
                return all(published in s.received_at for s in states)
            return False

        await until(everywhere, timeout, 0.25)
        manager = clients["manager"]
        return {
            "trainer": _dump(status),
            "members": _dump(await remote(MembershipApi, manager).status.call())["members"],
            "chain": _dump(await remote(RelayChainApi, manager).chain.call()),
            "relays": {n: _dump(await r.status.call()) for n, r in relays.items()},
            "rollouts": {n: _dump(await r.weights.call()) for n, r in rollouts.items()},
        }
    finally:
        for client in clients.values():
            await client.close()
