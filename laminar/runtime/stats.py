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
from typing import TypeVar

from pydantic import BaseModel, ConfigDict

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
