"""Processes as ``/proc`` shows them, and process groups: a role and everything it started.

Standard library only, on purpose: :mod:`laminar.engines.vllm_worker` imports this inside vLLM's
worker processes. Used by ``laminar run`` (:mod:`laminar.proc.children`),
:class:`laminar.harness.launch. ProcessCluster`, the vLLM engine's owner watch, the reward pool
(:func:`signal_marked`: what a reward worker left behind), and tests.

A process is named for good by its pid *and* start time (a recycled pid starts later).

**Process groups.** A child started with ``process_group=0`` leads a process group whose id is its
pid; everything it starts stays in that group unless it moves itself (vLLM does not; a reward
worker does, and dies with its data role by ``PR_SET_PDEATHSIG``; what it leaves behind is ended
by :func:`signal_marked` with the role's :data:`INCARNATION_ENV` mark once the role exited, and
with the run's at the end of the run), whoever its parent becomes. The
id is not recycled while any process of the group remains; once it is empty, it may be. So the
helpers below take a ``mark`` (``NAME=value``): only processes started with it in their
environment are members (the caller puts it in its children's environment, and it is inherited).

Why groups and not sessions: where the kernel's autogroup scheduler is on
(``kernel.sched_autogroup_enabled``, the default of many distributions), every *session* is
scheduled as a group of its own. A rollout's session would hold vLLM's engine core and worker,
which poll their queues busily, and the data role and the manager, each a session of their own,
would wait for a core behind them: the engine runs out of prompts and generation through the
roles falls well behind bare vLLM (docs/benchmarks.md, *Generation*). Roles in groups share
their launcher's session, as bare vLLM's processes do.

**setproctitle wipes environments.** ``/proc/<pid>/environ`` shows the memory that held the
process's initial environment, and ``setproctitle`` (which vLLM calls in its engine core and
workers) overwrites that memory with the title unless ``SPT_NOENV`` is set. Every process whose
environment is checked here must therefore be started with :data:`KEEP_ENVIRON`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator
from typing import NamedTuple

#: The variable that marks every process of one ``laminar run`` or ``ProcessCluster`` (its value
#: is new each time); group members are those carrying it.
MARK_ENV = "LAMINAR_LAUNCH"

#: The variable that marks every process of one incarnation of one role (its value is new each
#: time the supervisor starts the role): what left the role's group (a reward worker leads its
#: own, and what a reward forks stays there) is ended by it when that incarnation exits, not only
#: at the end of the run.
INCARNATION_ENV = "LAMINAR_INCARNATION"

#: Keeps ``/proc/<pid>/environ`` readable in processes that call ``setproctitle`` (see above).
KEEP_ENVIRON = {"SPT_NOENV": "1"}


class Stat(NamedTuple):
    """Fields 3, 4, 5, 6, 14 + 15 and 22 of ``/proc/<pid>/stat`` (proc(5))."""

    state: str  # "Z": a zombie (exited, not yet reaped)
    ppid: int
    pgrp: int
    sid: int  # the session
    start: int  # clock ticks since boot
    cpu: int  # user + system clock ticks of all its threads (utime + stime)


def stat(pid: int) -> Stat | None:
    """What ``/proc`` says of ``pid``; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2 :].split()  # the name may hold spaces and parentheses
    return Stat(
        fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]),
        int(fields[11]) + int(fields[12]),
    )  # fmt: skip


def alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` is a live process (not a zombie), started at ``start`` when given."""
    st = stat(pid)
    return st is not None and st.state != "Z" and (start is None or st.start == start)


def has_env(pid: int, entry: str | None) -> bool:
    """Whether ``pid`` was started with ``entry`` (``NAME=value``) in its environment (True for
    None). See the module docstring for why this needs :data:`KEEP_ENVIRON`."""
    if entry is None:
        return True
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry.encode() in f.read().split(b"\0")
    except OSError:
        return False


def pids() -> Iterator[int]:
    """Every pid ``/proc`` lists now."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    return [c for c in pids() if (st := stat(c)) and st.ppid == pid and st.state != "Z"]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, children before grandchildren (one scan of ``/proc``)."""
    parent = {p: st.ppid for p in pids() if (st := stat(p)) and st.state != "Z"}
    out: list[int] = []
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in out}
        out += sorted(frontier)
    return out


# -- process groups--------------------------------------------------------------------------------


def group_members(gid: int, mark: str | None = None) -> list[int]:
    """The live processes (zombies excluded) of process group ``gid``; with ``mark``, only those
    started with it in their environment."""
    out = []
    for pid in pids():
        st = stat(pid)
        if st is not None and st.pgrp == gid and st.state != "Z" and has_env(pid, mark):
            out.append(pid)
    return out


def _still(pid: int, gid: int, start: int, mark: str | None) -> bool:
    st = stat(pid)
    alive = st is not None and st.pgrp == gid and st.start == start and st.state != "Z"
    return alive and has_env(pid, mark)


def signal_group(gid: int, sig: int, mark: str | None = None) -> list[int]:
    """Send ``sig`` to every live process of process group ``gid`` (with ``mark``, only those
    carrying it); the pids signalled.

    Each is signalled through a pidfd opened before its group and start time are read again,
    so a pid recycled in between is never hit. Without pidfds (a kernel before 5.3, some
    sandboxes) it falls back to ``kill`` right after that check (a window of microseconds).
    Not ``killpg``: once the group is empty its id may name someone else's."""
    sent = []
    for pid in group_members(gid, mark):
        first = stat(pid)
        if first is None:
            continue
        try:
            fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        except OSError:
            fd = None
        try:
            if not _still(pid, gid, first.start, mark):
                continue
            if fd is not None:
                try:
                    signal.pidfd_send_signal(fd, sig)
                    sent.append(pid)
                    continue
                except ProcessLookupError:
                    continue
                except OSError:  # pidfd_send_signal refused (seccomp): as without pidfds
                    if not _still(pid, gid, first.start, mark):
                        continue
            os.kill(pid, sig)
            sent.append(pid)
        except ProcessLookupError:
            pass
        finally:
            if fd is not None:
                os.close(fd)
    return sent


def signal_marked(mark: str, sig: int) -> list[int]:
    """Send ``sig`` to every live process started with ``mark`` (``NAME=value``) in its
    environment, whatever its session or group (a process that called ``setsid`` included); the
    pids signalled. Through a pidfd opened before the mark is read again, as above."""
    sent = []
    for pid in pids():
        if not has_env(pid, mark):
            continue
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        except OSError:  # no pidfds: kill right after the check below
            fd = None
        try:
            if not alive(pid) or not has_env(pid, mark):
                continue
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
            sent.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
        finally:
            if fd is not None:
                os.close(fd)
    return sent


#: The names Python's ``multiprocessing`` gives what its resource tracker unlinks when its
#: users are gone: shared memory (``psm_``, vLLM's message queues between its engine core and
#: its workers: 160 MiB each by default) and named semaphores (``sem.mp-``).
TRACKED_SHM_PREFIXES = ("psm_", "sem.mp-")


def tracked_shm(pid: int, root: str = "/dev/shm") -> set[str]:
    """The tracker-owned ``/dev/shm`` files ``pid`` maps (:data:`TRACKED_SHM_PREFIXES`).

    Why: the tracker ignores SIGTERM and unlinks its segments once every process that used them
    has exited, so a group that ends by itself leaves nothing; a group that needs SIGKILL loses
    its tracker too, and each of its segments would hold memory until the machine restarts (a
    rollout that did not stop within its grace period left 160 MiB in ``/dev/shm`` per engine).
    Only these names: the transport's own segments are shared with other roles, and their owner
    unlinks them. Read while the process lives (a dead one's maps are gone).

    Matched by inode, not by the name in ``maps``: glibc makes a named semaphore as a temporary
    file, maps it, links it to ``sem.<name>`` and unlinks the temporary, so the mapping reads
    ``/dev/shm/sem.XXXXXX (deleted)`` while the semaphore lives on as ``sem.mp-...`` (a rollout
    SIGKILLed while its vLLM engine started left its engine core's and worker's)."""
    inodes = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(root + "/"):
                    inodes.add(int(fields[4]))
    except (OSError, ValueError):  # gone, or not ours to read
        return set()
    if not inodes:
        return set()
    found = set()
    with contextlib.suppress(OSError):
        with os.scandir(root) as entries:
            for entry in entries:
                if entry.name.startswith(TRACKED_SHM_PREFIXES) and entry.inode() in inodes:
                    found.add(f"{root}/{entry.name}")
    return found


def kill_group(gid: int, mark: str | None = None) -> list[int]:
    """SIGKILL the group (:func:`signal_group`), and unlink the tracker-owned ``/dev/shm`` files
    its members map (:func:`tracked_shm`): the tracker dies with them. The pids signalled.
    Unlinked at once: a name is not needed by a mapping, and only the killed used these."""
    tracked = {path for pid in group_members(gid, mark) for path in tracked_shm(pid)}
    killed = signal_group(gid, signal.SIGKILL, mark)
    release_tracked_shm(tracked)
    return killed


def release_tracked_shm(paths: Iterable[str]) -> None:
    """Unlink the tracker-owned ``/dev/shm`` files ``paths`` (from :func:`tracked_shm`) once
    every process that mapped them is dead, and tell this process's resource tracker, if it
    runs one, to forget them: it would otherwise try to unlink them again at its exit and warn
    of "leaked shared_memory objects" that nobody leaked. A file gone already (its creator or
    a tracker unlinked it) is fine."""
    from multiprocessing import resource_tracker

    # Only a tracker that runs: unregistering through one that does not would start it.
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    running = getattr(tracker, "_fd", None) is not None
    for path in sorted(set(paths)):
        with contextlib.suppress(OSError):
            os.unlink(path)
        if not running:
            continue
        name = os.path.basename(path)
        if name.startswith("sem."):  # a named semaphore /mp-X lives in /dev/shm/sem.mp-X
            kind, name = "semaphore", name.removeprefix("sem.")
        else:
            kind = "shared_memory"
        with contextlib.suppress(OSError, ValueError):
            resource_tracker.unregister("/" + name, kind)


class GroupEnd(NamedTuple):
    left: list[int]  # what was there to stop (and got SIGTERM)
    killed: list[int]  # what then needed SIGKILL
    remaining: list[int]  # what was still there at the end (unkillable, e.g. stuck in the kernel)


def _wait_empty(gids: Iterable[int], mark: str | None, timeout: float, poll: float) -> set[int]:
    """Wait until the groups are empty or ``timeout`` passes; those not empty."""
    deadline = time.monotonic() + timeout
    busy = {gid for gid in gids if group_members(gid, mark)}
    while busy and time.monotonic() < deadline:
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        busy = {gid for gid in busy if group_members(gid, mark)}
    return busy


def end_groups(
    gids: Iterable[int],
    grace: float,
    mark: str | None = None,
    *,
    settle: float = 0.0,
    poll: float = 0.2,
) -> dict[int, GroupEnd]:
    """Stop what is left of the process groups ``gids`` (with ``mark``: of their processes
    carrying it), all at once: after ``settle`` seconds for what ends by itself, SIGTERM; after
    ``grace``, SIGKILL, once; then wait (up to 10 s more) for them to be gone. Blocks (``/proc``
    has no events to wait on): run it in a thread from an event loop. Per group, what
    happened."""
    gids = sorted(set(gids))
    busy = _wait_empty(gids, mark, settle, poll) if settle > 0 else set(gids)
    left = {gid: signal_group(gid, signal.SIGTERM, mark) for gid in busy}
    busy = _wait_empty([gid for gid, pids in left.items() if pids], mark, grace, poll)
    killed = {gid: kill_group(gid, mark) for gid in busy}
    stuck = _wait_empty([gid for gid, pids in killed.items() if pids], mark, 10.0, poll)
    return {
        gid: GroupEnd(
            left.get(gid, []),
            killed.get(gid, []),
            group_members(gid, mark) if gid in stuck else [],
        )
        for gid in gids
    }


def end_group(
    gid: int, grace: float, mark: str | None = None, *, settle: float = 0.0, poll: float = 0.2
) -> GroupEnd:
    """:func:`end_groups` for one group."""
    return end_groups([gid], grace, mark, settle=settle, poll=poll)[gid]
