"""The repack planner: the paper's Algorithm 1 (best-fit trajectory consolidation), pure.

Why: decode is memory-bound, so a rollout left with a few long-tail trajectories spends a whole
GPU on a batch that would cost almost nothing more on top of another rollout's. Rollouts of the
same weight version that are ramping down are consolidated onto as few destinations as possible;
the released ones pull the newest weights and take fresh prompts.

Inputs are one :class:`RolloutLoad` per rollout (what its heartbeats say) and a
:class:`RepackPolicy`. Nothing here does I/O or reads a clock, so every rule is held by a
property test.

The rules, and the details the paper leaves open (which rollouts are candidates, in what order,
where a trajectory goes, why a destination is never a source in the same plan, why a move always
empties its source): docs/repack.md, *The planner*.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Annotated

from pydantic import BaseModel, Field, model_validator

__all__ = [
    "Move",
    "RepackPlan",
    "RepackPolicy",
    "RolloutLoad",
    "is_candidate",
    "plan_repack",
]


class RepackPolicy(BaseModel):
    """How the manager repacks; every field can change live (``PUT /v1/repack/policy``)."""

    model_config = {"extra": "forbid"}

    enabled: bool = Field(True, description="Repack periodically and after each weight publish.")
    period_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        5.0, description="Seconds between periodic repack checks (the paper: 5 s)."
    )
    c_max: Annotated[float, Field(gt=0, le=1)] = Field(
        0.99, description="KV-cache use a destination may reach after a move (C_max)."
    )
    batch_limit: Annotated[int, Field(ge=1)] = Field(
        64,
        description="B, the roofline batch size: the most trajectories a destination may decode "
        "after a move without its step time growing much.",
    )
    on_publish: bool = Field(True, description="Also repack right after each weight publish.")
    require_draining: bool = Field(
        True,
        description="Only rollouts that take no prompts are candidates (false: the paper's "
        "KV-ramp-down rule alone; see laminar.repack.planner).",
    )


class RolloutLoad(BaseModel):
    """One rollout as the planner sees it (from its last two heartbeats)."""

    rollout: str
    version: int
    kv_used: Annotated[float, Field(ge=0)]  # fraction of its KV cache in use now
    kv_prev: Annotated[float, Field(ge=0)]  # the previous sample
    n_reqs: Annotated[int, Field(ge=0)]  # trajectories in flight
    waiting: Annotated[int, Field(ge=0)] = 0  # of which waiting for admission
    draining: bool = False  # takes no prompts (a newer version waits, pool empty, operator drain)
    accepting: bool = True  # may receive trajectories


class Move(BaseModel):
    """Every in-flight trajectory of ``source`` goes to ``destination`` (same ``version``)."""

    source: str
    destination: str
    version: int
    n_reqs: int
    kv_used: float


class RepackPlan(BaseModel):
    moves: list[Move] = Field(default_factory=list)
    candidates: dict[int, list[str]] = Field(default_factory=dict)  # version -> candidate ids

    @property
    def released(self) -> list[str]:
        return [m.source for m in self.moves]

    @property
    def destinations(self) -> list[str]:
        return sorted({m.destination for m in self.moves})

    @model_validator(mode="after")
    def _one_role_each(self) -> RepackPlan:
        sources = [m.source for m in self.moves]
        if len(sources) != len(set(sources)):
            raise ValueError("a rollout is released twice in one plan")
        if set(sources) & {m.destination for m in self.moves}:
            raise ValueError("a rollout is both a source and a destination in one plan")
        return self


def is_candidate(r: RolloutLoad, policy: RepackPolicy) -> bool:
    """Algorithm 1, line 3, with the additions the module docstring explains."""
    if r.n_reqs == 0 or r.waiting > 0 or r.n_reqs >= policy.batch_limit:
        return False
    if r.kv_used >= policy.c_max:
        return False
    if policy.require_draining:
        return r.draining
    return r.draining or r.kv_used < r.kv_prev


def plan_repack(loads: Iterable[RolloutLoad], policy: RepackPolicy) -> RepackPlan:
    """Best-fit consolidation within each version group (Algorithm 1); see the module docstring."""
    groups: dict[int, list[RolloutLoad]] = defaultdict(list)
    seen: set[str] = set()
    for r in loads:
        if r.rollout in seen:
            raise ValueError(f"rollout {r.rollout!r} appears twice")
        seen.add(r.rollout)
        if is_candidate(r, policy):
            groups[r.version].append(r)
    moves: list[Move] = []
    candidates: dict[int, list[str]] = {}
    for version in sorted(groups):
        group = sorted(groups[version], key=lambda r: (r.kv_used, r.n_reqs, r.rollout))
        candidates[version] = [r.rollout for r in group]
        moves += _plan_group(group, policy)
    return RepackPlan(moves=moves, candidates=candidates)


def _plan_group(group: list[RolloutLoad], policy: RepackPolicy) -> list[Move]:
    kv_load = {r.rollout: r.kv_used for r in group}  # after the moves planned so far
    n_load = {r.rollout: r.n_reqs for r in group}
    released: set[str] = set()
    receiving: set[str] = set()
    moves: list[Move] = []
    for s in group:
        if s.rollout in released or s.rollout in receiving:
            continue
        fits = [
            d
            for d in group
            if d.rollout != s.rollout
            and d.accepting
            and d.rollout not in released
            and kv_load[d.rollout] + s.kv_used <= policy.c_max
            and n_load[d.rollout] + s.n_reqs <= policy.batch_limit
        ]
        if not fits:
            continue
        best = max(fits, key=lambda d: (kv_load[d.rollout], n_load[d.rollout], d.rollout))
        kv_load[best.rollout] += s.kv_used
        n_load[best.rollout] += s.n_reqs
        released.add(s.rollout)
        receiving.add(best.rollout)
        moves.append(
            Move(
                source=s.rollout,
                destination=best.rollout,
                version=s.version,
                n_reqs=s.n_reqs,
                kv_used=s.kv_used,
            )
        )
    return moves
