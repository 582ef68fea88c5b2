"""``laminar run`` from a test: a config of test roles beside the manager, the supervisor (or any
process tree under test) started in a session of its own so the test can always kill all of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from .procs import ROOT, env, laminar


def write_run_config(tmp_path: Path, roles: list[dict[str, Any]], **run: Any) -> Path:
    """A ``laminar run`` config: fast heartbeats, the manager on a free port, ``roles`` after it,
    no plots (drawing them is ~2.7 CPU-s of matplotlib at each run's end; the test of a restart
    in tests/integration/test_processes.py asks for them and checks them); ``run`` keys override
    (``run_dir`` is ``tmp_path/run``)."""
    config = {
        "cluster": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0},
        # every port a free one: the admin API's default (7421) is one port for the whole
        # machine, and two runs of parallel test workers collided on it (the manager then
        # failed to start and the test waited out run_manager's timeout)
        "manager": {"bind": "tcp://127.0.0.1:0", "admin": "127.0.0.1:0"},
        "run": {
            "run_dir": str(tmp_path / "run"),
            "view_interval_s": 0.2,
            "plots": False,
            **run,
            "roles": [{"role": "manager"}, *roles],
        },
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def spawn(
    args: list[str], *, merge_stderr: bool = False, **extra_env: str
) -> subprocess.Popen[str]:
    """Start ``args`` from the repository root in a new session, output piped as text (stderr
    into stdout with ``merge_stderr``), with the test environment plus ``extra_env``."""
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        env=env(**extra_env),
        cwd=ROOT,
        start_new_session=True,
    )


def start_run(config: Path, **extra_env: str) -> subprocess.Popen[str]:
    """``laminar run CONFIG``, its console output (stdout and stderr) in ``.stdout``."""
    return spawn(laminar("run", str(config)), merge_stderr=True, **extra_env)


#: How long a launcher may take to write ``cluster.json``: a bound on a hang, not a timing check.
#: A few seconds alone; in the suite's first minutes the cores are shared with vLLM start-ups and
#: the SFT test, and a `laminar run` (2026-11-27, a fresh clone) was not up within 90 s there, nor
#: a Ray launcher's cluster under four xdist workers (2026-11-29).
STARTUP_S = 180.0


def run_manager(run_dir: Path, launcher: subprocess.Popen[str], timeout: float = STARTUP_S) -> str:
    """The manager's address, once the supervisor has written ``cluster.json``. A ``launcher``
    that exits first fails the test at once, with its output (a manager that cannot start ends
    the run: waiting out ``timeout`` would only hide why); one still starting after ``timeout``
    is killed with its session, and the failure shows what it had printed."""
    cluster_file = run_dir / "cluster.json"
    deadline = time.monotonic() + timeout
    while not cluster_file.is_file():
        if launcher.poll() is not None:
            output, _ = launcher.communicate(timeout=10)
            raise AssertionError(
                f"the launcher exited ({launcher.returncode}) before writing {cluster_file}; "
                f"its output ends:\n{(output or '')[-3000:]}"
            )
        if time.monotonic() > deadline:
            said = kill_session(launcher)
            raise AssertionError(
                f"{cluster_file} not written within {timeout} s; the launcher (killed) had "
                f"printed:\n{said[-3000:]}"
            )
        time.sleep(0.1)
    return str(json.loads(cluster_file.read_text())["manager"])


def kill_session(proc: subprocess.Popen[str]) -> str:
    """If ``proc`` (started by :func:`spawn`) still runs, SIGKILL its process group and reap it;
    what it wrote that nobody had read yet ("" if it had already ended)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=10)
        return output or ""
    return ""
