"""The rollout package's structure, read from its source (no import): what each module may use.

* ``state.py`` is pure: it imports no I/O, no asyncio and nothing of the runtime, so the phase
  rules are testable on their own and cannot grow side effects.
* ``migration.py`` never imports the service (it once did at run time, a cycle): it talks to the
  ``MigratingRollout`` protocol.
* No module reads the real clock or sleeps outside the service's clock (``ctx.clock``), so the
  rollout runs unchanged under virtual time.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROLLOUT = Path(__file__).resolve().parents[2] / "roles" / "rollout"


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
    return out


def test_the_phase_machine_imports_nothing_that_does_io():
    # .api: the role's contract, where the public phase it decides is declared (no I/O there)
    allowed = {"__future__", "enum", "collections.abc", ".api"}
    assert imports(ROLLOUT / "state.py") <= allowed


def test_migration_does_not_import_the_service():
    found = imports(ROLLOUT / "migration.py")
    assert ".service" not in found and not any(m.endswith("rollout.service") for m in found)


def test_no_real_clock_or_bare_sleep_in_the_rollout():
    banned = {("time", "time"), ("time", "monotonic"), ("time", "perf_counter")}
    banned |= {("asyncio", "sleep")}
    offenders = []
    for path in sorted(ROLLOUT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and (node.value.id, node.attr) in banned
            ):
                offenders.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio"):
                names = {a.name for a in node.names}
                offenders += [f"{path.name}:{node.lineno} from {node.module} import {n}"
                              for n in names if (node.module, n) in banned]  # fmt: skip
    assert offenders == []
