"""Where a role's own threads run beside the compute on its host: lower priority, spare cores.

Why: vLLM's CPU engine is two processes, an engine core that schedules each step and a worker
that runs it, and both poll their shared-memory queues busily between steps (``sched_yield``
for a second after each read; vLLM's ``shm_broadcast.py``). They are always runnable, so every
millisecond a role runs on that host is taken from the engine at whatever moment the role wakes,
and a step whose engine core or worker waits for a turn is a step later. The roles are I/O-bound
(a store write, an RPC, a report every few tens of milliseconds). Two remedies, both applied by
``laminar serve`` once a role is ready (after ``on_start``, so the engine processes a rollout
started there are already running):

* :func:`give_way` (``cluster.nice``; 0, off, by default): the role's threads run at a lower
  priority, so they use the engine's yields instead of taking turns with its steps. Not for a
  role whose own threads do the heavy work (the trainer: ``Service.computes``), nor for a
  rollout still on its engine's cores (``Service.feeds_engine``; :func:`niceness_for`). Off by
  default because it is a trade: where the trainer shares the host, the data role and the relay
  are on the trainer's path too, and at a lower priority they cost it more versions than the
  engines gain (docs/benchmarks.md, *Generation*). On a host that only generates it helps.
* :func:`keep_off_bound_cores`: vLLM binds its CPU worker's OpenMP threads to some cores and
  leaves one free for the engine core and the front end (``VLLM_CPU_NUM_OF_RESERVED_CPU``), but
  pins nothing to it: a rollout then moves itself and its engine core there, off the worker's.

What each remedy gains is measured by ``benchmarks/generation.py`` (docs/benchmarks.md,
*Generation*).

Linux keeps a niceness and an affinity per thread, and a new thread or process inherits its
creator's: so both are set on every thread that exists, and what those start later follows.
Niceness is only ever raised: lowering it again takes a privilege (``CAP_SYS_NICE``) a role
should not need.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import NamedTuple

from .procfs import descendants


def thread_ids(pid: int | None = None) -> list[int]:
    """The ids of ``pid``'s threads (default: this process), as ``/proc`` lists them now."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid or os.getpid()}/task"))
    except FileNotFoundError:
        return []


def niceness(tid: int) -> int:
    """One thread's niceness (``os.getpriority`` with a thread id: per thread on Linux)."""
    return os.getpriority(os.PRIO_PROCESS, tid)


def give_way(nice: int) -> int:
    """Raise every thread of this process to at least ``nice`` (0-19); return how many changed.

    A thread already nicer is left as it is; one that exits meanwhile is skipped."""
    if not 0 <= nice <= 19:
        raise ValueError(f"niceness {nice} is outside 0-19")
    changed = 0
    for tid in thread_ids():
        with contextlib.suppress(ProcessLookupError):
            if niceness(tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
    return changed


# -- cores -----------------------------------------------------------------------------------------


def spare_cores(ours: Iterable[int], bound: Iterable[Iterable[int]]) -> tuple[int, ...]:
    """The cores of ``ours`` that no *bound* process uses: one whose cores are a strict subset of
    ours (it narrowed its affinity itself, as vLLM's CPU worker does). Empty when nothing is
    bound or the bound ones cover every core: then there is nowhere better to go. Pure."""
    mine = set(ours)
    narrowed = [set(cores) for cores in bound if set(cores) < mine]
    if not narrowed:
        return ()
    return tuple(sorted(mine - set().union(*narrowed)))


def pin_threads(pid: int, cores: Iterable[int]) -> None:
    """Every thread of ``pid`` to ``cores``; threads that exit meanwhile are skipped."""
    cpus = set(cores)
    for tid in thread_ids(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(tid, cpus)


class Placed(NamedTuple):
    """What :func:`keep_off_bound_cores` found and did."""

    bound: tuple[int, ...]  # the cores processes below this one bound themselves to
    cores: tuple[int, ...]  # where this process and its unbound ones moved (empty: they stayed)


def niceness_for(nice: int, *, computes: bool, feeds_engine: bool, placed: Placed) -> int:
    """The niceness a ready role gives its threads (0: leave them). Pure.

    ``computes``: its own threads do the heavy work (the trainer): 0. ``feeds_engine``: its
    threads feed engine processes of its own (a rollout): only once it ``placed`` itself off
    their cores. Beside them (a rollout given one core, as ``laminar run`` plans them on a small
    machine) it would share that core at a tenth of their weight with two processes that never
    sleep, and whatever it is slow to hand its engine, the engine does not compute. (Not
    measured on its own: under ``laminar run`` the niced data role and relay slowed training as
    much either way.) Everything else: ``nice``."""
    if computes or (feeds_engine and not placed.cores):
        return 0
    return nice


def keep_off_bound_cores() -> Placed:
    """Move this process and every process below it that is not bound (see :func:`spare_cores`)
    to the cores the bound ones leave, if any."""
    ours = os.sched_getaffinity(0)
    below: dict[int, set[int]] = {}
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            below[pid] = os.sched_getaffinity(pid)
    bound = {pid: cores for pid, cores in below.items() if cores < ours}
    spare = spare_cores(ours, bound.values())
    if spare:
        for pid in [os.getpid(), *(p for p in below if p not in bound)]:
            pin_threads(pid, spare)
    return Placed(tuple(sorted(set().union(*bound.values()))), spare)
