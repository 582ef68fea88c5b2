"""The one launcher (:mod:`laminar.proc.spawn`): the command line and environment a role is started
with, its ready line, its output, and a real role started, seen ready and ended with its group.

Both ``laminar run`` (:class:`laminar.devmode.supervisor.Supervisor`) and :class:`laminar.harness.launch.
ProcessCluster` go through it; the tests of their command lines check the argv they give, and that
``laminar serve``'s own parser takes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from laminar.cli import build_parser
from laminar.devmode.supervisor import Supervisor
from laminar.harness.launch import ProcessCluster
from laminar.proc import owned_dirs, procfs
from laminar.proc.cpus import CpuSlot
from laminar.proc.linesplit import MAX_LINE_BYTES
from laminar.proc.procfs import KEEP_ENVIRON, MARK_ENV
from laminar.proc.spawn import (
    OutputLines,
    ServeSpec,
    config_sets,
    cpu_env,
    ensure_token,
    kill_role,
    launch_env,
    parse_ready_line,
    serve_command,
    start,
    stop_stages,
)
from laminar.runtime.config import load_config, token_problem
from laminar.runtime.errors import ConfigError, LaminarError
from laminar.runtime.service import READY_PREFIX
from tests.support.poll import until
from tests.support.procs import ROOT, TOKEN, env

SPAWNER = str(ROOT / "tests" / "support" / "spawner.py")
SERVE = [sys.executable, "-m", "laminar", "serve"]


def parses(argv: list[str]) -> dict[str, object]:
    """What ``laminar serve``'s parser makes of ``argv`` (after ``python -m laminar``)."""
    assert argv[:3] == [sys.executable, "-m", "laminar"], argv
    return vars(build_parser().parse_args(argv[3:]))


# -- the command line ------------------------------------------------------------------------------


def test_a_manager_joins_nothing_and_a_member_joins_it() -> None:
    manager = serve_command(ServeSpec("manager", "manager-0", Path("c.yaml")))
    assert manager == [*SERVE, "--role", "manager", "--config", "c.yaml", "--instance", "manager-0"]
    member = ServeSpec(
        "rollout",
        "rollout-1",
        "c.yaml",
        section="rollout_small",
        join="tcp://10.0.0.1:7420",
        sets=("cluster.log_level=debug", "rollout_small.engine.kind=sim"),
        bind="tcp://127.0.0.1:9000",
        args=("--set", "rollout_small.metrics=null"),
        prefix=("ip", "netns", "exec", "host1"),
    )
    argv = serve_command(member)
    assert argv == [
        *("ip", "netns", "exec", "host1"),
        *SERVE,
        *("--role", "rollout", "--config", "c.yaml", "--instance", "rollout-1"),
        *("--section", "rollout_small", "--join", "tcp://10.0.0.1:7420"),
        *("--set", "cluster.log_level=debug", "--set", "rollout_small.engine.kind=sim"),
        *("--set", "rollout_small.bind=tcp://127.0.0.1:9000"),  # after the sets: it wins
        *("--set", "rollout_small.metrics=null"),
    ]
    got = parses(argv[4:])
    assert (got["role"], got["instance"], got["section"], got["join"]) == (
        "rollout",
        "rollout-1",
        "rollout_small",
        "tcp://10.0.0.1:7420",
    )
    assert got["set"][-2:] == [
        "rollout_small.bind=tcp://127.0.0.1:9000",
        "rollout_small.metrics=null",
    ]  # type: ignore[index]


def test_a_member_with_no_manager_is_refused_by_name_unless_standalone() -> None:
    with pytest.raises(LaminarError, match="relay-0: start the manager first"):
        serve_command(ServeSpec("relay", "relay-0", "c.yaml"))
    argv = serve_command(ServeSpec("relay", "relay-0", "c.yaml", standalone=True))
    assert argv[-1] == "--standalone" and "--join" not in argv
    assert parses(argv)["standalone"] is True


def test_a_role_config_becomes_one_set_per_leaf_as_json() -> None:
    config = {"engine": {"kind": "sim", "max_tokens": 64}, "metrics": None, "name": "a b"}
    assert config_sets("rollout", config) == [
        'rollout.engine.kind="sim"',
        "rollout.engine.max_tokens=64",
        "rollout.metrics=null",
        'rollout.name="a b"',
    ]
    assert config_sets("relay", {}) == []


def test_the_supervisors_children_are_started_with_the_runs_overrides_and_their_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAMINAR_TOKEN", TOKEN)
    spawner = {"role": f"{SPAWNER}:SpawnerService", "count": 2, "config": {"stubborn": True}}
    config = tmp_path / "run.yaml"
    run = {"run_dir": str(tmp_path / "run"), "cpus": "off", "roles": [{"role": "manager"}, spawner]}
    config.write_text(yaml.safe_dump({"run": run}))
    sup = Supervisor(load_config(config), ["cluster.log_level=debug"])
    manager, first, second = sup.children
    assert sup._command(manager) == [
        *SERVE,
        *("--role", "manager", "--config", str(config), "--instance", "manager-0"),
        *("--section", "manager", "--set", "cluster.log_level=debug"),
    ]
    with pytest.raises(LaminarError, match="spawner-0: start the manager first"):
        sup._command(first)
    sup.manager_address = manager.pinned_bind = "tcp://127.0.0.1:7420"
    assert sup._command(manager)[-2:] == ["--set", "manager.bind=tcp://127.0.0.1:7420"]
    argv = sup._command(second)
    assert argv == [
        *SERVE,
        *("--role", f"{SPAWNER}:SpawnerService", "--config", str(config)),
        *("--instance", "spawner-1", "--section", "spawner", "--join", "tcp://127.0.0.1:7420"),
        *("--set", "cluster.log_level=debug", "--set", "spawner.stubborn=true"),
    ]
    assert parses(argv)["join"] == "tcp://127.0.0.1:7420"


# -- the environment -------------------------------------------------------------------------------


def test_every_process_of_a_launch_carries_its_own_readable_mark() -> None:
    base = {"PATH": "/bin", "PYTHONUNBUFFERED": "0", "KEEP": "base"}
    environ, mark = launch_env(base, {"KEEP": "extra", MARK_ENV: "a caller's"})
    assert environ["PATH"] == "/bin" and environ["KEEP"] == "extra"
    assert environ["PYTHONUNBUFFERED"] == "1"
    assert all(environ[k] == v for k, v in KEEP_ENVIRON.items())
    assert mark == f"{MARK_ENV}={environ[MARK_ENV]}" and environ[MARK_ENV] != "a caller's"
    again, other = launch_env(base)
    assert other != mark and again[MARK_ENV] != environ[MARK_ENV]
    assert base == {"PATH": "/bin", "PYTHONUNBUFFERED": "0", "KEEP": "base"}  # not changed


def test_a_launch_gets_one_good_token_the_users_or_a_new_one() -> None:
    environ = {"LAMINAR_TOKEN": TOKEN}
    ensure_token(environ, "LAMINAR_TOKEN")
    assert environ == {"LAMINAR_TOKEN": TOKEN}
    for missing in ({}, {"MY_TOKEN": ""}):
        ensure_token(missing, "MY_TOKEN")
        assert token_problem(missing["MY_TOKEN"]) is None
    weak = {"MY_TOKEN": "REPLACE-WITH-A-RANDOM-TOKEN-OF-32-HEX-CHARS"}
    with pytest.raises(ConfigError, match="token in MY_TOKEN is a placeholder"):
        ensure_token(weak, "MY_TOKEN")


def test_a_pinned_rollout_binds_its_engine_threads_to_its_cores() -> None:
    base = {"PATH": "/bin"}
    pinned = cpu_env(base, CpuSlot((2, 3), 2), "rollout")
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "2,3" and pinned["OMP_NUM_THREADS"] == "2"
    assert pinned["PATH"] == "/bin" and "VLLM_CPU_OMP_THREADS_BIND" not in base
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu_env(base, CpuSlot((2,), 1), "trainer")
    unpinned = cpu_env(base, None, "rollout")
    assert unpinned == base and unpinned is not base


# -- the ready line and the output -----------------------------------------------------------------


def test_roles_stop_callers_first_then_data_and_relays_then_the_manager() -> None:
    roles = {
        "manager": "manager",
        "data": "data",
        "rollout-0": "rollout",
        "trainer": "trainer",
        "relay-0": "relay",
        "rollout-1": "rollout",
    }
    assert stop_stages(roles) == [
        ["rollout-0", "trainer", "rollout-1"],
        ["data", "relay-0"],
        ["manager"],
    ]
    assert stop_stages({"m": "manager", "r": "rollout"}) == [["r"], ["m"]]  # no empty stage
    assert stop_stages({}) == []


def test_the_ready_line_gives_its_info_and_a_bad_one_is_named() -> None:
    info = {"address": "tcp://127.0.0.1:7420", "pid": 7}
    assert parse_ready_line(READY_PREFIX + json.dumps(info)) == info
    assert parse_ready_line("LAMINAR_READY" + json.dumps(info)) is None  # no space: not it
    assert parse_ready_line('2026-01-01 [info] {"address": "x"}') is None
    for bad, why in ((READY_PREFIX + "{cut", "Expecting"), (READY_PREFIX + "[1]", "not a JSON")):
        with pytest.raises(LaminarError, match=f"malformed ready line '{bad[:14]}.*{why}"):
            parse_ready_line(bad)


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


# -- a real role -----------------------------------------------------------------------------------


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


def test_a_cluster_member_before_its_manager_starts_nothing(tmp_path: Path) -> None:
    cluster = ProcessCluster(tmp_path / "c.yaml", tmp_path / "logs", env=env())
    with pytest.raises(LaminarError, match="rollout-0: start the manager first"):
        cluster.serve("rollout", "rollout-0")
    assert cluster.procs == {} and cluster.groups == set()
    assert not (tmp_path / "logs" / "rollout-0.log").exists()


def test_a_cluster_role_that_never_gets_ready_is_ended_and_its_log_shown(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("manager:\n  no_such_key: 1\n")
    with ProcessCluster(config, tmp_path / "logs", env=env()) as cluster:
        with pytest.raises(LaminarError, match=r"(?s)manager never became ready.*no_such_key"):
            cluster.serve("manager", "manager", timeout=60)
        proc = cluster.procs["manager"]
        assert proc.returncode is not None and cluster.groups == set()
