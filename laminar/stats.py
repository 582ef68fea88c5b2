"""Heartbeat statistics, typed: what each role's heartbeats carry, as the readers see it.

Why: on the wire a heartbeat's stats are a plain ``dict[str, float]`` (``Heartbeat.stats``), and
that stays so (any role may add a number without a schema change; tools and tests add their
own). Read by string key, though, a misspelled key is a silent 0. So every reader parses the dict
once into the model of the member's role and reads attributes: a misspelled field is an
``AttributeError`` (and a type checker's error) instead of a wrong number.

* Fields are the keys the producers publish (``RolloutService.stats``, the trainers' and the
  relay's ``stats``), with the value a missing key has always been read as.
* Counts are ``int`` and flags ``bool``: the producers send them as ``float`` (``3.0``, ``1.0``),
  and pydantic takes exactly those; a fractional count or a flag other than 0/1 is a producer's
  bug and fails to parse, naming the key.
* Keys no model names are kept (``model_extra``), never an error: a role that publishes more, or a
  role with no model here, still parses.
* An empty dict (a member that has not heartbeated since it joined) parses to ``None``: "no
  numbers yet" is not "every number is 0".

Only pydantic is imported here, so the manager, the CLI and the admin API can read stats without
importing a role (or torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict

RolloutPhase = Literal["running", "draining", "switching"]

S = TypeVar("S", bound="HeartbeatStats")


class HeartbeatStats(BaseModel):
    """Any member's stats: no known keys, every key kept as an extra."""

    model_config = ConfigDict(extra="allow", frozen=True)

    @classmethod
    def parse(cls: type[S], raw: Mapping[str, float]) -> S | None:
        """The model of ``raw``, or None for an empty dict (no heartbeat yet)."""
        return cls.model_validate(raw) if raw else None

    def wire(self) -> dict[str, float]:
        """What a heartbeat carries: every field (and extra) as a float, so a producer that
        builds its model publishes exactly the keys its readers parse."""
        return {k: float(v) for k, v in self.model_dump().items()}


class VersionedStats(HeartbeatStats):
    """Stats of a role that holds a weight version (rollout, trainer, relay)."""

    version: int = 0


class RolloutStats(VersionedStats):
    """``RolloutService.stats``: the engine's load and the rollout's phase flags."""

    kv_cache_usage: float = 0.0  # fraction of the engine's KV-cache blocks in use
    running: int = 0
    waiting: int = 0
    in_flight: int = 0  # trajectories it holds (running, waiting or being handed over)
    leased_ahead: int = 0  # fresh leases in hand, not started yet (``rollout.lease_ahead``)
    env_waiting: int = 0  # episodes out of the engine, waiting for the environment's answer
    generated_tokens: int = 0
    completed: int = 0
    failed: int = 0
    paused_for_weights: bool = False  # a newer version waits: it takes nothing until loaded
    operator_drain: bool = False  # an operator's drain: it takes nothing until resumed
    migrating: bool = False  # a repack is moving its trajectories out
    starved: bool = False  # its last take found the prompt pool dry

    @property
    def phase(self) -> RolloutPhase:
        """``switching``: a newer version waits or a repack is moving its trajectories out;
        ``draining``: an operator told it to take no prompts; ``running``: taking prompts."""
        if self.paused_for_weights or self.migrating:
            return "switching"
        if self.operator_drain:
            return "draining"
        return "running"


class TrainerStats(VersionedStats):
    """The trainer's stats (``TrainerService.stats``, and ``SimTrainerService.stats`` for the
    emulated one, which publishes ``trained_tokens`` and ``batches`` instead of the rest)."""

    cursor: int = 0
    max_staleness: int = 0
    excluded_trajectories: int = 0  # stay 0 in a healthy run (issue 15)
    skipped_steps: int = 0
    trained_tokens: int = 0
    batches: int = 0

    def alert_counters(self) -> dict[str, int]:
        """The counters that stay at 0 in a healthy run: growth is an alert."""
        return {
            "excluded_trajectories": self.excluded_trajectories,
            "skipped_steps": self.skipped_steps,
        }


class RelayStats(VersionedStats):
    """``RelayService.stats``: the newest version it holds (-1: none) and its chain place."""

    version: int = -1
    chain_epoch: int = 0
    chain_position: int = -1  # -1: not in the chain


STATS_BY_ROLE: dict[str, type[HeartbeatStats]] = {
    "rollout": RolloutStats,
    "trainer": TrainerStats,
    "sim_trainer": TrainerStats,
    "relay": RelayStats,
}


def parse_stats(role: str, raw: Mapping[str, float]) -> HeartbeatStats | None:
    """``raw`` as the model of ``role`` (the base model for a role with none here)."""
    return STATS_BY_ROLE.get(role, HeartbeatStats).parse(raw)
