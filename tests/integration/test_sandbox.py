"""The tool sandbox (``laminar/tools/sandbox.py``) against hostile code: every call fails alone,
with its reason, and leaves nothing behind.

Each case is a real interpreter in the real jail (namespaces, limits, its own uid as root).
"Nothing behind" is checked the way it would go wrong: no process of the uid a call ran as
survives it (a fork bomb's children, a daemon that left the session), no tool directory stays in
the temporary directory. The module runs on one pytest-xdist worker (its own group), so no other
test's tool directory is being used meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from laminar.tools import jail as jail_module
from laminar.tools.sandbox import SANDBOX_UIDS, SandboxLimits, interpreter, run_python

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("sandbox")]

ROOT = os.geteuid() == 0
FAST = SandboxLimits(wall_s=5.0, cpu_s=3)


USED: list[int] = []  # the uids this test's calls ran as


def run(code: str, limits: SandboxLimits = FAST):  # type: ignore[no-untyped-def]
    result = asyncio.run(run_python(code, limits))
    if result.uid is not None:
        assert result.uid in SANDBOX_UIDS
        USED.append(result.uid)
    return result


def processes_of(uids: list[int]) -> set[int]:
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(entry.path).st_uid in uids:
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


def sandbox_processes() -> set[int]:
    """Processes of the uids this test's calls ran as."""
    return processes_of(USED)


def tool_dirs(uids: list[int]) -> list[Path]:
    """Tool directories of these uids (named ``laminar-tool-UID-...``; other tests' calls, on
    other workers, have other uids)."""
    tmp = Path(tempfile.gettempdir())
    return [p for uid in uids for p in tmp.glob(f"laminar-tool-{uid}-*")]


@pytest.fixture(autouse=True)
def leaves_nothing_behind():  # type: ignore[no-untyped-def]
    USED.clear()
    yield
    assert sandbox_processes() == set()
    assert tool_dirs(USED) == []  # every tool's directory removed


def test_a_plain_call_returns_its_output_with_nothing_of_ours_in_its_environment() -> None:
    os.environ["LAMINAR_TOKEN"] = "secret-token-never-seen"
    try:
        result = run("import os, sys\nprint(6 * 7)\nprint(sorted(os.environ))")
    finally:
        del os.environ["LAMINAR_TOKEN"]
    assert result.ok and result.reason is None and result.exit_status == 0
    assert result.stdout.splitlines() == ["42", "['HOME', 'LANG', 'PATH']"]


def test_an_infinite_loop_is_stopped_by_the_cpu_limit_or_the_clock() -> None:
    result = run("while True:\n    pass", SandboxLimits(wall_s=20.0, cpu_s=1))
    assert not result.ok
    assert result.reason in ("cpu limit (1 s)", "timed out after 20 s")
    sleeper = run("import time\ntime.sleep(600)", SandboxLimits(wall_s=1.0))
    assert sleeper.reason == "timed out after 1 s" and sleeper.wall_s < 10


def test_a_fork_bomb_is_contained_and_leaves_no_process() -> None:
    result = run("import os\nwhile True:\n    os.fork()")
    assert not result.ok and result.reason is not None


def test_a_daemon_that_left_the_session_dies_with_the_tool() -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    result = run(code)
    assert result.ok and result.stdout == "parent done\n"  # the fixture checks the daemon is gone


def test_huge_output_fails_the_call_at_the_cap() -> None:
    limits = SandboxLimits(wall_s=10.0, output_bytes=4096)
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits)
    assert result.reason == "output over 4096 bytes" and len(result.stdout) == 4096


def test_a_memory_hog_gets_a_memory_error() -> None:
    result = run("x = bytearray(4 << 30)", SandboxLimits(memory_mib=256))
    assert result.reason == "memory limit (256 MiB)" and "MemoryError" in result.stderr


def test_no_network_not_even_this_machine() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)"
        result = run(code)
    finally:
        server.close()
    assert result.reason == "exit status 1"
    assert "Network is unreachable" in result.stderr or "Connection refused" in result.stderr


@pytest.mark.skipif(not ROOT, reason="as root the tool runs as a user of its own")
def test_the_tool_cannot_read_or_write_what_we_own(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("cluster-token")
    secret.chmod(0o600)
    tmp_path.chmod(0o755)
    code = f"open({str(secret)!r}).read()"
    assert "PermissionError" in run(code).stderr
    code = f"open({str(tmp_path / 'new')!r}, 'w').write('x')"
    assert "PermissionError" in run(code).stderr


NOBODY = 65534


@pytest.mark.skipif(
    not ROOT or shutil.which("setpriv") is None, reason="needs root to become a plain user"
)
@pytest.mark.parametrize(
    ("code", "status", "says"),
    [
        ("print(6 * 7)", 0, "42"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)", 1,
         "Network is unreachable"),
        ("while True:\n    pass", 128 + signal.SIGXCPU, ""),
        ("import os\nwhile True:\n    os.fork()", 1, "BlockingIOError"),
    ],
)  # fmt: skip
def test_the_jail_isolates_a_plain_user_too(code: str, status: int, says: str) -> None:
    """Not root, the jail makes a user namespace first (then the network and PID ones inside
    it). Run here as ``nobody`` with the system interpreter: the same isolation and limits."""
    python = interpreter(root=True)  # one a plain user may run
    work = Path(tempfile.mkdtemp(prefix="laminar-jail-test-"))  # pytest's tmp_path is root's only
    before = processes_of([NOBODY])  # a machine may run daemons as nobody
    try:
        _run_as_nobody(python, work, code, status, says)
    finally:
        shutil.rmtree(work)
    assert processes_of([NOBODY]) <= before


def _run_as_nobody(python: str, work: Path, code: str, status: int, says: str) -> None:
    spec = {
        "code": code, "workdir": str(work / "tool"), "env": {"PATH": "/usr/bin:/bin"},
        "uid": None, "gid": None, "cpu_s": 1, "memory_mib": 512, "max_processes": 16,
        "file_mib": 16,
    }  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    for path in (work, work / "spec.json"):
        os.chown(path, NOBODY, NOBODY)
    jail = work / "jail.py"  # a copy: the checkout may be out of nobody's reach (mode 700)
    shutil.copy(jail_module.__file__, jail)
    os.chown(jail, NOBODY, NOBODY)
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    done = subprocess.run(
        [*as_nobody, python, "-I", str(jail), str(work / "spec.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == status, done.stderr
    assert says in done.stdout + done.stderr
    assert not (work / "tool").exists()  # the jail removed the tool's directory
