"""The trainer role's endpoints and messages, as the manager's admin API and tools see them.

Declaration only, and torch-free (the manager, the CLI and the admin API import it):
:class:`TrainerApi` has the signatures, ``TrainerService`` serves them; the emulated trainer
serves :class:`LearningApi` too, so the admin API draws either's learning curves.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from laminar.runtime.endpoint import endpoint
from laminar.runtime.stats import VersionedStats

#: the most points one ``learning`` answer carries, of each kind
LEARNING_MAX_POINTS = 2000


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


class LearningRequest(BaseModel):
    since: int = Field(0, ge=0, description="Only versions after this one (0: all kept).")
    limit: int = Field(500, ge=1, le=LEARNING_MAX_POINTS, description="At most this many, "
                       "the newest, of the versions and of the evaluations.")  # fmt: skip


class VersionPoint(BaseModel):
    """One trained version as the learning curves show it (from its record in ``metrics_file``)."""

    version: int
    time: float = Field(description="Wall clock when the version went out (or was held).")
    reward: float | None = Field(
        None, description="The policy's mean reward: of every trajectory scored while the batch "
        "was gathered, filtered groups too (else of the batch trained on)."
    )  # fmt: skip
    reward_trained: float | None = Field(None, description="Mean reward of the batch trained on.")
    tokens: int = Field(description="Tokens trained on.")
    tokens_per_s: float | None = Field(
        None, description="Tokens trained on over the wall time since the previous version "
        "(null for the first version this trainer process recorded)."
    )  # fmt: skip
    staleness_mean: float
    staleness_max: int


class EvalPoint(BaseModel):
    """One held-out evaluation (``trainer.eval``) of the weights of ``version``."""

    version: int
    time: float
    accuracy: float
    n: int | None = Field(None, description="Held-out problems evaluated.")
    buckets: dict[str, float] = Field(
        default_factory=dict, description="Accuracy per task bucket (e.g. chain length)."
    )


class LearningSeries(BaseModel):
    version: int = Field(description="The trainer's newest version.")
    versions: list[VersionPoint]
    evals: list[EvalPoint] = Field(
        description="With ``version >= since``: an evaluation of version ``since`` may be "
        "recorded after it, so a reader polling with its newest version still gets it."
    )


class LearningApi:
    """What every trainer (the torch one and the emulated one) serves of its learning curves."""

    @endpoint
    async def learning(self, request: LearningRequest) -> LearningSeries:
        """The newest versions after ``since`` and their evaluations, bounded by ``limit``."""
        raise NotImplementedError


class TrainerApi(LearningApi):
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
