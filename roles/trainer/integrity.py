"""What the trainer refused to learn from, counted and shouted about.

Why its own piece: excluding a trajectory (failed reward, non-finite behaviour logprobs:
:mod:`laminar.rl.screen`) or skipping a non-finite optimizer step (:mod:`.compute`) keeps the
weights sound, but done quietly it would hide a broken reward function or a broken engine for a
whole run. So each is

* counted in Prometheus (``laminar_trainer_excluded_trajectories_total{reason}``,
  ``laminar_trainer_skipped_steps_total``) and in the trainer's ``status`` and heartbeat stats
  (``excluded_trajectories``, ``skipped_steps``: the manager sees them with every heartbeat);
* logged at warning (exclusions) or error (skipped steps) level with the version and the ids;
* recorded in the version's metrics line and history entry.

Both trainers count here (:mod:`.loop`); packing what is kept for the torch update is
:func:`.compute.prepare`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter

from .step import StepResult

if TYPE_CHECKING:
    from laminar.rl import Screened

STEP_NONFINITE = "step_nonfinite"  # history: every step of the batch was skipped


class IntegrityMonitor:
    def __init__(self, registry: CollectorRegistry, log: Any) -> None:
        self.log = log
        self.excluded: dict[str, int] = {}  # reason -> trajectories excluded so far
        self.skipped_steps = 0
        self.m_excluded = Counter(
            "laminar_trainer_excluded_trajectories",
            "Trajectories consumed but not trained on (failed reward, non-finite logprobs)",
            ["reason"],
            registry=registry,
        )
        self.m_skipped = Counter(
            "laminar_trainer_skipped_steps",
            "Optimizer steps skipped because the loss or gradient norm was not finite",
            registry=registry,
        )

    def screened(self, screened: Screened, version: int) -> None:
        """Count a batch's exclusions (``version``: the one being trained)."""
        for reason, ids in screened.excluded.items():
            self.excluded[reason] = self.excluded.get(reason, 0) + len(ids)
            self.m_excluded.labels(reason).inc(len(ids))
            self.log.warning(
                "trajectories excluded from training",
                reason=reason,
                version=version,
                count=len(ids),
                trajectories=ids[:8],
            )

    def stepped(self, result: StepResult, version: int) -> None:
        if not result.skipped_steps:
            return
        self.skipped_steps += result.skipped_steps
        self.m_skipped.inc(result.skipped_steps)
        self.log.error(
            "non-finite loss or gradient: optimizer steps skipped",
            version=version,
            skipped=result.skipped_steps,
            steps=result.steps,
        )

    def history(self, screened: Screened, result: StepResult) -> dict[str, Any]:
        """The history entry's fields for one version (see :mod:`.checkpoint`)."""
        excluded = {k: list(v) for k, v in screened.excluded.items()}
        ids = [t.trajectory_id for t in screened.kept]
        if result.steps and result.skipped_steps == result.steps:  # nothing of it was learnt
            excluded[STEP_NONFINITE] = ids
            ids = []
        entry: dict[str, Any] = {"ids": ids}
        if excluded:
            entry["excluded"] = excluded
        if result.skipped_steps:
            entry["skipped_steps"] = result.skipped_steps
        return entry

    def stats(self) -> dict[str, float]:
        return {
            "excluded_trajectories": float(sum(self.excluded.values())),
            "skipped_steps": float(self.skipped_steps),
        }
