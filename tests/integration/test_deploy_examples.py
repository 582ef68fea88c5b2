"""The deployment examples' Slurm script passes ``bash -n``. What is checked without a process is
``tests/unit/test_deploy_examples.py``."""

from __future__ import annotations

from tests.unit.test_deploy_examples import SBATCH


def test_sbatch_is_valid_bash() -> None:
    import subprocess

    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
