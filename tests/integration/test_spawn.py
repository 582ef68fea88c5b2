"""The one launcher (:mod:`laminar.proc.spawn`) with real processes: the ready line found in a
child's output, a real role started in its own group, seen ready and ended with all it started,
and a cluster role that never gets ready. The command lines and environments it builds are
``tests/unit/test_spawn.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from laminar.harness.launch import ProcessCluster
from laminar.proc import owned_dirs, procfs
from laminar.proc.linesplit import MAX_LINE_BYTES
from laminar.proc.spawn import (
    OutputLines,
    ServeSpec,
    kill_role,
    launch_env,
    parse_ready_line,
    serve_command,
    start,
)
from laminar.runtime.errors import LaminarError
from laminar.runtime.service import READY_PREFIX
from tests.support.poll import until
from tests.support.procs import ROOT, env
from tests.unit.test_spawn import SPAWNER

CHATTY = rf"""
import json, sys, time
sys.stdout.write("x" * (1 << 20) + "\n")
print("before\r")
sys.stdout.write({READY_PREFIX!r} + json.dumps({{"address": "tcp://here"}}) + "\nafter")
sys.stdout.flush()
time.sleep(0.2)
print(" and more")
"""


def test_output_lines_find_the_ready_line_past_a_megabyte_line_and_lose_nothing_after() -> None:
    proc = start([sys.executable, "-c", CHATTY], env(), stderr=subprocess.DEVNULL)
    try:
        lines = OutputLines(proc)
        seen: list[str] = []
        assert lines.until_ready(30, seen.append) == {"address": "tcp://here"}
        cut = f" ... [line truncated: {(1 << 20) - MAX_LINE_BYTES} more bytes not shown]"
        assert seen[:2] == ["x" * MAX_LINE_BYTES + cut, "before"]
        assert parse_ready_line(seen[2]) == {"address": "tcp://here"} and len(seen) == 3
        rest: list[str] = []
        lines.drain(rest.append)
        assert rest == ["after and more"]
        assert lines.until_ready(1, rest.append) is None  # ended: no second ready line
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_output_lines_give_up_when_the_process_exits_unready() -> None:
    proc = start([sys.executable, "-c", "print('no luck')"], env(), stderr=subprocess.DEVNULL)
    seen: list[str] = []
    assert OutputLines(proc).until_ready(30, seen.append) is None
    assert seen == ["no luck"] and proc.wait(timeout=10) == 0


async def test_a_role_is_started_in_its_own_group_seen_ready_and_ended_with_all_it_started(
    tmp_path: Path,
) -> None:
    """The spawner role starts a child that ignores SIGTERM and holds the role's stdout, as a vLLM
    engine core does: both are in the role's process group, and ending the role ends both. The
    group is in the launcher's session, not a session of its own: under the kernel's autogroup
    scheduler a session is a scheduling group, and roles in sessions of their own starved each
    other of CPU (``laminar.proc.procfs``)."""
    config = tmp_path / "cluster.yaml"
    config.write_text("{}\n")
    spec = ServeSpec(
        f"{SPAWNER}:SpawnerService",
        "spawner-0",
        config,
        standalone=True,
        sets=("spawner.stubborn=true", "spawner.metrics=null"),
    )
    tag = f"LAMINAR_TEST_SPAWN={uuid.uuid4().hex}"  # ours, whatever the launcher gets wrong
    environ, mark = launch_env(env(**dict([tag.split("=")])))
    proc = start(serve_command(spec), environ, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        seen: list[str] = []
        info = OutputLines(proc).until_ready(60, seen.append)
        assert info is not None and info["address"].startswith("tcp://127.0.0.1:"), seen
        assert info["instance"] == "spawner-0", info
        members = await until(_members(proc.pid, mark, 2), 30)  # the role and its child
        assert proc.pid in members
        assert os.getpgid(proc.pid) == proc.pid and os.getsid(proc.pid) == os.getsid(0)
        kill_role(proc, mark, grace=1.0)  # the child needs SIGKILL after the grace
        assert proc.returncode == -signal.SIGKILL
        assert procfs.group_members(proc.pid, mark) == []
        assert not any(procfs.alive(pid) for pid in members), members
    finally:
        for pid in procfs.pids():
            if procfs.has_env(pid, tag):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(timeout=10)


#: A rollout in miniature: it makes its engine's socket directory (as ``VllmEngine.start``
#: does) and forks a process that ignores SIGTERM (as an engine process may, mid-shutdown), then
#: waits to be killed. Neither removes the directory: only its launcher can.
OWNER = """
import os, signal, time
from laminar.proc import owned_dirs
path, _ = owned_dirs.make()
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
    os._exit(0)
print(path, flush=True)
time.sleep(60)
"""


def test_a_role_killed_with_its_group_leaves_no_engine_socket_directory() -> None:
    """A rollout SIGKILLed (its stop outlived the grace) and its group ended at once: its
    engine's directory of vLLM socket files is gone when :func:`kill_role` returns (fresh-clone CI
    runs left one in ``/tmp`` now and then: laminar.proc.spawn.end_role_groups)."""
    environ, mark = launch_env(env())
    proc = start([sys.executable, "-c", OWNER], environ, cwd=ROOT)
    try:
        assert proc.stdout is not None
        path = Path(proc.stdout.readline().strip())
        assert path.is_dir() and owned_dirs.owner(path) is not None, path
        kill_role(proc, mark, grace=0.5)  # the forked process needs SIGKILL
        assert procfs.group_members(proc.pid, mark) == []
        assert not path.exists(), path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        procfs.end_group(proc.pid, grace=0.5, mark=mark)


def _members(gid: int, mark: str, count: int):  # type: ignore[no-untyped-def]
    async def probe() -> list[int] | None:
        found = procfs.group_members(gid, mark)
        return found if len(found) >= count else None

    return probe


def test_a_cluster_role_that_never_gets_ready_is_ended_and_its_log_shown(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("manager:\n  no_such_key: 1\n")
    with ProcessCluster(config, tmp_path / "logs", env=env()) as cluster:
        with pytest.raises(LaminarError, match=r"(?s)manager never became ready.*no_such_key"):
            cluster.serve("manager", "manager", timeout=60)
        proc = cluster.procs["manager"]
        assert proc.returncode is not None and cluster.groups == set()
