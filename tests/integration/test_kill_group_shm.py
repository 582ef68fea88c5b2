"""A process group that needs SIGKILL leaves no shared memory behind (``procfs.kill_group``).

vLLM's engine core makes its message queues as ``multiprocessing.shared_memory`` segments
(``/dev/shm/psm_*``, 160 MiB each), which multiprocessing's resource tracker unlinks once their
users are gone. The tracker ignores SIGTERM but not SIGKILL, so a role killed with its group (a
rollout that did not stop within its grace period) lost its tracker too, and each run of
``laminar run`` that ended so left its engines' segments in ``/dev/shm`` for good. Here: a real
group that makes a segment the same way and ignores SIGTERM, ended as the supervisor ends one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.proc import procfs

#: makes a tracked segment and a tracked named semaphore (as vLLM's engine core and worker do
#: while the engine starts), says their files, ignores SIGTERM (as a stuck role) and waits
CHILD = """
import multiprocessing, signal, sys, time
from multiprocessing import shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
segment.buf[0] = 1
lock = multiprocessing.get_context("spawn").Lock()
print(segment.name, "sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(600)
"""


def _start(mark: str) -> tuple[subprocess.Popen[str], Path, Path]:
    """The child (its own group), its segment's file and its semaphore's."""
    key, _, value = mark.partition("=")
    env = {**os.environ, **procfs.KEEP_ENVIRON, key: value}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env,
        process_group=0,
    )  # fmt: skip
    assert proc.stdout is not None
    segment, semaphore = (Path("/dev/shm") / name for name in proc.stdout.readline().split())
    assert segment.name.startswith("psm_") and segment.exists()
    assert semaphore.name.startswith("sem.mp-") and semaphore.exists()
    return proc, segment, semaphore


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_a_group_ended_with_sigkill_leaves_no_tracked_segment() -> None:
    mark = "LAMINAR_TEST_MARK=kill-group-shm"
    proc, path, semaphore = _start(mark)
    try:
        # the semaphore's mapping names glibc's temporary file, "(deleted)": found by its inode
        assert procfs.tracked_shm(proc.pid) == {str(path), str(semaphore)}
        end = procfs.end_group(proc.pid, grace=0.5, mark=mark)
        assert proc.pid in end.killed  # SIGTERM was ignored: it took SIGKILL
        proc.wait(timeout=10)
        assert not path.exists(), f"{path} outlived its group"
        assert not semaphore.exists(), f"{semaphore} outlived its group"
        assert not procfs.group_members(proc.pid, mark)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        path.unlink(missing_ok=True)
        semaphore.unlink(missing_ok=True)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_kill_group_unlinks_what_its_members_map_and_nothing_else() -> None:
    mark = "LAMINAR_TEST_MARK=kill-group-shm-2"
    proc, path, semaphore = _start(mark)
    # a tracker-style name nobody in the group maps: not the group's to remove
    other = Path("/dev/shm") / f"psm_laminar_test_{os.getpid()}"
    other.write_bytes(b"x")
    try:
        killed = procfs.kill_group(proc.pid, mark)
        assert proc.pid in killed
        proc.wait(timeout=10)
        assert not path.exists() and not semaphore.exists()
        assert other.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        path.unlink(missing_ok=True)
        semaphore.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


#: a segment whose user is "gone" (here: we never close it) handed to release_tracked_shm (or
#: not), then the process exits and its tracker reports what it had to clean up
RELEASE = """
import sys
from multiprocessing import shared_memory
from laminar.proc.procfs import release_tracked_shm
segment = shared_memory.SharedMemory(create=True, size=1 << 16)  # starts this process's tracker
path = "/dev/shm/" + segment.name.lstrip("/")
segment.close()
if sys.argv[1] == "release":
    release_tracked_shm([path])
    import os
    assert not os.path.exists(path)
"""


@pytest.mark.parametrize("release", [True, False])
def test_released_segments_are_unlinked_and_forgotten_by_the_tracker(release: bool) -> None:
    """Unlinked by the one who knows its users are dead, and unregistered from this process's
    tracker, which would otherwise unlink it again at exit and warn of a leak (the control case
    shows the warning the release avoids)."""
    out = subprocess.run(
        [sys.executable, "-c", RELEASE, "release" if release else "keep"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    leaked = "leaked shared_memory objects" in out.stderr
    assert leaked is not release, out.stderr


def test_release_without_a_tracker_starts_none(tmp_path: Path) -> None:
    code = (
        "from multiprocessing import resource_tracker as rt\n"
        "from laminar.proc.procfs import release_tracked_shm\n"
        f"release_tracked_shm([{str(tmp_path / 'psm_x')!r}])\n"
        "assert rt._resource_tracker._fd is None, 'a tracker was started'\n"
    )
    (tmp_path / "psm_x").write_bytes(b"x")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "psm_x").exists()
