"""``laminar run --launcher ray`` on a local Ray cluster it starts itself: the hello example's
manager and two members each in a Ray actor, a member killed with -9 and restarted by the same
policy as the local supervisor's, and a SIGTERM that leaves nothing behind, neither a role nor any
of the Ray cluster's own processes (GCS, raylet, workers). Ray keeps each local cluster's session
(logs, sockets) in ``$RAY_TMPDIR/ray`` (``/tmp/ray`` by default) after it stops, for a user to
read; this test's goes in a directory of its own, removed at its end."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path

import pytest

from laminar.devmode.status import fetch_status
from laminar.proc.procfs import KEEP_ENVIRON, alive, has_env, pids, stat
from laminar.runtime.config import ClusterConfig
from tests.support.devrun import kill_session, run_manager, spawn
from tests.support.poll import until
from tests.support.procs import ROOT, TOKEN, laminar

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),  # room for run_manager's STARTUP_S on a loaded machine
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (the dev extra)"),
]

HELLO = ROOT / "examples" / "hello" / "config.yaml"


def _marked(entry: str) -> dict[int, int]:
    """Every live process started with ``entry`` in its environment: pid -> start time."""
    out = {}
    for pid in pids():
        st = stat(pid)
        if st is not None and st.state != "Z" and has_env(pid, entry):
            out[pid] = st.start
    return out


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


async def _members(manager: str) -> dict[str, dict]:
    status = await fetch_status(manager, TOKEN.encode(), ClusterConfig(), timeout=2.0)
    return {m.instance: m.model_dump() for m in status.members}


def test_ray_launcher_restarts_a_killed_member_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = f"LAMINAR_TEST_RAY={uuid.uuid4().hex}"  # inherited by everything the run starts
    name, value = entry.split("=")
    # Ray's session: a short path (its socket files' names must fit in 107 bytes)
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-"))
    # Ray's process titles keep /proc/PID/environ
    environ = {name: value, "RAY_TMPDIR": str(ray_tmp), **KEEP_ENVIRON}
    sets = [f"run.run_dir={tmp_path / 'run'}", "run.duration_s=300", "run.plots=false",
            "run.display=lines", "run.shutdown_grace_s=5",
            "manager.admin=127.0.0.1:0"]  # fmt: skip
    args = ["run", str(HELLO), "--launcher", "ray", "--skip-doctor"]
    for item in sets:
        args += ["--set", item]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local cluster of its own
    run = spawn(laminar(*args), merge_stderr=True, **environ)
    started: dict[int, int] = {}
    try:
        manager = run_manager(tmp_path / "run", run)

        async def all_alive() -> dict[str, dict] | None:
            view = await _members(manager)
            ok = len(view) == 3 and all(m["state"] == "alive" for m in view.values())
            return view if ok else None

        view = asyncio.run(until(all_alive, timeout=60, interval=0.2))
        assert set(view) == {"manager-0", "echo-0", "echo-1"}, view
        victim = view["echo-0"]["pid"]
        os.kill(victim, signal.SIGKILL)

        async def replaced() -> dict[str, dict] | None:
            view = await _members(manager)
            echo = view.get("echo-0", {})
            ok = echo.get("state") == "alive" and echo.get("incarnation") == 2
            return view if ok else None

        view = asyncio.run(until(replaced, timeout=60, interval=0.2))
        assert view["echo-0"]["pid"] != victim
        assert view["echo-1"]["incarnation"] == 1 and view["manager-0"]["incarnation"] == 1

        started = _marked(entry)
        names = [_name(pid) for pid in started]
        serving = [pid for pid, n in zip(started, names, strict=True) if " serve --role " in n]
        assert sorted(serving) == sorted(m["pid"] for m in view.values()), names
        assert any("raylet" in n for n in names) and any("gcs_server" in n for n in names), names

        run.send_signal(signal.SIGTERM)  # to the driver alone, as `kill PID` does
        out, _ = run.communicate(timeout=90)
        assert run.returncode == 0, out
        assert "echo-0 exited with signal 9 (SIGKILL); restarting (1/3)" in out, out
        assert "all roles stopped" in out, out
        # Members first: they left the manager cleanly before it stopped.
        manager_log = (tmp_path / "run" / "logs" / "manager-0.log").read_text()
        assert manager_log.count("member left") == 2, manager_log
        left = [f"{pid} {_name(pid)}" for pid, start in started.items() if alive(pid, start)]
        assert not left, left
        assert not _marked(entry), [_name(pid) for pid in _marked(entry)]
        assert list((ray_tmp / "ray").glob("session_*")), "Ray's session went elsewhere"
    finally:
        kill_session(run)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for pid, start in {**started, **_marked(entry)}.items():
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)
