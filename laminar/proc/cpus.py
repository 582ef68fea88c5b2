"""Dividing the local machine's cores between the processes of a dev-mode run (``run.cpus: auto``).

Why a plan at all: left alone, every vLLM CPU engine binds its OpenMP threads to the cores it thinks
are free, which is core 0 for all of them (they do not know about each other), and torch in the
trainer starts one thread per core. Two rollouts then share core 0 while the other cores run only
the trainer's short bursts, and the threads that spin-wait steal from each other. The plan gives
each engine its own cores and sizes every thread pool to the cores it has.

The rules (pure, so they are unit-tested without starting anything):

* *heavy* processes are the ones that compute: rollouts (engine steps) and trainer ranks;
  everything else (manager, data, relay, user roles) is *light*: it is left unpinned and the
  kernel fits it in between.
* With at least one core per heavy process, cores are split into contiguous disjoint slices:
  rollouts first, then the trainer; the remainder goes to the rollouts, because generation is
  most of an RL step's work.
* With fewer cores than heavy processes, rollouts still get disjoint slices where possible
  (one core each, wrapping around), and the trainer is unpinned with ``cores - rollouts`` threads
  (at least one): it runs between engine steps. Training is bursty (one update per global batch),
  so pinning it to a core of its own would leave that core idle most of the run.

A plan is applied through the environment (``VLLM_CPU_OMP_THREADS_BIND`` for vLLM,
``OMP_NUM_THREADS`` and ``LAMINAR_THREADS`` for torch) and, for pinned processes, the affinity
the supervisor sets between fork and exec (inherited by everything the process starts, e.g.
vLLM's engine-core process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HEAVY_ROLES = ("rollout", "trainer")


@dataclass(frozen=True)
class CpuSlot:
    """Where one process runs: ``cpus`` (empty: unpinned) and how many threads it should use."""

    cpus: tuple[int, ...]
    threads: int

    def env(self, role: str) -> dict[str, str]:
        out = {"OMP_NUM_THREADS": str(self.threads), "LAMINAR_THREADS": str(self.threads)}
        if self.cpus:
            out["LAMINAR_CPUS"] = ",".join(map(str, self.cpus))
            if role == "rollout":
                out["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
        return out


def plan_cpus(cores: list[int], processes: list[tuple[str, str]]) -> dict[str, CpuSlot]:
    """``processes`` = ``(name, role)`` in start order; returns a slot for every name."""
    if not cores:
        raise ValueError("no cores to plan with")
    rollouts = [name for name, role in processes if role == "rollout"]
    trainers = [name for name, role in processes if role == "trainer"]
    light = [name for name, role in processes if role not in HEAVY_ROLES]
    n = len(cores)
    plan: dict[str, CpuSlot] = {name: CpuSlot((), 1) for name in light}
    heavy = len(rollouts) + len(trainers)
    if heavy == 0:
        return plan
    if n >= heavy:
        base, extra = divmod(n, heavy)
        sizes = [base + (1 if i < extra else 0) for i in range(heavy)]  # extra: rollouts first
        start = 0
        for name, size in zip(rollouts + trainers, sizes, strict=True):
            plan[name] = CpuSlot(tuple(cores[start : start + size]), size)
            start += size
        return plan
    for i, name in enumerate(rollouts):
        per = max(1, n // max(1, len(rollouts)))
        first = (i * per) % n
        plan[name] = CpuSlot(tuple(cores[(first + k) % n] for k in range(per)), per)
    for name in trainers:
        plan[name] = CpuSlot((), max(1, (n - len(rollouts)) // max(1, len(trainers))) or 1)
    return plan


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), sorted."""
    return sorted(os.sched_getaffinity(0))
