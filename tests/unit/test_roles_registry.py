"""A built-in role's config is validated from a light module, and that module is the role's own.

Why: ``laminar run`` and ``laminar doctor`` validate every role's section before anything starts.
Loading the service classes for that imported torch and transformers through the trainer (11 s
to reject a typo in a config, measured); ``BUILTIN_CONFIGS`` names each role's config model in a
module that imports neither. These tests keep that table equal to the classes it stands for, and
prove the supervisor's whole set-up imports no torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.roles_registry import BUILTIN, BUILTIN_CONFIGS, load_role, load_role_config
from laminar.runtime.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "vllm")


def test_every_builtin_role_has_a_light_config_that_is_its_services() -> None:
    assert set(BUILTIN_CONFIGS) == set(BUILTIN)
    for name in BUILTIN:
        cls = load_role(name)
        assert load_role_config(name) == (cls.role, cls.config_model), name


def test_a_role_of_ones_own_is_read_from_its_class() -> None:
    role, model = load_role_config("tests.support.roles:Calculator")
    cls = load_role("tests.support.roles:Calculator")
    assert (role, model) == (cls.role, cls.config_model)
    with pytest.raises(ConfigError, match="unknown role"):
        load_role_config("no_such_role")


_PROBE = """
import json, sys, tempfile
from pathlib import Path
from laminar.runtime.config import load_config
from laminar.devmode.supervisor import Supervisor
from laminar.roles_registry import BUILTIN_CONFIGS, load_role_config
from laminar.tracking import plan_for_run

for name in BUILTIN_CONFIGS:
    load_role_config(name)
for path in sys.argv[1:]:
    sup = Supervisor(load_config(path), overrides=[])  # validates every role; starts nothing
    roles = [(c.role, c.section, c.spec.config) for c in sup.children]
    plan_for_run(sup.config, roles, Path(tempfile.mkdtemp()))  # the run's first step
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def test_the_supervisor_validates_and_plans_a_run_without_torch() -> None:
    configs = [str(REPO / "examples" / name / "config.yaml") for name in ("arith", "hello")]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY), *configs],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []
