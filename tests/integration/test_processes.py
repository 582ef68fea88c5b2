"""Real processes, real signals: what happens when a role is killed with -9."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from laminar.devmode.status import fetch_status
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import transport_options
from laminar.runtime.errors import PeerUnavailable
from laminar.runtime.rpc.client import RpcClient, remote
from tests.support.devrun import kill_session, run_manager, start_run, write_run_config
from tests.support.poll import until
from tests.support.procs import ROOT, SUPPORT_ROLES, TOKEN, env, laminar, run_cli, start, stop
from tests.support.roles import Calculator, Pair, Sleep

pytestmark = pytest.mark.integration


async def test_server_killed_fails_pending_calls_with_peer_unavailable() -> None:
    proc, info = start(
        laminar(
            "serve",
            "--role",
            f"{SUPPORT_ROLES}:Calculator",
            "--standalone",
            "--set",
            "calculator.metrics=null",
        )
    )
    client = RpcClient(info["address"], transport_options(ClusterConfig(), TOKEN.encode()))
    try:
        proxy = remote(Calculator, client)
        assert (await proxy.add.call(Pair(a=1, b=2))).value == 3
        pending = [
            asyncio.create_task(proxy.sleep.call(Sleep(seconds=60, tag=str(i)))) for i in range(5)
        ]

        async def running() -> bool:  # the calls are running on the server
            tags = (await proxy.history.call()).tags
            return all(f"started:{i}" in tags for i in range(5))

        await until(running, 30)
        assert not any(t.done() for t in pending)
        os.kill(proc.pid, signal.SIGKILL)
        # The lost connection fails them: PeerUnavailable (a timeout would be CallTimeout), and
        # long before the 60 s sleeps could have ended (no stopwatch bound: loaded machines).
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 30)
        assert all(isinstance(r, PeerUnavailable) for r in results), results
    finally:
        await client.close()
        stop(proc)


#: a role whose stop leaves a non-daemon thread running and whose module registered an atexit
#: handler: what the interpreter's exit would do must still happen, in that order
EXITING_ROLE = """
import atexit, sys, threading, time
from typing import ClassVar
from laminar.runtime.service import Service

atexit.register(lambda: print("atexit ran", flush=True))


def _late():
    time.sleep(0.5)
    sys.stdout.write("thread done\\n")  # not flushed: the exit flushes it


class Exiting(Service):
    role: ClassVar[str] = "exiting"

    async def on_stop(self) -> None:
        threading.Thread(target=_late).start()
"""


def test_a_stopped_role_exits_as_the_interpreter_would(tmp_path) -> None:
    """A role skips the interpreter's final garbage collection at exit (seconds after importing
    vLLM or torch: ``laminar.cli.serve.exit_without_final_collection``) but keeps the rest: a
    non-daemon thread finishes, then the atexit handlers run, and buffered output is not lost."""
    role = tmp_path / "exiting.py"
    role.write_text(EXITING_ROLE)
    proc, _ = start(
        laminar(
            "serve", "--role", f"{role}:Exiting", "--standalone", "--set", "exiting.metrics=null"
        )
    )
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        lines = [line for line in out.splitlines() if line in ("thread done", "atexit ran")]
        assert lines == ["thread done", "atexit ran"], out
    finally:
        stop(proc)


def _status(manager: str) -> dict:
    out = run_cli("status", "--join", manager, "--json", "--timeout", "2")
    assert out.returncode == 0, out.stderr
    return {m["instance"]: m for m in json.loads(out.stdout)["members"]}


def _status_until(manager: str, done, timeout: float) -> tuple[dict, float]:  # type: ignore[no-untyped-def]
    """Poll the manager until done(view), then read it once more with `laminar status --json`;
    returns that view and the seconds the poll took. The poll is in this process: each `laminar
    status` is an interpreter start (~1.3 CPU-s), and a poll of them cost the suite more than the
    roles under test did."""
    start = time.monotonic()

    def seen() -> bool:
        """done(the manager's view); False while the manager does not answer within 2 s, as
        one that got no CPU for that long did in a suite run (2026-11-28): the poll goes on."""
        try:
            status = asyncio.run(fetch_status(manager, TOKEN.encode(), ClusterConfig(), timeout=2))
        except PeerUnavailable:
            return False
        return bool(done({m["instance"]: m for m in status.model_dump(mode="json")["members"]}))

    while not seen() and time.monotonic() - start < timeout:
        time.sleep(0.05)
    took = time.monotonic() - start
    return _status(manager), took


def test_member_killed_shows_dead_in_status_within_heartbeat_timeout() -> None:
    timing = [
        "--set",
        "cluster.heartbeat_interval_s=0.2",
        "--set",
        "cluster.heartbeat_timeout_s=1.0",
    ]
    manager, minfo = start(
        laminar(
            "serve",
            "--role",
            "manager",
            "--set",
            "manager.bind=tcp://127.0.0.1:0",
            "--set",
            "manager.admin=127.0.0.1:0",
            *timing,
        )
    )
    members = []
    try:
        for i in range(2):
            members.append(
                start(
                    laminar(
                        "serve",
                        "--role",
                        f"{SUPPORT_ROLES}:Calculator",
                        "--join",
                        minfo["address"],
                        "--instance",
                        f"calc-{i}",
                        *timing,
                    )
                )[0]
            )
        view, _ = _status_until(
            minfo["address"],
            lambda v: all(v.get(f"calc-{i}", {}).get("state") == "alive" for i in range(2)),
            10,
        )
        assert view["calc-0"]["pid"] == members[0].pid
        assert view["calc-0"]["metrics"]  # every role exports Prometheus metrics
        os.kill(members[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        noticed = None
        while time.monotonic() - killed_at < 5:  # a fast in-process poll times the detection
            fast = asyncio.run(fetch_status(minfo["address"], TOKEN.encode(), ClusterConfig()))
            if {m.instance: m.state for m in fast.members}["calc-0"] == "dead":
                noticed = time.monotonic() - killed_at
                break
            time.sleep(0.01)
        assert noticed is not None and noticed < 1.0, f"noticed after {noticed} s"
        view = _status(minfo["address"])  # and `laminar status` shows it
        assert view["calc-0"]["state"] == "dead", view
        assert view["calc-1"]["state"] == "alive"
        # A hung member (SIGSTOP: its socket stays open) is caught by the heartbeat timeout.
        os.kill(members[1].pid, signal.SIGSTOP)
        view, _ = _status_until(minfo["address"], lambda v: v["calc-1"]["state"] == "dead", 5)
        assert view["calc-1"]["state"] == "dead" and "no heartbeat" in view["calc-1"]["reason"]
        os.kill(members[1].pid, signal.SIGCONT)  # it heartbeats again and is revived
        view, _ = _status_until(minfo["address"], lambda v: v["calc-1"]["state"] == "alive", 5)
        assert view["calc-1"]["state"] == "alive"
    finally:
        for proc in members:
            stop(proc)
        stop(manager)


def test_a_stopped_manager_counts_silence_from_when_it_woke(
    tmp_path: Path,
) -> None:
    """A manager that was not running (SIGSTOP for 2.5 heartbeat timeouts: a VM pause, a
    starved process) has heard nothing meanwhile; its members' silence counts from its wake-up,
    not from their last heartbeat. It once marked every member dead on waking (then revived them),
    and the data role requeues a dead rollout's trajectories each time. (A 2 s timeout, so that
    members starved by the rest of the suite are not silent for real.)"""
    timing = [
        "--set",
        "cluster.heartbeat_interval_s=0.25",
        "--set",
        "cluster.heartbeat_timeout_s=2.0",
    ]
    log = tmp_path / "manager.log"
    with log.open("w") as errors:
        manager, minfo = start(
            laminar("serve", "--role", "manager", "--set", "manager.bind=tcp://127.0.0.1:0",
                    "--set", "manager.admin=null", *timing),
            stderr=errors,
        )  # fmt: skip
    members = []
    try:
        for i in range(2):
            members.append(
                start(
                    laminar("serve", "--role", f"{SUPPORT_ROLES}:Calculator",
                            "--join", minfo["address"], "--instance", f"calc-{i}", *timing)
                )[0]
            )  # fmt: skip
        alive = lambda v: all(v.get(f"calc-{i}", {}).get("state") == "alive" for i in range(2))  # noqa: E731
        _status_until(minfo["address"], alive, 10)
        os.kill(manager.pid, signal.SIGSTOP)
        time.sleep(5.0)
        os.kill(manager.pid, signal.SIGCONT)
        time.sleep(1.5)  # heartbeat rounds and liveness checks after waking
        view = _status(minfo["address"])
        assert alive(view), view
        said = log.read_text()
        assert "member dead" not in said, said
        assert "liveness check woke late" in said, said
        # and a member that really stops is still caught by the timeout
        os.kill(members[1].pid, signal.SIGSTOP)
        view, _ = _status_until(minfo["address"], lambda v: v["calc-1"]["state"] == "dead", 10)
        assert "no heartbeat" in view["calc-1"]["reason"]
        os.kill(members[1].pid, signal.SIGCONT)
    finally:
        for proc in members:
            stop(proc)
        stop(manager)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_role_whose_start_blocks_its_loop_stops_at_once_when_told(sig: signal.Signals) -> None:
    """A rollout's vLLM engine start blocks its event loop (over a minute on a loaded machine),
    so a stop waited for the start's end: `laminar run` stopped in its first minute killed its
    rollouts after their grace, and a rollout whose launcher was killed lived on. The start now
    ends at the signal (``signals_end_the_start``) and the role exits as after a stop."""
    proc = subprocess.Popen(
        laminar("serve", "--role", f"{SUPPORT_ROLES}:SlowStarter", "--standalone"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "blocking start"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)  # the start alone would take 60 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "stopped while starting" in err and sig.name in err, err[-3000:]
    assert "Traceback" not in err and "never interrupted" not in err, err[-3000:]


def test_status_without_token_is_refused() -> None:
    manager, minfo = start(
        laminar(
            "serve",
            "--role",
            "manager",
            "--set",
            "manager.bind=tcp://127.0.0.1:0",
            "--set",
            "manager.admin=127.0.0.1:0",
        )
    )
    try:
        bad = env(LAMINAR_TOKEN="not-the-cluster-token")
        out = run_cli("status", "--join", minfo["address"], "--timeout", "2", environ=bad)
        assert out.returncode == 2 and "bad cluster token" in out.stderr
        missing = {k: v for k, v in env().items() if k != "LAMINAR_TOKEN"}
        out = run_cli(
            "status", "--join", minfo["address"], "--run-dir", "/nonexistent", environ=missing
        )
        assert out.returncode == 2 and "LAMINAR_TOKEN" in out.stderr
    finally:
        stop(manager)


@pytest.mark.timeout(300)  # room for run_manager's STARTUP_S on a loaded machine
def test_laminar_run_restarts_a_killed_member_and_stops_cleanly(tmp_path) -> None:
    calculators = {"role": f"{SUPPORT_ROLES}:Calculator", "count": 2}
    config = write_run_config(
        tmp_path, [{**calculators, "restart": "on-failure", "max_restarts": 2}], plots=True
    )
    sup = start_run(config)
    try:
        manager = run_manager(tmp_path / "run", sup)
        view, _ = _status_until(
            manager, lambda v: sum(m["state"] == "alive" for m in v.values()) == 3, 30
        )
        assert sum(m["state"] == "alive" for m in view.values()) == 3, view
        victim = view["calculator-0"]["pid"]
        os.kill(victim, signal.SIGKILL)
        view, _ = _status_until(
            manager,
            lambda v: (
                v["calculator-0"]["state"] == "alive" and v["calculator-0"]["incarnation"] == 2
            ),
            20,
        )
        assert view["calculator-0"]["incarnation"] == 2 and view["calculator-0"]["pid"] != victim
        assert view["calculator-0"]["state"] == "alive"
        sup.send_signal(signal.SIGINT)  # what Ctrl-C does
        out, _ = sup.communicate(timeout=30)
        assert sup.returncode == 0, out
        assert "restarting (1/2)" in out and "all roles stopped" in out
        # the plots are drawn once the roles have stopped, from what the run recorded
        assert "plots: " in out and (tmp_path / "run" / "plots" / "throughput.png").is_file(), out
        # Children's output goes to the run's log files (the console shows progress only).
        manager_log = (tmp_path / "run" / "logs" / "manager-0.log").read_text()
        assert "member left" in manager_log  # members left the manager cleanly before it stopped
        assert (tmp_path / "run").is_symlink() and (tmp_path / "run" / "cluster.jsonl").is_file()
        for m in view.values():
            with pytest.raises(ProcessLookupError):
                os.kill(m["pid"], 0)  # no orphan left behind
    finally:
        kill_session(sup)


def test_bad_config_names_key_value_and_expectation(tmp_path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("cluster:\n  heartbeat_timeout_s: soon\n  heartbeet: 1\n")
    out = run_cli("run", str(config))
    assert out.returncode == 2
    assert "cluster.heartbeat_timeout_s = 'soon'" in out.stderr and "number" in out.stderr
    assert "cluster.heartbeet: unknown key" in out.stderr
