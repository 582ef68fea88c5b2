"""The one launcher (:mod:`laminar.proc.spawn`): the command line and environment a role is started
with and its ready line. Real processes (a role started, seen ready and ended with its group; its
output) are ``tests/integration/test_spawn.py``.

Both ``laminar run`` (:class:`laminar.devmode.supervisor.Supervisor`) and :class:`laminar.harness.launch.
ProcessCluster` go through it; the tests of their command lines check the argv they give, and that
``laminar serve``'s own parser takes it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from laminar.cli import build_parser
from laminar.devmode.supervisor import Supervisor
from laminar.harness.launch import ProcessCluster
from laminar.proc.cpus import CpuSlot
from laminar.proc.procfs import KEEP_ENVIRON, MARK_ENV
from laminar.proc.spawn import (
    ServeSpec,
    config_sets,
    cpu_env,
    ensure_token,
    launch_env,
    parse_ready_line,
    serve_command,
    stop_stages,
)
from laminar.runtime.config import load_config, token_problem
from laminar.runtime.errors import ConfigError, LaminarError
from laminar.runtime.service import READY_PREFIX
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


# -- a real role -----------------------------------------------------------------------------------


def test_a_cluster_member_before_its_manager_starts_nothing(tmp_path: Path) -> None:
    cluster = ProcessCluster(tmp_path / "c.yaml", tmp_path / "logs", env=env())
    with pytest.raises(LaminarError, match="rollout-0: start the manager first"):
        cluster.serve("rollout", "rollout-0")
    assert cluster.procs == {} and cluster.groups == set()
    assert not (tmp_path / "logs" / "rollout-0.log").exists()
