"""``laminar run`` when a role fails: the reason on the console, a run that ends at once when a
role cannot run, and a non-zero exit whenever a role it needed ended dead.

Real processes throughout: a data role whose prompt file has a bad record (refused at its start:
status 78, the run ends at once), a role that fails the same way at every start, before or after
it became ready (ended after the second identical failure), a run that loses one of two
instances (it goes on and exits 1, naming the dead one), and the Ray launcher's driver and actor
code on a stand-in for Ray (the decision and the exit status are the driver's, from what the
actor reports). Every run's processes carry a tag in their environment, and none may outlive it.
A vLLM rollout whose engine refuses its model is ``tests/slow/test_vllm_failure.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from laminar.proc.procfs import KEEP_ENVIRON
from laminar.runtime.config import load_config
from tests.support.devrun import STARTUP_S, write_run_config
from tests.support.failed_runs import DURATION_S, TAG, ended, launched, said, tagged
from tests.support.procs import ROOT
from tests.support.task import write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FAILING = f"{ROOT / 'tests' / 'support' / 'failing_roles.py'}:Failing"
#: A bound on a hang, not a timing check (each run takes seconds alone).
ENDS_S = STARTUP_S


def test_a_prompt_file_refused_at_start_ends_the_run_at_once_with_its_reason(
    tmp_path: Path,
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    records = [{"id": "p0", "prompt": "1+1="}, {"id": "a/b", "prompt": "2+2="}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = {
        "prompts": str(prompts),
        "tokenizer": str(write_tokenizer(tmp_path / "tok")),
        "reward": "tests.support.task:reward_len",
        "store": str(tmp_path / "data.sqlite"),
        "metrics": None,
    }
    with launched(tmp_path, [{"role": "data", "config": data}]) as run:
        out = ended(run)
    assert run.returncode == 1, out
    lines = said(out)
    refused = f"laminar serve: {prompts}: record 1: prompt id 'a/b'"
    exit_line = next(line for line in lines if line.startswith("data-0 exited"))
    assert exit_line.startswith(f"data-0 exited with code 78: {refused}"), out
    assert "'/'" in exit_line and exit_line.endswith(
        "; not restarting: its configuration was refused (a restart would be refused the same way)"
    ), out
    assert "ending the run: data-0's configuration was refused" in lines, out
    assert not any("restarting (" in line for line in lines), out
    assert lines[-3] == "all roles stopped", out
    assert lines[-2].startswith(f"data-0 ended dead: exited with code 78: {refused}"), out
    assert lines[-1] == "run failed (exit status 1): data-0's configuration was refused", out


@pytest.mark.parametrize("when", ["start", "ready"])
def test_a_role_failing_the_same_way_at_every_start_ends_the_run(tmp_path: Path, when: str) -> None:
    """Its first failure is restarted; the second, identical but for a pid, ends the run."""
    with launched(tmp_path, [{"role": FAILING, "config": {"fail": when}}]) as run:
        out = ended(run)
    assert run.returncode == 1, out
    lines = said(out)
    reason = r"code 1: RuntimeError: the device is gone \(pid \d+\)"
    exits = [line for line in lines if line.startswith("failing-0 exited")]
    assert len(exits) == 2, out
    assert re.fullmatch(rf"failing-0 exited with {reason}; restarting \(1/3\)", exits[0]), out
    again = "before it was ready" if when == "start" else r"\d+ s after it was ready"
    assert re.fullmatch(
        rf"failing-0 exited with {reason}; not restarting: it failed the same way twice in a "
        rf"row, {again} \(a restart would fail again\)",
        exits[1],
    ), out
    assert "ending the run: failing-0 fails the same way at every start" in lines, out
    assert re.fullmatch(rf"failing-0 ended dead: exited with {reason}", lines[-2]), out
    assert lines[-1] == "run failed (exit status 1): failing-0 fails the same way at every start"


def read_until(run: subprocess.Popen[str], wanted: Callable[[str], bool]) -> str:
    """What ``run`` prints, up to the first line ``wanted`` (a bound on a hang: ENDS_S)."""
    assert run.stdout is not None
    seen: list[str] = []

    def read() -> None:
        for line in run.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if wanted(line):
                return

    async def bounded() -> None:
        async with asyncio.timeout(ENDS_S):
            await asyncio.to_thread(read)

    try:
        asyncio.run(bounded())
    except TimeoutError:
        raise AssertionError(f"not seen within {ENDS_S} s:\n{''.join(seen)[-4000:]}") from None
    assert seen and wanted(seen[-1]), "".join(seen)[-4000:]
    return "".join(seen)


def test_a_run_that_lost_one_of_two_instances_goes_on_and_exits_non_zero(tmp_path: Path) -> None:
    roles = [
        {"role": FAILING, "section": "bad", "restart": "never", "config": {"fail": "start"}},
        {"role": FAILING, "section": "good"},
    ]
    with launched(tmp_path, roles) as run:
        first = read_until(run, lambda line: "the run goes on without" in line)
        run.send_signal(signal.SIGINT)  # what Ctrl-C does
        out = first + ended(run)
    assert run.returncode == 1, out
    lines = said(out)
    assert (
        f"the run goes on without bad-0 (1 of 2 {FAILING} instances left); it will end with "
        "status 1"
    ) in lines, out
    assert not any(line.startswith("good-0 exited") for line in lines), out
    assert not any("ending the run" in line for line in lines), out
    assert re.fullmatch(
        r"bad-0 ended dead: exited with code 1: RuntimeError: the device is gone \(pid \d+\)",
        lines[-2],
    ), out
    assert lines[-1] == "run failed (exit status 1): 1 role instance(s) ended dead", out


# -- the Ray launcher's driver and actors, on a stand-in for Ray -----------------------------------


class _Ref:
    def __init__(self, task: asyncio.Future[Any]) -> None:
        self.task = task

    def future(self) -> asyncio.Future[Any]:
        return self.task  # what laminar.devmode.ray_cluster.result awaits


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> _Ref:
        return _Ref(asyncio.ensure_future(self.fn(*args, **kwargs)))


class _Actor:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.obj, name))


class _ActorClass:
    def __init__(self, cls: type) -> None:
        self.cls = cls

    def options(self, **kwargs: Any) -> _ActorClass:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> _Actor:
        return _Actor(self.cls(*args, **kwargs))


class _RayError(Exception):
    pass


class StandInRay:
    """What :class:`RayProcesses` asks of Ray, in this process: each actor is its object on
    this event loop, each remote call a task."""

    class exceptions:  # as ray.exceptions
        RayError = _RayError

    def remote(self, cls: type) -> _ActorClass:
        return _ActorClass(cls)

    def kill(self, actor: _Actor) -> None:
        pass


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (the dev extra)")
async def test_the_ray_launcher_ends_the_run_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from laminar.devmode.ray_launch import Place, RayProcesses, RaySupervisor
    from laminar.devmode.ray_place import Demand, Machine
    from laminar.devmode.supervisor import Supervisor

    tag = uuid.uuid4().hex
    for key, value in {TAG: tag, **KEEP_ENVIRON}.items():
        monkeypatch.setenv(key, value)
    roles = [{"role": FAILING, "config": {"fail": "start"}}]
    config = write_run_config(tmp_path, roles, display="lines", duration_s=DURATION_S)
    monkeypatch.chdir(ROOT)
    out = StringIO()
    sup = RaySupervisor(load_config(str(config), []), [], Console(file=out, width=400))
    machine = Machine("node-0", "127.0.0.1", 2.0, 0.0)
    places = {
        c.name: Place(machine, None, i, Demand(c.name, c.role, 0.1))
        for i, c in enumerate(sup.children)
    }
    sup.processes = RayProcesses(  # type: ignore[assignment]  # what RaySupervisor.run builds
        ray=StandInRay(),
        places=places,
        home="node-0",
        env=sup.env,
        mark=sup.mark,
        grace=sup.config.run.shutdown_grace_s,
        log_dir=tmp_path / "run" / "logs",
        stopping=sup.stopping,
        command=sup._command,
        echo=sup._echo,
        say=sup.say,
        gave_up=sup._gave_up,
    )
    try:
        async with asyncio.timeout(ENDS_S):
            code = await Supervisor.run(sup)  # all but connecting to Ray
    finally:
        left = tagged(tag)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    text = out.getvalue()
    assert not left, f"processes of the run outlived it: {left}\n{text}"
    assert code == 1, text
    lines = said(text)
    exits = [line for line in lines if line.startswith("failing-0 exited")]
    reason = r"code 1: RuntimeError: the device is gone \(pid \d+\)"
    assert len(exits) == 2 and re.fullmatch(
        rf"failing-0 exited with {reason}; restarting \(1/3\)", exits[0]
    ), text
    assert "not restarting: it failed the same way twice in a row, before it was ready" in exits[1]
    assert lines[-1] == "run failed (exit status 1): failing-0 fails the same way at every start"
