"""Experiment tracking: a run's numbers in TensorBoard (always, offline) and W&B (when configured).

Why: people compare runs in TensorBoard or Weights & Biases, not in JSONL files. The JSONL the
trainer writes (``trainer.metrics_file``) stays the record of truth that
:mod:`laminar.devmode.plots` and the benchmarks read; a tracker is a second, lossy view of the same
numbers for those tools.

**Who writes what.** The numbers are written by the process that has them, so the same thing
works under ``laminar run`` and when roles run as separate ``laminar serve`` processes on a
cluster, with nothing to aggregate afterwards:

* the **trainer** role (``trainer`` and ``sim_trainer``, through :class:`TrainerTracking`) owns a
  tracker for its version records and evaluations; it is the only process that has them, and it
  runs in both modes. Step = the trainer version, so runs line up by "how much training", and
  TensorBoard's wall/relative axes give the time view (every event has its wall time);
* in dev mode the **supervisor** (:mod:`laminar.devmode.runview`) adds the cluster's view, which it
already
  samples every second for its display: generated and trained tokens/s, rollout phases, KV use,
  queue lengths (:func:`cluster_scalars`). Step = whole seconds since the run first started (a
  run continued with ``--resume`` goes on from its ``cluster.jsonl``): time series with no
  version of their own. On a cluster without a supervisor the trainer's ``train/tokens_per_s``
  and every role's Prometheus metrics carry the throughput.

Both write under one TensorBoard root, as two TensorBoard *runs* (``trainer/`` and ``cluster/``)
so one ``tensorboard --logdir`` shows them, and ``tensorboard --logdir runs`` compares every run
made here. The root defaults to ``tensorboard/`` beside the trainer's metrics file, i.e. in the
run directory (``runs/<name>-<time>/tensorboard``). With W&B each process makes its own W&B run,
grouped by the run directory's name, with ``job_type`` ``trainer`` or ``cluster``; the W&B run id
is kept in the run directory, so a restarted or resumed trainer continues its W&B run.

**Never in the way.** :meth:`ThreadedTracker.log` only queues the numbers (and never raises):
each backend has a thread of its own that opens it (``wandb.init`` can take seconds, or 90 s
online without a network), writes and flushes, so neither the event loop, the training step nor
the other backend waits for its disk or network. A backend that raises, or does not open within
a deadline, is logged once and dropped for the rest of the process; a backend that falls behind
drops scalars rather than memory.

**Libraries.** Event files are written with the ``tensorboard`` package's writer (its event
protobufs and TFRecord framing, without TensorFlow or torch; the same package is the viewer).
``wandb`` is imported only when configured (``pip install 'laminar-rl[wandb]'``); ``mode:
offline`` needs no account or network, and ``wandb sync`` uploads the run later.

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
