"""What the trainer loop asks of its compute, and what it gets back: no torch, no I/O.

Why a seam here: the torch trainer and the emulated (``sim``) trainer differ only in what an
update *is* (a policy-gradient step on real weights, or a sleep for a cost model's time) and in
what a checkpoint and a published version hold. Everything around the update (gathering batches,
staleness, screening, checkpoint cadence, the schedule's publish gate, records) is the same, and
is written once in :mod:`.loop`; a schedule comparison run on the sim trainer then measures the
same loop a real run uses.

The protocol is small on purpose: a compute keeps its own state (a model and an optimizer, or a
tensor of zeros) and its own executor for blocking work; the loop only says *when*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from laminar.rl import Screened
    from laminar.roles.trainer.publisher import WeightPublisher
    from laminar.weights.transfer import VersionBuffer


@dataclass
class StepResult:
    """A global batch's update. ``grad_norm`` is the mean over the steps that applied (None when
    none did); ``skipped_steps`` of ``steps`` optimizer steps were skipped as non-finite;
    ``weights_wait_s``: how long its optimizer steps waited for a publish's background copy
    (part of that publish's stall, ``roles/trainer/staging.py``)."""

    stats: dict[str, float]
    grad_norm: float | None
    tokens: int
    steps: int = 0
    skipped_steps: int = 0
    weights_wait_s: float = 0.0


@dataclass
class Progress:
    """Where training stands: what a checkpoint records and a restart resumes from.

    ``batches`` counts the batches sampled (a round schedule's gate compares versions with it);
    ``history`` the per-version entries a checkpoint carries (:mod:`.checkpoint`), or None for a
    compute whose checkpoints carry none (the sim trainer keeps only the counters).
    """

    version: int = 0
    cursor: int = 0
    batches: int = 0
    history: list[dict[str, Any]] | None = None


@dataclass
class Resumed:
    """What a compute found at start-up. ``publish``: its weights must go out again under
    ``progress.version`` before training (rollouts restarted from disk catch up with them)."""

    progress: Progress = field(default_factory=Progress)
    publish: bool = False


class Compute(Protocol):
    """The update and the state it changes; every method may block only in its own executor."""

    async def resume(self) -> Resumed:
        """Load what a previous run left (a checkpoint, a state file), or start fresh."""
        ...

    async def train(self, screened: Screened, version: int) -> StepResult:
        """Update on the kept trajectories (never empty) to make ``version``."""
        ...

    async def checkpoint(self, progress: Progress, saved_at: float) -> None:
        """Make ``progress`` (and the weights it names) survive a restart."""
        ...

    async def stage(self, publisher: WeightPublisher, version: int) -> VersionBuffer:
        """Stage the current weights in ``publisher``'s host buffer as ``version`` (the stall);
        the copy may still be under way when this returns (the buffer's ``ready``)."""
        ...

    async def evaluate(self, version: int) -> dict[str, Any] | None:
        """Held-out figures of the current weights for the metrics line (None: none measured)."""
        ...

    async def close(self) -> None: ...
