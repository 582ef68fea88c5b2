"""The trainer role's endpoints and messages, as the manager's admin API and tools see them.

Declaration only, and torch-free (the manager, the CLI and the admin API import it):
:class:`TrainerApi` has the signatures, ``TrainerService`` serves them.
"""

from __future__ import annotations

from pydantic import BaseModel

from laminar.runtime.endpoint import endpoint
from laminar.runtime.stats import VersionedStats


class TrainerStatus(BaseModel):
    version: int
    cursor: int
    resumed_from: str | None
    resumed_version: int | None  # the checkpoint's version and cursor at startup
    resumed_cursor: int | None
    digests: dict[int, str]  # version -> manifest digest of what was published
    published: int  # newest version the master relay verified
    stalls_s: list[float]  # the trainer's stall of each publish
    max_staleness: int
    training: bool
    excluded: dict[str, int] = {}  # reason -> trajectories consumed but not trained on
    skipped_steps: int = 0  # optimizer steps skipped as non-finite
    version_conflicts: int = 0  # versions the master refused: their number was already taken


class TrainerApi:
    @endpoint
    async def status(self) -> TrainerStatus:
        """Version, data cursor, resume point, publish acknowledgements and stalls."""
        raise NotImplementedError


class TrainerStats(VersionedStats):
    """The trainer's stats (``TrainerService.stats``, and ``SimTrainerService.stats`` for the
    emulated one, which publishes ``trained_tokens`` and ``batches`` instead of the rest)."""

    cursor: int = 0
    max_staleness: int = 0
    excluded_trajectories: int = 0  # stay 0 in a healthy run
    skipped_steps: int = 0
    trained_tokens: int = 0
    batches: int = 0

    def alert_counters(self) -> dict[str, int]:
        """The counters that stay at 0 in a healthy run: growth is an alert."""
        return {
            "excluded_trajectories": self.excluded_trajectories,
            "skipped_steps": self.skipped_steps,
        }
