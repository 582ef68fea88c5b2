"""Experiment tracking: a run's numbers in TensorBoard (always, offline) and W&B (when configured).

Why: people compare runs in TensorBoard or Weights & Biases, not in JSONL files. The JSONL the
trainer writes (``trainer.metrics_file``) stays the record of truth that
:mod:`laminar.devmode.plots` and the benchmarks read; a tracker is a second, lossy view of the same
numbers for those tools.

Who writes what (the trainer its versions and evaluations, the dev-mode supervisor the
cluster's view), where the files go and why logging never gets in the way: docs/training.md,
*Tracking experiments*.

**Modules.** :mod:`.config` (the ``tracking`` section, what the trainers' configs import),
:mod:`.plan` (where a run writes, what ``laminar run`` prints), :mod:`.backends` (TensorBoard,
W&B, none), :mod:`.worker` (the threads: :class:`ThreadedTracker`, :func:`open_tracker`),
:mod:`.records` (what is tracked: trainer records, cluster samples). Tuning constants
(``backends.FLUSH_S``, ``worker.MAX_PENDING``, ``worker.OPEN_TIMEOUT_S``) live in their modules.
"""

from .backends import NullTracker, TensorBoardTracker, Tracker, WandbTracker
from .config import TrackingConfig, WandbConfig
from .plan import TRAINER_ROLES, TrackingPlan, plan_for_run
from .records import NOT_SCALARS, TrainerTracking, cluster_scalars, record_scalars
from .worker import ThreadedTracker, open_tracker

__all__ = [
    "NOT_SCALARS",
    "TRAINER_ROLES",
    "NullTracker",
    "TensorBoardTracker",
    "ThreadedTracker",
    "Tracker",
    "TrackingConfig",
    "TrackingPlan",
    "TrainerTracking",
    "WandbConfig",
    "WandbTracker",
    "cluster_scalars",
    "open_tracker",
    "plan_for_run",
    "record_scalars",
]
