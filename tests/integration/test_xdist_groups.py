"""`make test` relies on pytest-xdist's ``--dist loadgroup``: the tests that share one vLLM engine
or one two-rollout cluster (tests/slow/conftest.py) carry one ``xdist_group`` mark so that they run
on one worker and the fixture starts once. With pytest 9.2 and xdist 3.8 the marks were ignored
without a word (pytest-dev/pytest-xdist#1386): each worker started the shared engine again and
the suite grew by a minute. This runs a grouped pair of tests the way `make test` does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("shared")


@pytest.mark.parametrize("i", range(4))
def test_where(i):
    with open(os.environ["WHERE_FILE"], "a") as fh:
        print(os.environ["PYTEST_XDIST_WORKER"], file=fh)
"""


def test_grouped_tests_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text(GROUPED)
    (tmp_path / "test_b.py").write_text(GROUPED)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-s", "-q",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "WHERE_FILE": str(tmp_path / "where")},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    workers = (tmp_path / "where").read_text().split()
    assert len(workers) == 8 and len(set(workers)) == 1, workers
