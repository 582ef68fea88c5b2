"""``laminar doctor`` as a command (exit status, ``laminar run`` refusing to start on a blocker
before any role starts), its import probe in a fresh interpreter, and the sandbox check on this
machine. Each check on a made-up machine is ``tests/unit/test_doctor.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from laminar import doctor as d
from laminar.doctor.facts import gather_facts
from laminar.doctor.needs import needs_from_config
from laminar.doctor.probe import ImportFacts, ImportProbe
from laminar.runtime.config import load_config
from tests.unit.test_doctor import ROOT


def test_the_agentic_example_asks_for_a_sandbox_and_gets_one_here() -> None:
    config = load_config(ROOT / "examples" / "arith_tool" / "config.yaml")
    needs = needs_from_config(config)
    assert needs.environment == "examples/arith_tool/task.py:Calculator"
    assert (
        needs_from_config(load_config(ROOT / "examples" / "arith" / "config.yaml")).environment
        is None
    )
    facts = gather_facts(sandbox=True)  # one real jailed `pass`
    assert facts.sandbox_probed and facts.sandbox_problem is None, facts.sandbox_problem


def importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> Path:
    """A module ``name`` the probe's fresh interpreters (and this one) can import."""
    module = tmp_path / f"{name}.py"
    module.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return module


def test_import_probe_asks_a_fresh_interpreter_every_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importable(tmp_path, monkeypatch, "laminar_probe_me", "__version__ = '1.0'\n")
    first = ImportProbe(["laminar_probe_me", "no_such_module_laminar"])
    facts = first.result()
    assert facts["laminar_probe_me"] == ImportFacts("laminar_probe_me", True, "1.0")
    assert not facts["no_such_module_laminar"].installed
    # broken after it once imported (as a removed libnuma breaks vLLM): nothing remembered hides it
    module.write_text("raise ImportError('libnuma.so.1: cannot open shared object file')\n")
    broken = ImportProbe(["laminar_probe_me"]).result()["laminar_probe_me"]
    assert broken.installed and broken.error is not None and "libnuma" in broken.error
    # a module that cannot be found is known without starting an interpreter
    assert ImportProbe(["no_such_module_laminar"]).process is None


def test_doctor_kills_its_probe_when_gathering_the_facts_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    importable(tmp_path, monkeypatch, "laminar_probe_slow", "import time\ntime.sleep(120)\n")
    probes: list[ImportProbe] = []

    def slow_probe(*args: object, **kw: object) -> ImportProbe:
        probes.append(ImportProbe(["laminar_probe_slow"]))
        return probes[-1]

    def statvfs_refused(*args: object, **kw: object) -> None:
        raise PermissionError(13, "Permission denied", "/srv/runs")

    monkeypatch.setattr(d, "probe_for", slow_probe)
    monkeypatch.setattr(d, "gather_facts", statvfs_refused)
    try:
        with pytest.raises(PermissionError):
            d.doctor(None)
        [probe] = probes
        assert probe.process is not None and probe.process.poll() is not None  # killed, reaped
    finally:  # the test's own cleanup, should doctor have left one running
        for left in probes:
            if left.process is not None and left.process.poll() is None:
                left.process.kill()
                left.process.wait()


def laminar(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LAMINAR_TOKEN"}
    return subprocess.run([sys.executable, "-m", "laminar", *args], capture_output=True,
                          text=True, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                          timeout=90)  # fmt: skip


def missing_model_config(tmp_path: Path, extra_roles: str = "") -> Path:
    config = tmp_path / "missing.yaml"
    config.write_text(f"""
trainer: {{model: {tmp_path}/runs/models/never-made}}
run:
  run_dir: {tmp_path}/run
  roles:
    - role: manager
    - role: trainer{extra_roles}
""")
    return config


def test_doctor_exits_1_on_a_blocker_naming_the_problem_and_its_fix(tmp_path: Path) -> None:
    out = laminar("doctor", str(missing_model_config(tmp_path)))
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("BLOCKER"))
    assert (
        "never-made (trainer.model) does not exist" in line
        and "fix: run `make run EXAMPLE=" in line
    )
    assert "1 blocker" in out.stdout.splitlines()[-1]
    as_json = json.loads(laminar("doctor", str(missing_model_config(tmp_path)),
                                 "--json").stdout)  # fmt: skip
    assert as_json["blockers"] == 1
    (blocker,) = [f for f in as_json["findings"] if f["severity"] == "blocker"]
    assert blocker["name"] == "model" and "make run" in blocker["fix"]


def test_doctor_exits_0_without_blockers_and_serve_without_a_token_blocks(tmp_path: Path) -> None:
    config = tmp_path / "fine.yaml"
    config.write_text(f"run: {{run_dir: {tmp_path}/run, roles: [{{role: manager}}]}}\n")
    out = laminar("doctor", str(config))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 blockers" in out.stdout.splitlines()[-1]
    serve = laminar("doctor", str(config), "--serve", "manager")
    assert serve.returncode == 1 and "LAMINAR_TOKEN is not set" in serve.stdout


def test_laminar_run_refuses_to_start_on_a_blocker_before_any_role(tmp_path: Path) -> None:
    out = laminar("run", str(missing_model_config(tmp_path)))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "refusing to start" in out.stderr and "(model)" in out.stderr
    assert "never-made (trainer.model) does not exist" in out.stdout and "make run" in out.stdout
    assert not (tmp_path / "run").exists()  # no run directory: nothing was started


def test_skip_doctor_goes_straight_to_the_supervisor(tmp_path: Path) -> None:
    # two managers: the supervisor rejects the config before starting anything, which shows
    # that --skip-doctor got past the (blocking) preflight without running a role
    config = missing_model_config(tmp_path, extra_roles="\n    - role: manager")
    out = laminar("run", str(config), "--skip-doctor")
    assert out.returncode == 2 and "exactly one manager" in out.stderr
    assert "refusing to start" not in out.stderr and not (tmp_path / "run").exists()
