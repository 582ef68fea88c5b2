"""A role's processes die with it: kill -9 of a role under ``laminar run``, and the run's stop.

The role (``tests/support/spawner.py``) starts a child that holds the supervisor's pipes and
ignores SIGTERM, as a vLLM rollout's engine core holds them. Every process of the run carries a
tag in its environment, so the test counts them by scanning ``/proc``, whoever their parent
became. Checks: the supervisor notices the kill (not waiting for the pipes to close), ends the
role's session (the child too), restarts the role by its policy and says so; after SIGTERM to the
supervisor, no process of the run is left.

The second test is a vLLM rollout's process tree without vLLM or a supervisor (``laminar serve``
on a cluster node): the engine's processes kill themselves when the rollout is killed with -9
(``laminar.engines.vllm_worker``), and leave a live rollout's engine alone.
``tests/slow/test_vllm_orphans.py`` does the same with the real engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from laminar.config import ClusterConfig
from laminar.launch import proc_stat
from laminar.status import fetch_status
from tests.support.procs import ROOT, TOKEN, env, laminar

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SPAWNER = str(ROOT / "tests" / "support" / "spawner.py")
TAG = "LAMINAR_TEST_ORPHANS"


def tagged(tag: str) -> dict[int, int]:
    """Live processes (zombies excluded) started with ``TAG=tag``: pid -> session id."""
    marker = f"{TAG}={tag}".encode()
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        stat = proc_stat(int(entry.name))
        if marker in environ.split(b"\0") and stat is not None and stat[0] != "Z":
            out[int(entry.name)] = stat[3]
    return out


def alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def members(manager: str) -> dict:  # type: ignore[type-arg]
    status = asyncio.run(fetch_status(manager, TOKEN.encode(), ClusterConfig(), timeout=2.0))
    return {m.instance: m for m in status.members}


def until(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # the manager is not up yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def test_killed_role_takes_its_processes_along_restarts_and_nothing_outlives_the_run(
    tmp_path: Path,
) -> None:
    tag = uuid.uuid4().hex
    grace = 1.0
    config = tmp_path / "cluster.yaml"
    config.write_text(f"""
cluster: {{heartbeat_interval_s: 0.2, heartbeat_timeout_s: 1.0}}
manager: {{bind: "tcp://127.0.0.1:0"}}
run:
  run_dir: {tmp_path / "run"}
  view_interval_s: 0.2
  shutdown_grace_s: {grace}
  display: lines
  roles:
    - role: manager
    - role: {SPAWNER}:SpawnerService
      restart: on-failure
      max_restarts: 2
      config: {{stubborn: true}}
""")
    sup = subprocess.Popen(
        laminar("run", str(config)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(**{TAG: tag}),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        cluster_file = tmp_path / "run" / "cluster.json"
        until(cluster_file.is_file, 30, "cluster.json written")
        manager = json.loads(cluster_file.read_text())["manager"]
        first = until(
            lambda: (m := members(manager).get("spawner-0")) and "child_pid" in m.stats and m,
            30,
            "spawner-0 heartbeating",
        )
        role, child = first.pid, int(first.stats["child_pid"])
        procs = tagged(tag)
        sessions = set(procs.values()) - {sup.pid}  # the supervisor leads its own
        assert procs.get(child) == role, procs  # the child is in the role's session
        assert len(sessions) == 2, procs  # the manager's and the role's

        os.kill(role, signal.SIGKILL)
        killed = time.monotonic()
        # Noticed, session ended (the child needs SIGKILL after the grace), restarted, rejoined.
        again = until(
            lambda: (
                (m := members(manager).get("spawner-0"))
                and m.incarnation == 2
                and m.state == "alive"
                and "child_pid" in m.stats
                and m
            ),
            grace + 15,
            "spawner-0 restarted",
        )
        took = time.monotonic() - killed
        assert again.pid != role
        assert not alive(child), f"the killed role's child {child} survived it"
        assert not [pid for pid, sid in tagged(tag).items() if sid == role], "session not ended"
        assert alive(int(again.stats["child_pid"]))
        print(f"restarted {took:.1f} s after kill -9")

        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=30)
        assert sup.returncode == 0, out
        assert "spawner-0 exited with signal 9 (SIGKILL); restarting (1/2)" in out, out
        assert f"spawner-0 left 1 process (pid {child}) behind; stopped it" in out, out
        assert "all roles stopped" in out, out
        survivors = {pid: sid for pid, sid in tagged(tag).items() if pid != sup.pid}
        assert not survivors, f"processes of the run outlived it: {survivors}\n{out}"
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.communicate(timeout=10)
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


# The shape of a vLLM rollout, without vLLM: the owner (the rollout) names itself and starts an
# "engine core" that runs none of our code, which starts a "worker" that imports our worker
# extension module, as vLLM's worker does.
OWNER = """
import os, subprocess, sys
from laminar.engines import vllm_worker
assert vllm_worker.WATCHDOG is None  # the rollout never watches itself
os.environ[vllm_worker.OWNER_ENV] = vllm_worker.owner_token()
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
import time; time.sleep(3600)
"""
CORE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]])
time.sleep(3600)
"""
WORKER = """
import time
from laminar.engines import vllm_worker
print("armed" if vllm_worker.WATCHDOG is not None else "not armed", flush=True)
time.sleep(3600)
"""


def children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) and stat[1] == pid:
            out.append(int(entry.name))
    return out


def test_engine_processes_die_with_their_rollout_killed_with_minus_9() -> None:
    tag = uuid.uuid4().hex
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, CORE, WORKER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(**{TAG: tag}),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "armed"
        (core,) = children(owner.pid)
        (worker,) = children(core)
        time.sleep(1.0)  # a live rollout's engine is left alone
        assert alive(core) and alive(worker)

        owner.kill()
        owner.wait(timeout=10)
        gone = until(lambda: not alive(core) and not alive(worker), 10, "engine processes gone")
        assert gone
        _, err = owner.communicate(timeout=10)  # the pipes close once the worker is gone
        assert f"the rollout (pid {owner.pid}) is gone; killing its vLLM engine" in err, err
        assert f"pids {core}, {worker}" in err, err
        assert not tagged(tag)
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
        if owner.poll() is None:
            owner.kill()
            owner.communicate(timeout=10)


def test_session_signals_spare_processes_without_the_mark() -> None:
    """A session id swept late may have been recycled: only marked processes are signalled."""
    from laminar.launch import MARK_ENV, end_session, session_members

    mine, theirs = f"{MARK_ENV}=mine-{uuid.uuid4().hex}", f"{MARK_ENV}=theirs"
    stranger = subprocess.Popen(
        ["sleep", "60"], env=env(**{MARK_ENV: "theirs"}), start_new_session=True
    )
    try:
        until(lambda: session_members(stranger.pid, theirs), 5, "the stranger is up")
        assert session_members(stranger.pid) == [stranger.pid]
        assert session_members(stranger.pid, mine) == []
        assert end_session(stranger.pid, grace=0.1, mark=mine) == []
        time.sleep(0.2)
        assert stranger.poll() is None  # spared
        assert end_session(stranger.pid, grace=1.0, mark=theirs) == [stranger.pid]
        assert stranger.wait(timeout=5) == -signal.SIGTERM
    finally:
        if stranger.poll() is None:
            stranger.kill()
            stranger.wait(timeout=5)
