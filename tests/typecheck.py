"""Type-check the tree as it is installed: ``roles/`` and ``transport/`` as ``laminar.roles`` and
``laminar.transport`` (``make test`` runs this; docs/architecture.md, *Types*).

Why not plain ``mypy``: mypy names a module by its directory, so it would check ``roles/`` as a
package ``roles`` and find no ``laminar.roles``: the editable install maps those names through an
import hook mypy cannot follow, and every import of a role or of the transport would be typed
``Any``, the hole a type checker is there to close. So the installed layout is built from
symlinks under ``.mypy_tree/`` and mypy runs there, with the project's own configuration; its
report names files as the repository spells them.

Usage: ``python tests/typecheck.py [mypy options]``; exits with mypy's status.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / ".mypy_tree"

#: installed package -> where it lives in the repository (pyproject's package-dir mapping)
MAPPED = {"laminar/roles": "roles", "laminar/transport": "transport"}


def build_tree() -> None:
    """``.mypy_tree/laminar``: every entry of ``laminar/`` plus the two mapped packages, linked."""
    shutil.rmtree(TREE, ignore_errors=True)
    package = TREE / "laminar"
    package.mkdir(parents=True)
    for entry in sorted((REPO / "laminar").iterdir()):
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for installed, source in MAPPED.items():
        (TREE / installed).symlink_to(REPO / source)


def as_repo_path(line: str) -> str:
    """A report line with its file named as the repository spells it."""
    for installed, source in MAPPED.items():
        line = re.sub(rf"^{re.escape(installed)}/", f"{source}/", line)
    return line


def main(args: list[str]) -> int:
    build_tree()
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), *args],
        cwd=TREE,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in (done.stdout + done.stderr).splitlines():
        print(as_repo_path(line))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
