"""Every Slurm script of examples/deploy/ passes ``bash -n``. The manifests against the Kubernetes
schemas and the Ray example's command lines are ``tests/unit/test_deploy_manifests.py``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.unit.test_deploy_manifests import DEPLOY

SCRIPTS = sorted((DEPLOY / "slurm").glob("*.sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_slurm_scripts_are_valid_bash(script: Path) -> None:
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
