"""Experience-buffer policies: which trajectories the trainer gets, and which are dropped.

Both are small pluggable objects that see :class:`BufferEntry` rows (metadata, no tokens) and
return trajectory ids; the data role applies their choice durably. Name a built-in (``fifo``,
``newest``; ``none``, ``max_size``) or your own class as ``module:Class`` / ``file.py:Class``
(constructed with the ``options`` mapping of the config as keyword arguments).

:class:`ExperienceBuffer` puts them together with the store to answer the trainer's ``sample``:
re-delivery after a trainer crash (the consume cursor), whole GRPO groups, and a staleness bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from laminar.plugins import load_object
from laminar.runtime.errors import ConfigError
from laminar.trajectory import Trajectory

from .store import BufferEntry, Store


class Sampler(Protocol):
    def select(self, ready: Sequence[BufferEntry], n: int, trainer_version: int) -> list[str]:
        """Pick up to ``n`` of ``ready`` (oldest first) for the trainer's next batch."""
        ...


class EvictionPolicy(Protocol):
    def evict(self, ready: Sequence[BufferEntry], trainer_version: int) -> list[str]:
        """Ids to drop from ``ready`` now (they will never be trained on)."""
        ...


class FifoSampler:
    """Oldest first: each trajectory is consumed in the order it finished."""

    def select(self, ready: Sequence[BufferEntry], n: int, trainer_version: int) -> list[str]:
        return [e.trajectory_id for e in ready[:n]]


class NewestSampler:
    """Newest first (freshest policy versions); older ones wait or get evicted."""

    def select(self, ready: Sequence[BufferEntry], n: int, trainer_version: int) -> list[str]:
        return [e.trajectory_id for e in sorted(ready, key=lambda e: -e.seq)[:n]]


class KeepAll:
    def evict(self, ready: Sequence[BufferEntry], trainer_version: int) -> list[str]:
        return []


class MaxSize:
    """Keep at most ``max_size`` waiting trajectories; drop the oldest beyond that."""

    def __init__(self, max_size: int = 4096) -> None:
        if max_size < 1:
            raise ConfigError(f"max_size eviction needs max_size >= 1, got {max_size}")
        self.max_size = max_size

    def evict(self, ready: Sequence[BufferEntry], trainer_version: int) -> list[str]:
        excess = len(ready) - self.max_size
        return [e.trajectory_id for e in ready[:excess]] if excess > 0 else []


SAMPLERS: dict[str, type] = {"fifo": FifoSampler, "newest": NewestSampler}
EVICTIONS: dict[str, type] = {"none": KeepAll, "max_size": MaxSize}


def make_policy(kind: str, builtins: dict[str, type], options: dict[str, Any]) -> Any:
    cls = builtins.get(kind) or load_object(kind, what="buffer policy")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"cannot construct {kind} with options {options}: {exc}") from None


@dataclass
class Batch:
    """What one ``sample`` hands the trainer: trajectories with their consume seqs, in order."""

    items: list[Trajectory] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    cursor: int = 0  # the highest consume seq in this batch (``after`` or 0 when empty)
    redelivered: int = 0  # how many of ``items`` were consumed before (a trainer restart)


class ExperienceBuffer:
    """The trainer's view of the store: sampler, eviction, whole groups, staleness, the cursor.

    Synchronous (it runs on the data role's store thread, one call at a time). One call of
    :meth:`sample` is one consistent decision: evictions and stale drops are durable at once,
    while trajectories are marked consumed only when the batch is handed out.

    * **Cursor.** Every consumed trajectory gets the next consume seq (1, 2, ...). With ``after``
      set, the batch first re-delivers the trajectories consumed with seq > ``after`` (taken by a
      trainer that crashed before committing), in consume order, then tops up with fresh ones. A
      trainer that commits ``cursor`` with its checkpoint trains every trajectory exactly once.
      Re-delivered trajectories are returned as they were (no staleness check: they were already
      handed out).
    * **Whole groups.** A group is a prompt id (an epoch's repeat of a prompt is another group).
      It is eligible when all ``group_size`` members are scored, unconsumed, not evicted and
      within the staleness bound. Eligible groups are ordered by when they completed (the
      highest buffer seq of their members); their members go to the sampler in that order,
      asked for all of them, and groups are taken in the order their first member appears in the
      sampler's choice (fifo keeps completion order, newest takes the last-completed first; a
      group the sampler does not pick at all is not taken). Members stay adjacent, ordered by
      sample index. A group one of whose members was evicted (or consumed by a request without
      ``whole_groups``) can never complete: its other members stay in the buffer until eviction
      drops them. A group more of whose members *failed* (``failures``: never generated) than it
      started spare (``spare_samples``: ``data.redundant_samples``, 0 by default) can never
      complete either; its other members are evicted as soon as a whole-group sample sees them
      (counted in ``orphaned``), so they neither wait forever nor count as lost. Up to that many
      failures a group completes from its spares.
    * **Staleness** (``bound`` set): staleness = ``trainer_version - version``. Over the bound,
      ``drop`` evicts durably (counted in ``stale_dropped``); ``hold`` skips them and keeps them
      (``held`` counts those skipped by the last call). With whole groups a group with any member
      over the bound is dropped whole (``drop``) or held whole (``hold``).
    * **Uninformative groups** (``drop_constant_groups``, whole groups only): a complete group
      whose members all got the same reward has group-relative advantage 0 for every member, so
      training on it costs a forward and backward pass and teaches nothing (with token-mean
      aggregation it even dilutes the informative rows). Such groups are evicted when seen
      (counted in ``filtered``) and the batch is filled from the next ones: DAPO's dynamic
      sampling, with the generation that backpressure would otherwise idle.
    * **Group outcomes** (``on_group``): each whole group that leaves the buffer, consumed or
      filtered, is told once as (one member's trajectory id, whether its rewards differ): what
      ``focus`` learns its admit rates from.
    """

    def __init__(
        self,
        store: Store,
        sampler: Sampler,
        eviction: EvictionPolicy,
        *,
        group_size: int,
        staleness_bound: int | None = None,
        staleness_action: Literal["drop", "hold"] = "drop",
        drop_constant_groups: bool = False,
        spare_samples: int = 0,
        on_group: Callable[[str, bool], None] | None = None,
    ) -> None:
        if staleness_bound is not None and staleness_bound < 0:
            raise ConfigError(f"the staleness bound must be >= 0, got {staleness_bound}")
        self.store = store
        self.sampler = sampler
        self.eviction = eviction
        self.group_size = group_size
        self.staleness_bound = staleness_bound
        self.staleness_action = staleness_action
        self.drop_constant_groups = drop_constant_groups
        # samples started beyond group_size per group (data.redundant_samples): a group stays
        # whole-able while no more than this many of its members failed
        self.spare_samples = spare_samples
        self.on_group = on_group  # (a member's trajectory id, informative?) per group consumed
        self._picked: list[list[BufferEntry]] = []  # the whole groups the last call chose
        self.held = 0  # trajectories the last call skipped for staleness (``hold``)
        self.filtered = 0  # trajectories the last call evicted as constant groups

    def check(self, n: int, whole_groups: bool) -> None:
        if whole_groups and n % self.group_size:
            raise ValueError(
                f"whole_groups needs n to be a multiple of samples_per_prompt "
                f"({self.group_size}), got n={n}"
            )

    def sample(
        self,
        n: int,
        trainer_version: int,
        *,
        after: int | None = None,
        whole_groups: bool = False,
        partial: bool = True,
    ) -> Batch | None:
        """Up to ``n`` trajectories: re-deliveries after ``after``, then fresh ones.

        ``partial=False``: return None (consuming nothing) unless ``n`` are available, so the
        caller can wait for more; ``partial=True``: return what there is (maybe nothing).
        """
        self.check(n, whole_groups)
        self.filtered = 0
        self._picked = []
        store = self.store
        again = store.consumed_after(after, n) if after is not None else []
        want = n - len(again)
        fresh: list[str] = []
        if want > 0:
            ready = store.ready_entries()
            evict = self.eviction.evict(ready, trainer_version)
            if evict:
                store.evict(evict)
                gone = set(evict)
                ready = [e for e in ready if e.trajectory_id not in gone]
            ready = self._apply_staleness(ready, trainer_version, whole_groups)
            if whole_groups:
                ready = self._evict_orphans(ready)
                fresh = self._select_groups(ready, want // self.group_size, trainer_version)
            else:
                fresh = self.sampler.select(ready, want, trainer_version)[:want]
        # with whole groups, re-deliveries that are not whole groups leave a gap no group fills
        enough = len(again) + (want // self.group_size * self.group_size if whole_groups else want)
        if not partial and len(again) + len(fresh) < enough:
            return None
        pairs = again + (store.consume_numbered(fresh) if fresh else [])
        if whole_groups:
            self._tell(self._picked)
        seqs = [s for s, _ in pairs]
        return Batch(
            items=[t for _, t in pairs],
            seqs=seqs,
            cursor=max(seqs) if seqs else (after or 0),
            redelivered=len(again),
        )

    def _apply_staleness(
        self, ready: list[BufferEntry], trainer_version: int, whole_groups: bool
    ) -> list[BufferEntry]:
        bound = self.staleness_bound
        self.held = 0
        if bound is None:
            return ready
        stale = {e.trajectory_id for e in ready if trainer_version - e.version > bound}
        if whole_groups and stale:
            groups = {e.prompt_id for e in ready if e.trajectory_id in stale}
            stale = {e.trajectory_id for e in ready if e.prompt_id in groups}
        if not stale:
            return ready
        if self.staleness_action == "drop":
            self.store.evict(sorted(stale), stale=True)
        else:
            self.held = len(stale)
        return [e for e in ready if e.trajectory_id not in stale]

    def _evict_orphans(self, ready: list[BufferEntry]) -> list[BufferEntry]:
        """Evict members of groups that can never be whole: more of their members failed than
        they started spare (``spare_samples``: redundant samples)."""
        failed = self.store.failed_per_group()
        broken = {pid for pid, n in failed.items() if n > self.spare_samples}
        orphans = [e.trajectory_id for e in ready if e.prompt_id in broken]
        if not orphans:
            return ready
        self.store.evict(orphans, orphaned=True)
        return [e for e in ready if e.prompt_id not in broken]

    def _select_groups(
        self, ready: Sequence[BufferEntry], groups: int, trainer_version: int
    ) -> list[str]:
        if groups <= 0:
            return []
        members: dict[str, list[BufferEntry]] = {}
        for e in ready:
            members.setdefault(e.prompt_id, []).append(e)
        complete = [
            sorted(m, key=lambda e: e.sample_index)
            for m in members.values()
            if len({e.sample_index for e in m}) == self.group_size
        ]
        if self.drop_constant_groups:
            constant = [m for m in complete if len({e.reward for e in m}) == 1]
            if constant:
                self._tell(constant)
                dropped = [e.trajectory_id for m in constant for e in m]
                self.store.evict(dropped, filtered=True)
                self.filtered = len(dropped)
                complete = [m for m in complete if len({e.reward for e in m}) > 1]
        complete.sort(key=lambda m: max(e.seq for e in m))
        entries = [e for m in complete for e in m]
        by_id = {e.trajectory_id: e.prompt_id for e in entries}
        by_group = {m[0].prompt_id: m for m in complete}
        order: list[str] = []
        for tid in self.sampler.select(entries, len(entries), trainer_version):
            pid = by_id.get(tid)
            if pid is not None and pid not in order:
                order.append(pid)
                if len(order) == groups:
                    break
        self._picked = [by_group[pid] for pid in order]
        return [e.trajectory_id for pid in order for e in by_group[pid]]

    def _tell(self, groups: list[list[BufferEntry]]) -> None:
        """``on_group`` for each group leaving the buffer whole (consumed or filtered)."""
        if self.on_group is not None:
            for m in groups:
                self.on_group(m[0].trajectory_id, len({e.reward for e in m}) > 1)
