"""The data role's side of the round schedules (``sync``, ``one_step``, ``tail_batching``).

Decisions come from :mod:`laminar.runtime.schedules`; this module applies them to the store.
Everything
here runs on the data role's database thread (the service wraps each call in ``_db``), so the
round state below and the store change together.

* **Opening** round ``r`` (on a ``take`` by a rollout at :func:`round_version` ``(r)``, once round
  ``r - 1`` is over): a plain or short round queues fresh whole groups (``refill``; the queue is
  empty between rounds); a long round puts deferred groups back in the queue.
* **Leasing**: only while a round is open and only to a rollout at the round's version; the queue
  holds nothing but the open round's samples, so the store's ordinary ``lease`` applies.
* **Failures**: a group that loses a member for good (``failures``) can never be complete, so a
  round waiting for it would never end. It leaves the round (neither kept nor deferred) and a
  fresh group takes its place; with no fresh prompts left, the round keeps fewer groups.
* **Ending**: after each report, complete groups are counted; at :func:`round_over` the groups
  :func:`split_round` defers are *parked* (``store.parking``): their partial tokens and any
  finished members are withdrawn (a deferred prompt restarts from scratch, on the version of a
  later long round, so the batch stays on-policy) and their samples are neither queued nor
  leased. A rollout still generating one learns it at its next report (``drop``: it aborts it),
  and a completion of a parked sample that arrives later is ignored (:meth:`filter_completed`).

The round state lives in memory: a data role that restarts mid-run starts with a fresh round
(the service releases parked samples of the old one to the queue at start-up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from laminar.runtime.schedules import (
    RoundPlan,
    ScheduleConfig,
    plan_round,
    round_over,
    round_version,
    split_round,
)
from laminar.trajectory import Assignment, Trajectory

from .store import Store


class RoundGate:
    """Round state of one data role; see the module docstring."""

    def __init__(self, schedule: ScheduleConfig, samples: int, seed: int, epochs: int | None):
        assert schedule.round_prompts is not None
        self.schedule = schedule
        self.samples = samples
        self.seed = seed
        self.epochs = epochs
        self.plan: RoundPlan | None = None
        self.open = False
        self.groups: dict[str, int] = {}  # prompt id of each group in the open round -> done
        self.completed: list[str] = []  # complete groups of the open round, in order
        self.deferred: list[str] = []  # parked groups waiting for a long round, oldest first
        self.history: list[dict[str, Any]] = []  # one record per finished round

    # -- leasing -----------------------------------------------------------------------------

    def lease(
        self, store: Store, rollout: str, count: int, version: int, holding: set[str], params: Any
    ) -> list[Assignment]:
        """Samples of the open round for a rollout at its version (opening the next if due)."""
        if not self.open:
            self._maybe_open(store, version)
        if not self.open or self.plan is None:
            return []
        if version != round_version(self.schedule.kind, self.plan.index):
            return []
        return store.lease(rollout, count, version, holding, params)

    def _maybe_open(self, store: Store, version: int) -> None:
        index = 0 if self.plan is None else self.plan.index + 1
        if version != round_version(self.schedule.kind, index):
            return
        rp = self.schedule.round_prompts
        assert rp is not None
        plan = plan_round(
            self.schedule.kind, index, rp, self.schedule.over_launch, len(self.deferred)
        )
        if plan.deferred:
            groups, self.deferred = self.deferred[: plan.deferred], self.deferred[plan.deferred :]
            store.unpark(groups)
        else:
            store.refill(plan.fresh * self.samples, self.samples, self.seed, self.epochs)
            groups = store.queued_groups()
        if not groups:
            return  # the data is exhausted: no more rounds
        fresh = len(groups) if plan.fresh else 0  # the last epoch may queue fewer groups
        self.plan = RoundPlan(
            index, plan.kind, fresh, len(groups) - fresh, min(plan.keep, len(groups))
        )
        self.groups = dict.fromkeys(groups, 0)
        self.completed = []
        self.open = True

    # -- reports -----------------------------------------------------------------------------

    def filter_completed(
        self, store: Store, trajectories: Iterable[Trajectory]
    ) -> list[Trajectory]:
        """Drop completions of parked samples: their round ended without them."""
        trajectories = list(trajectories)
        parked = store.parked_ids(t.trajectory_id for t in trajectories)
        return [t for t in trajectories if t.trajectory_id not in parked]

    def note_completed(self, store: Store, new_ids: Iterable[str]) -> None:
        """Count newly complete trajectories; end the open round when it is over."""
        if not self.open or self.plan is None:
            return
        for tid in new_ids:
            group = tid.rpartition("/")[0]
            if group not in self.groups:
                continue
            self.groups[group] += 1
            if self.groups[group] == self.samples:
                self.completed.append(group)
        self._maybe_end(store)

    def note_failed(self, store: Store, failed_ids: Iterable[str]) -> None:
        """Replace the open round's groups that lost a member for good (module docstring)."""
        if not self.open or self.plan is None:
            return
        broken = {tid.rpartition("/")[0] for tid in failed_ids} & set(self.groups)
        if not broken:
            return
        fresh = 0
        for group in sorted(broken):
            del self.groups[group]
            queued = store.queued_count()
            if store.refill(queued + self.samples, self.samples, self.seed, self.epochs):
                pid = store.last_queued_group()
                assert pid is not None  # the refill just queued its group
                self.groups[pid] = 0
                fresh += 1
        plan = self.plan
        self.plan = dataclasses.replace(
            plan, fresh=plan.fresh + fresh, keep=min(plan.keep, len(self.groups))
        )
        self._maybe_end(store)

    def _maybe_end(self, store: Store) -> None:
        if self.plan is None or not self.open:
            return
        if round_over(self.plan, len(self.completed)):
            kept, deferred = split_round(self.plan, self.completed, list(self.groups))
            store.park(deferred)
            self.deferred += deferred
            self.history.append(
                {
                    "round": self.plan.index,
                    "kind": self.plan.kind,
                    "launched": self.plan.launched,
                    "kept": kept,
                    "deferred": deferred,
                }
            )
            self.open = False

    def stats(self) -> dict[str, float]:
        plan = self.plan
        return {
            "round": float(plan.index if plan else -1),
            "round_open": float(self.open),
            "round_long": float(bool(plan and plan.kind == "long")),
            "deferred_groups": float(len(self.deferred)),
        }
