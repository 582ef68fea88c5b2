"""The supervisor validates and plans a run without importing torch, in a fresh interpreter. The
registry itself is ``tests/unit/test_roles_registry.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


HEAVY = ("torch", "transformers", "vllm")


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
