"""Processes as ``/proc`` shows them, and sessions: a role and everything it started.

Standard library only, on purpose: :mod:`laminar.engines.vllm_worker` imports this inside vLLM's
worker processes. Used by ``laminar run`` (:mod:`laminar.proc.children`),
:class:`laminar.harness.launch. ProcessCluster`, the vLLM engine's owner watch, the reward pool
(:func:`signal_marked`: what a reward worker left behind), and tests.

A process is named for good by its pid *and* start time (a recycled pid starts later).

**Sessions.** A child started with ``start_new_session`` leads a session whose id is its pid;
everything it starts stays in that session unless it calls ``setsid`` itself (vLLM does not),
whoever its parent becomes. The id is not recycled while any process of the session remains; once
it is empty, it may be. So the helpers below take a ``mark`` (``NAME=value``): only processes
started with it in their environment are members (the caller puts it in its children's
environment, and it is inherited).

**setproctitle wipes environments.** ``/proc/<pid>/environ`` shows the memory that held the
process's initial environment, and ``setproctitle`` (which vLLM calls in its engine core and
workers) overwrites that memory with the title unless ``SPT_NOENV`` is set. Every process whose
environment is checked here must therefore be started with :data:`KEEP_ENVIRON`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Iterator
from typing import NamedTuple

#: The variable that marks every process of one ``laminar run`` or ``ProcessCluster`` (its value
#: is new each time); session members are those carrying it.
MARK_ENV = "LAMINAR_LAUNCH"

#: Keeps ``/proc/<pid>/environ`` readable in processes that call ``setproctitle`` (see above).
KEEP_ENVIRON = {"SPT_NOENV": "1"}


class Stat(NamedTuple):
    """Fields 3, 4, 5, 6 and 22 of ``/proc/<pid>/stat`` (proc(5))."""

    state: str  # "Z": a zombie (exited, not yet reaped)
    ppid: int
    pgrp: int
    sid: int
    start: int  # clock ticks since boot


def stat(pid: int) -> Stat | None:
    """What ``/proc`` says of ``pid``; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2 :].split()  # the name may hold spaces and parentheses
    return Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


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


# -- sessions -------------------------------------------------------------------------------------


def session_members(sid: int, mark: str | None = None) -> list[int]:
    """The live processes (zombies excluded) of session ``sid``; with ``mark``, only those
    started with it in their environment."""
    out = []
    for pid in pids():
        st = stat(pid)
        if st is not None and st.sid == sid and st.state != "Z" and has_env(pid, mark):
            out.append(pid)
    return out


def _still(pid: int, sid: int, start: int, mark: str | None) -> bool:
    st = stat(pid)
    alive = st is not None and st.sid == sid and st.start == start and st.state != "Z"
    return alive and has_env(pid, mark)


def signal_session(sid: int, sig: int, mark: str | None = None) -> list[int]:
    """Send ``sig`` to every live process of session ``sid`` (its process group, and any group
    made inside it; with ``mark``, only those carrying it); the pids signalled.

    Each is signalled through a pidfd opened before its session and start time are read again,
    so a pid recycled in between is never hit. Without pidfds (a kernel before 5.3, some
    sandboxes) it falls back to ``kill`` right after that check (a window of microseconds).
    Not ``killpg``: once the session is empty its id may name someone else's group."""
    sent = []
    for pid in session_members(sid, mark):
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
            if not _still(pid, sid, first.start, mark):
                continue
            if fd is not None:
                try:
                    signal.pidfd_send_signal(fd, sig)
                    sent.append(pid)
                    continue
                except ProcessLookupError:
                    continue
                except OSError:  # pidfd_send_signal refused (seccomp): as without pidfds
                    if not _still(pid, sid, first.start, mark):
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


class SessionEnd(NamedTuple):
    left: list[int]  # what was there to stop (and got SIGTERM)
    killed: list[int]  # what then needed SIGKILL
    remaining: list[int]  # what was still there at the end (unkillable, e.g. stuck in the kernel)


def _wait_empty(sids: Iterable[int], mark: str | None, timeout: float, poll: float) -> set[int]:
    """Wait until the sessions are empty or ``timeout`` passes; those not empty."""
    deadline = time.monotonic() + timeout
    busy = {sid for sid in sids if session_members(sid, mark)}
    while busy and time.monotonic() < deadline:
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        busy = {sid for sid in busy if session_members(sid, mark)}
    return busy


def end_sessions(
    sids: Iterable[int],
    grace: float,
    mark: str | None = None,
    *,
    settle: float = 0.0,
    poll: float = 0.2,
) -> dict[int, SessionEnd]:
    """Stop what is left of the sessions ``sids`` (with ``mark``: of their processes carrying it),
    all at once: after ``settle`` seconds for what ends by itself, SIGTERM; after ``grace``,
    SIGKILL, once; then wait (up to 10 s more) for them to be gone. Blocks (``/proc`` has no
    events to wait on): run it in a thread from an event loop. Per session, what happened."""
    sids = sorted(set(sids))
    busy = _wait_empty(sids, mark, settle, poll) if settle > 0 else set(sids)
    left = {sid: signal_session(sid, signal.SIGTERM, mark) for sid in busy}
    busy = _wait_empty([sid for sid, pids in left.items() if pids], mark, grace, poll)
    killed = {sid: signal_session(sid, signal.SIGKILL, mark) for sid in busy}
    stuck = _wait_empty([sid for sid, pids in killed.items() if pids], mark, 10.0, poll)
    return {
        sid: SessionEnd(
            left.get(sid, []),
            killed.get(sid, []),
            session_members(sid, mark) if sid in stuck else [],
        )
        for sid in sids
    }


def end_session(
    sid: int, grace: float, mark: str | None = None, *, settle: float = 0.0, poll: float = 0.2
) -> SessionEnd:
    """:func:`end_sessions` for one session."""
    return end_sessions([sid], grace, mark, settle=settle, poll=poll)[sid]
