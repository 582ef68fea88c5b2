"""The package layering, read from the source: no import cycles, imports point one way, the
contracts import no torch, role code reads time only through its clock and runs blocking work
only through its context's executors, and no code of the project times out with
``asyncio.wait_for`` or suppresses a ``CancelledError`` (both lose cancellations).

Why: an import cycle works until the day the import order changes (a new entry point, a lazy
import moved), and then fails far from its cause; a stray ``import torch`` costs the manager
seconds and gigabytes on a machine with no GPU. Reading the source with :mod:`ast` sees every
import a module can run, including the ones inside functions, without running any of them; only
the torch check imports for real (in a subprocess), since torch arrives through third parties too.

The checkers are plain functions, each proven on a small synthetic input that breaks its rule;
the tests below them apply them to ``laminar/``, ``roles/`` and ``transport/``. What concerns
the role packages is checked by tests of its own, so a failure names the layer it is in.

The graph counts module-level and function-level imports; imports under ``if TYPE_CHECKING:``
are left out (they never run). ``from pkg import name`` is an edge to ``pkg``, and to
``pkg.name`` too when that is a module: so a submodule that imports from its own package (a name
the ``__init__`` re-exports, or ``from . import sibling``) closes a cycle with the package's
``__init__``; import from the defining module instead (``from .sibling import x``). The parents
of an imported module are not counted: Python has them loaded, or loading, already.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: package name -> directory (pyproject's package-dir mapping: roles/ and transport/ install
#: under the laminar namespace).
ROOTS = {
    "laminar": REPO / "laminar",
    "laminar.roles": REPO / "roles",
    "laminar.transport": REPO / "transport",
}

#: what the source may spell at the top level -> the installed name.
ALIASES = {"roles": "laminar.roles", "transport": "laminar.transport"}

#: modules that must import neither torch nor vLLM: the CLI, the role contracts and the control
#: plane (the manager, its admin API and the data role run where there is no GPU).
TORCH_FREE_RUNTIME = ["laminar.runtime.service", "laminar.cli", "laminar.devmode.status"]
TORCH_FREE_ROLES = [
    "laminar.roles.manager.service",
    "laminar.roles.manager.admin",
    "laminar.roles.data.service",
    "laminar.roles.rollout.api",
    "laminar.roles.manager.api",
    "laminar.roles.trainer.api",
    "laminar.roles.data.api",
    "laminar.roles.relay",
    "laminar.roles.trainer.config",  # what `laminar run` validates before it starts anything
    "laminar.roles.trainer.sim",  # the emulated trainer publishes real bytes without a model
]

#: time sources role code must take from its clock (``ServiceContext.clock``) instead.
RAW_TIME = {
    ("time", "time"),
    ("time", "time_ns"),
    ("time", "monotonic"),
    ("time", "monotonic_ns"),
    ("time", "perf_counter"),
    ("time", "perf_counter_ns"),
    ("asyncio", "sleep"),
}

#: ways of picking one's own threads that role code (and the weight path and engines it hands an
#: executor to) must leave to ``ServiceContext.executor``: as attributes whatever they hang on
#: (``asyncio.to_thread``, ``loop.run_in_executor``, ``cf.ThreadPoolExecutor``), or imported.
OWN_THREADS = {"to_thread", "run_in_executor", "ThreadPoolExecutor"}
OWN_THREADS_FROM = {"asyncio", "concurrent.futures"}

#: where that holds (laminar.engines: the rollout hands its engine an executor).
EXECUTOR_USERS = [
    ROOTS["laminar.roles"],
    ROOTS["laminar"] / "weights",
    ROOTS["laminar"] / "engines",
]


# -- the import graph ---------------------------------------------------------------------------


def module_files(roots: Mapping[str, Path]) -> dict[str, Path]:
    """Every module under ``roots`` by its dotted name (a package by its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for prefix, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def _canonical(name: str, aliases: Mapping[str, str]) -> str:
    head, _, rest = name.partition(".")
    if head in aliases:
        return aliases[head] + ("." + rest if rest else "")
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_only: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth; those under ``if TYPE_CHECKING:`` too
    where ``type_only``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _deepest(name: str, modules: Mapping[str, Path]) -> str | None:
    """``name`` or the nearest enclosing package of it that is one of ours (None: external)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(
    roots: Mapping[str, Path], aliases: Mapping[str, str] = ALIASES, *, type_only: bool = False
) -> dict[str, dict[str, int]]:
    """module -> {imported module of ours: line of the first such import} (``type_only``: the
    imports under ``if TYPE_CHECKING:`` counted too)."""
    modules = module_files(roots)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _imports(ast.parse(path.read_text(), filename=str(path)), type_only):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_deepest(_canonical(a.name, aliases), modules) for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = _canonical(node.module or "", aliases)
                targets.append(_deepest(source, modules))
                targets += [f"{source}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted.

    By reachability (a few hundred modules: quadratic is milliseconds, and plain to read): two
    modules share a component when each reaches the other.
    """
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for target in graph.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        reach[start] = seen
    found: list[list[str]] = []
    for module in sorted(graph):
        component = sorted(m for m in reach[module] if module in reach.get(m, ()))
        if len(component) > 1 and component not in found:
            found.append(component)
    return found


def describe_cycles(
    graph: Mapping[str, Mapping[str, int]], components: list[list[str]], files: Mapping[str, Path]
) -> str:
    """Each component with the imports that close it (``a -> b (a.py:12)``), for the failure."""
    lines = []
    for component in components:
        members = set(component)
        lines.append("cycle: " + ", ".join(component))
        for module in component:
            for target, line in sorted(graph[module].items()):
                if target in members:
                    lines.append(f"    {module} -> {target}  ({_shown(files[module])}:{line})")
    return "\n".join(lines)


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


#: packages that sit on top: they may import anything (roles through their ``api``), and only
#: each other import them. The rest of ``laminar`` is libraries that roles and tools share.
TOOLING = (
    "laminar.__main__",
    "laminar.cli",
    "laminar.devmode",
    "laminar.doctor",
    "laminar.harness",
    "laminar.simulate",
)


def _role_of(module: str) -> str | None:
    """``laminar.roles.X`` for a module of role X (None: not a role's)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if _in(module, "laminar.roles") and len(parts) > 2 else None


def layering_violations(graph: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Imports against the one-way rule tooling -> roles -> libraries -> runtime -> transport."""
    bad = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            why = _against(module, target)
            if why:
                bad.append(f"{module}:{line} imports {target} ({why})")
    return bad


def _against(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target`` (None: it may)."""
    if _in(module, "laminar.transport"):
        return None if _in(target, "laminar.transport") else "transport knows nothing above it"
    if _in(module, "laminar.runtime"):
        ok = _in(target, "laminar.runtime") or _in(target, "laminar.transport")
        return None if ok else "the runtime imports only itself and transport"
    role, target_role = _role_of(module), _role_of(target)
    if target_role is not None and target_role != role and target != target_role + ".api":
        return "a role is imported only through its api"
    if target == "laminar.roles" and not _in_tooling(module):
        return "import a role's api, not the roles package"
    if _in(target, "laminar.harness") and not _may_use_harness(module, target):
        return "only tests use the harnesses"
    if _in(target, "laminar.devmode") and not _may_use_devmode(module):
        return "the dev mode sits on top"
    if _in_tooling(target) and not _in_tooling(module):
        return "tooling sits on top"
    return None


def _in_tooling(module: str) -> bool:
    return any(_in(module, package) for package in TOOLING)


#: the one harness a command runs: ``laminar simulate run`` is the in-process cluster (its module
#: and its loop and fence).
HARNESS_USERS = {"laminar.simulate": "laminar.harness.inproc"}


def _may_use_harness(module: str, target: str) -> bool:
    if _in(module, "laminar.harness"):
        return True
    return any(_in(module, u) and target.startswith(h) for u, h in HARNESS_USERS.items())


#: who may import the dev mode (laminar.devmode): itself and the CLI that starts it.
DEVMODE_USERS = ("laminar.devmode", "laminar.cli")


def _may_use_devmode(module: str) -> bool:
    return any(_in(module, user) for user in DEVMODE_USERS)


# -- raw time ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RawTime:
    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        return f"{_shown(self.path)}:{self.line}: {self.what}"


def raw_time_uses(path: Path) -> list[RawTime]:
    """Every use of a real-time source in one file, under whatever name it was imported.

    A use, not only a call: ``default_factory=time.time`` reads real time just the same.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: dict[str, str] = {}  # local name -> "time" / "asyncio"
    functions: dict[str, tuple[str, str]] = {}  # local name -> ("time", "monotonic")
    wanted_modules = {m for m, _ in RAW_TIME}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in wanted_modules:
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if (node.module, alias.name) in RAW_TIME:
                    functions[alias.asname or alias.name] = (node.module, alias.name)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (modules.get(node.value.id), node.attr) in RAW_TIME
        ):
            found.append(RawTime(path, node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in functions:
            module, attr = functions[node.id]
            found.append(RawTime(path, node.lineno, f"{node.id} ({module}.{attr})"))
    return sorted(found, key=lambda r: r.line)


def raw_time_in(root: Path) -> list[RawTime]:
    return [use for path in sorted(root.rglob("*.py")) for use in raw_time_uses(path)]


# -- threads picked by hand --------------------------------------------------------------------


def own_threads_uses(path: Path) -> list[RawTime]:
    """Every place one file picks its own threads (``OWN_THREADS``), under whatever name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported: dict[str, str] = {}  # local name -> "asyncio.to_thread"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in OWN_THREADS_FROM:
            for alias in node.names:
                if alias.name in OWN_THREADS:
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in OWN_THREADS:
            found.append(RawTime(path, node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in imported:
            found.append(RawTime(path, node.lineno, f"{node.id} ({imported[node.id]})"))
    return sorted(found, key=lambda r: r.line)


# -- timeouts that swallow a cancellation ------------------------------------------------------


def wait_for_uses(path: Path) -> list[RawTime]:
    """Every use of ``asyncio.wait_for`` in one file, under whatever name it was imported.

    Why it is banned: on Python 3.11 ``wait_for`` loses a cancellation that arrives while its
    inner awaitable finishes (cpython gh-86296: it returns the inner result, or raises its error,
    instead of ``CancelledError``). A loop that retries, or waits on an event with a timeout,
    then never ends: a relay's forwarder retrying refused connects outlived its stop by 60 s.
    ``async with asyncio.timeout(...)`` runs the awaitable in the task itself and loses nothing.
    (``asyncio.Condition.wait_for`` is another function and is not matched.)
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    functions: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "asyncio"}
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncio" and node.level == 0:
            functions |= {a.asname or a.name for a in node.names if a.name == "wait_for"}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "wait_for"
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(RawTime(path, node.lineno, f"{node.value.id}.wait_for"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in functions:
            found.append(RawTime(path, node.lineno, f"{node.id} (asyncio.wait_for)"))
    return sorted(found, key=lambda r: r.line)


def swallowed_cancel_uses(path: Path) -> list[RawTime]:
    """Every ``contextlib.suppress(...)`` naming ``CancelledError`` or ``BaseException``.

    Why: it is how a task awaits one it cancelled (``task.cancel()``, then ``await task`` with the
    error suppressed), and it swallows a cancellation of the waiter arriving meanwhile: the
    weight publisher's push loop went on retrying after its owner stopped. Wait for the task
    with ``asyncio.wait([task])`` instead, which raises neither the task's error nor swallows
    the waiter's cancellation.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name != "suppress":
            continue
        for arg in node.args:
            caught = arg.attr if isinstance(arg, ast.Attribute) else getattr(arg, "id", None)
            if caught in ("CancelledError", "BaseException"):
                found.append(RawTime(path, node.lineno, f"suppress({caught})"))
    return sorted(found, key=lambda r: r.line)


# -- torch-free imports ------------------------------------------------------------------------


_PROBE = """
import importlib, json, sys, traceback
found = {}
for name in sys.argv[1:]:
    before = {m for m in ("torch", "vllm") if m in sys.modules}
    try:
        importlib.import_module(name)
    except BaseException:
        found[name] = "import failed: " + traceback.format_exc(limit=-3)
        continue
    found[name] = sorted(m for m in ("torch", "vllm") if m in sys.modules and m not in before)
print(json.dumps(found))
"""


def heavy_imports(modules: list[str]) -> dict[str, list[str] | str]:
    """module -> which of torch and vLLM importing it loaded (or why it did not import).

    One fresh interpreter imports them in order (one per module would cost a second each): a
    module is charged with what was not loaded before it, so after the first offender the rest
    can only be cleared, never wrongly blamed. Fix that one and the next shows.
    """
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"the import probe failed:\n{done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _torch_report(found: Mapping[str, list[str] | str]) -> str:
    return "\n".join(f"{module}: {what}" for module, what in found.items() if what)


# -- the checkers, on trees that break their rules ------------------------------------------------


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cycle_check_sees_function_level_reexport_and_aliased_cycles(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "from .a import A\nfrom .b import B\n",
            # a submodule importing from its package (a re-exported name, or a sibling module
            # through the package): a cycle with the __init__, which imports the submodule
            "a.py": "A = 1\ndef f():\n    from pkg import B\n    from pkg import helper\n",
            "b.py": "B = 2\n",
            "helper.py": "",
            # function-level, relative, two levels up
            "sub/__init__.py": "",
            "sub/x.py": "def g():\n    from ..sub import y\n",
            "sub/y.py": "import pkg.sub.x as x\n",
            # through the alias: top-level "other" installs as pkg.other
            "sub/z.py": "from other import w\n",
            # type-only imports never run: no cycle
            "t1.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import t2\n",
            "t2.py": "from . import t1\n",
        },
    )
    _write(tmp_path / "other", {"__init__.py": "", "w.py": "from pkg.sub import z\n"})
    roots = {"pkg": tmp_path / "pkg", "pkg.other": tmp_path / "other"}
    graph = import_graph(roots, {"other": "pkg.other"})
    assert graph["pkg.a"] == {"pkg": 3, "pkg.helper": 4}
    assert graph["pkg.t2"] == {"pkg": 1, "pkg.t1": 1}
    assert sorted(cycles(graph)) == [
        ["pkg", "pkg.a"],
        ["pkg.other.w", "pkg.sub.z"],
        ["pkg.sub.x", "pkg.sub.y"],
    ]
    text = describe_cycles(graph, cycles(graph), module_files(roots))
    assert "pkg.sub.x -> pkg.sub.y" in text and "x.py:2" in text


def test_layering_check_sees_upward_imports(tmp_path: Path) -> None:
    _write(tmp_path / "laminar", {"__init__.py": "", "core.py": "def f():\n    import roles.r\n"})
    _write(tmp_path / "roles", {"__init__.py": "", "r.py": "from laminar import core\n"})
    _write(tmp_path / "transport", {"__init__.py": "", "t.py": "from laminar.core import f\n"})
    roots = {
        "laminar": tmp_path / "laminar",
        "laminar.roles": tmp_path / "roles",
        "laminar.transport": tmp_path / "transport",
    }
    bad = layering_violations(import_graph(roots))
    assert len(bad) == 2, bad
    assert bad[0].startswith("laminar.core:2 imports laminar.roles.r")
    assert bad[1].startswith("laminar.transport.t:1 imports laminar.core")


def test_raw_time_check_sees_every_alias(tmp_path: Path) -> None:
    path = tmp_path / "role.py"
    path.write_text(
        "import asyncio as aio\n"
        "import time\n"
        "from time import perf_counter as pc, sleep\n"
        "from dataclasses import field\n"
        "async def f(clock):\n"
        "    await aio.sleep(1)\n"
        "    t = time.time() + pc()\n"
        "    stamp: float = field(default_factory=time.monotonic)\n"
        "    sleep(1)  # blocking, but not a time source: another check's business\n"
        "    await clock.sleep(1)\n"
        "    return clock.time() + t\n"
    )
    assert [(u.line, u.what) for u in raw_time_uses(path)] == [
        (6, "aio.sleep"),
        (7, "time.time"),
        (7, "pc (time.perf_counter)"),
        (8, "time.monotonic"),
    ]


def test_own_threads_check_sees_every_spelling(tmp_path: Path) -> None:
    path = tmp_path / "role.py"
    path.write_text(
        "import asyncio\n"
        "import concurrent.futures as cf\n"
        "from asyncio import to_thread as tt\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "async def f(ctx, fn):\n"
        "    await asyncio.to_thread(fn)\n"
        "    await asyncio.get_running_loop().run_in_executor(None, fn)\n"
        "    pool = cf.ThreadPoolExecutor(1)\n"
        "    await tt(fn)\n"
        "    return ThreadPoolExecutor, await ctx.executor('store').run(fn)\n"
    )
    assert [(u.line, u.what) for u in own_threads_uses(path)] == [
        (6, ".to_thread"),
        (7, ".run_in_executor"),
        (8, ".ThreadPoolExecutor"),
        (9, "tt (asyncio.to_thread)"),
        (10, "ThreadPoolExecutor (concurrent.futures.ThreadPoolExecutor)"),
    ]


def test_wait_for_check_sees_every_spelling(tmp_path: Path) -> None:
    path = tmp_path / "role.py"
    path.write_text(
        "import asyncio as aio\n"
        "from asyncio import wait_for as wf\n"
        "async def f(cond, ev):\n"
        "    await aio.wait_for(ev.wait(), 1)\n"
        "    await wf(ev.wait(), 1)\n"
        "    await cond.wait_for(lambda: True)  # asyncio.Condition's: not matched\n"
        "    async with aio.timeout(1):\n"
        "        await ev.wait()\n"
    )
    assert [(u.line, u.what) for u in wait_for_uses(path)] == [
        (4, "aio.wait_for"),
        (5, "wf (asyncio.wait_for)"),
    ]


def test_swallowed_cancel_check_sees_every_spelling(tmp_path: Path) -> None:
    path = tmp_path / "role.py"
    path.write_text(
        "import asyncio, contextlib\n"
        "from contextlib import suppress\n"
        "from asyncio import CancelledError\n"
        "async def f(task):\n"
        "    with contextlib.suppress(asyncio.CancelledError):\n"
        "        await task\n"
        "    with suppress(KeyError, CancelledError):\n"
        "        await task\n"
        "    with suppress(BaseException):\n"
        "        await task\n"
        "    with suppress(KeyError):  # not a cancellation: fine\n"
        "        await task\n"
    )
    assert [(u.line, u.what) for u in swallowed_cancel_uses(path)] == [
        (5, "suppress(CancelledError)"),
        (7, "suppress(CancelledError)"),
        (9, "suppress(BaseException)"),
    ]


def _graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    return import_graph(ROOTS), module_files(ROOTS)


def test_no_import_cycles_in_laminar_and_transport() -> None:
    graph, files = _graph()
    found = [c for c in cycles(graph) if not any(_in(m, "laminar.roles") for m in c)]
    assert not found, describe_cycles(graph, found, files)


def test_no_import_cycles_through_roles() -> None:
    graph, files = _graph()
    found = [c for c in cycles(graph) if any(_in(m, "laminar.roles") for m in c)]
    assert not found, describe_cycles(graph, found, files)


def test_transport_imports_nothing_above_it() -> None:
    bad = [v for v in layering_violations(_graph()[0]) if v.startswith("laminar.transport")]
    assert not bad, "\n".join(bad)


def test_the_dev_mode_and_the_harnesses_sit_on_top() -> None:
    """roles, the runtime and the libraries never import the tooling (``laminar.devmode``,
    ``laminar.harness``, the CLI, the doctor, the simulator): the package picture in
    docs/architecture.md."""
    graph = _graph()[0]
    bad = [
        v
        for v in layering_violations(graph)
        if "dev mode" in v or "harnesses" in v or "tooling" in v
    ]
    assert not bad, "\n".join(bad)
    assert layering_violations({"laminar.proc.spawn": {"laminar.devmode.status": 3}})
    assert layering_violations({"laminar.roles.relay.service": {"laminar.harness.launch": 9}})
    assert layering_violations({"laminar.tracking.records": {"laminar.devmode.progress": 1}})
    assert layering_violations({"laminar.weights.shared": {"laminar.doctor.memory": 1}})


def test_the_runtime_imports_only_itself_and_transport() -> None:
    bad = [v for v in layering_violations(_graph()[0]) if v.startswith("laminar.runtime")]
    assert not bad, "\n".join(bad)
    assert layering_violations({"laminar.runtime.service": {"laminar.proc.spawn": 1}})
    assert layering_violations({"laminar.runtime.context": {"laminar.roles.manager.api": 1}})
    assert not layering_violations({"laminar.runtime.rpc.server": {"laminar.transport.tcp": 1}})


def test_roles_meet_only_through_their_apis() -> None:
    bad = [v for v in layering_violations(_graph()[0]) if "through its api" in v]
    assert not bad, "\n".join(bad)
    assert layering_violations(
        {"laminar.roles.rollout.switching": {"laminar.roles.relay.service": 1}}
    )
    assert layering_violations({"laminar.devmode.status": {"laminar.roles.rollout.state": 1}})
    assert not layering_violations(
        {"laminar.roles.rollout.switching": {"laminar.roles.relay.api": 1}}
    )
    assert not layering_violations(
        {"laminar.roles.rollout.service": {"laminar.roles.rollout.state": 1}}
    )


def test_every_role_has_an_api() -> None:
    roles = sorted(p for p in ROOTS["laminar.roles"].iterdir() if (p / "__init__.py").is_file())
    assert [r.name for r in roles if not (r / "api.py").is_file()] == []


def test_no_import_cycles_counting_type_only_imports() -> None:
    """A cycle through ``if TYPE_CHECKING:`` imports never fails at run time, but it says two
    modules each own the other: one of them should take a protocol instead."""
    graph = import_graph(ROOTS, type_only=True)
    found = cycles(graph)
    assert not found, describe_cycles(graph, found, module_files(ROOTS))


def test_no_raw_time_in_roles() -> None:
    found = raw_time_in(ROOTS["laminar.roles"])
    assert not found, "role code reads time from its clock:\n" + "\n".join(map(str, found))


def test_roles_run_blocking_work_through_their_executors() -> None:
    """No ``asyncio.to_thread``, ``run_in_executor`` or thread pool of its own in roles/, the
    weight path or the engines: the context's executors are in-loop under the in-process
    cluster, a thread picked by hand is not (``laminar.runtime.executor``)."""
    found = [u for root in EXECUTOR_USERS for path in sorted(root.rglob("*.py"))
             for u in own_threads_uses(path)]  # fmt: skip
    assert not found, "use ctx.executor(name):\n" + "\n".join(map(str, found))


def test_no_wait_for_in_the_project() -> None:
    found = [u for root in ROOTS.values() for path in sorted(root.rglob("*.py"))
             for u in wait_for_uses(path)]  # fmt: skip
    assert not found, "use `async with asyncio.timeout(...)`:\n" + "\n".join(map(str, found))


def test_no_suppressed_cancellation_in_the_project() -> None:
    found = [u for root in ROOTS.values() for path in sorted(root.rglob("*.py"))
             for u in swallowed_cancel_uses(path)]  # fmt: skip
    assert not found, "wait for a cancelled task with asyncio.wait:\n" + "\n".join(map(str, found))


def test_every_package_is_listed_for_the_wheel() -> None:
    """pyproject lists packages by hand (the package-dir mapping defeats discovery): a new
    sub-package left off works in the editable install and is missing from a built wheel."""
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join([name, *init.parent.relative_to(root).parts])
        for name, root in ROOTS.items()
        for init in root.rglob("__init__.py")
    }
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
