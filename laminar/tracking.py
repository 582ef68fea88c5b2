"""Experiment tracking: a run's numbers in TensorBoard (always, offline) and W&B (when configured).

Why: people compare runs in TensorBoard or Weights & Biases, not in JSONL files. The JSONL the
trainer writes (``trainer.metrics_file``) stays the record of truth that :mod:`laminar.plots`
and the benchmarks read; a tracker is a second, lossy view of the same numbers for those tools.

**Who writes what.** The numbers are written by the process that has them, so the same thing
works under ``laminar run`` and when roles run as separate ``laminar serve`` processes on a
cluster, with nothing to aggregate afterwards:

* the **trainer** role (``trainer`` and ``sim_trainer``, through :class:`TrainerTracking`) owns a
  tracker for its version records and evaluations; it is the only process that has them, and it
  runs in both modes. Step = the trainer version, so runs line up by "how much training", and
  TensorBoard's wall/relative axes give the time view (every event has its wall time);
* in dev mode the **supervisor** (:mod:`laminar.runview`) adds the cluster's view, which it already
  samples every second for its display: generated and trained tokens/s, rollout phases, KV use,
  queue lengths. Step = whole seconds since the run first started (a run continued with
  ``--resume`` goes on from its ``cluster.jsonl``): time series with no version of their own.
  On a cluster without a supervisor the trainer's ``train/tokens_per_s`` and every role's
  Prometheus metrics carry the throughput.

Both write under one TensorBoard root, as two TensorBoard *runs* (``trainer/`` and ``cluster/``)
so one ``tensorboard --logdir`` shows them, and ``tensorboard --logdir runs`` compares every run
made here. The root defaults to ``tensorboard/`` beside the trainer's metrics file, i.e. in the
run directory (``runs/<name>-<time>/tensorboard``). With W&B each process makes its own W&B run,
grouped by the run directory's name, with ``job_type`` ``trainer`` or ``cluster``; the W&B run id
is kept in the run directory, so a restarted or resumed trainer continues its W&B run.

**Never in the way.** :meth:`Tracker.log` only queues the numbers: a worker thread opens the
backends (``wandb.init`` can take seconds), writes and flushes, so neither the event loop nor the
training step waits for disk or network. A backend that raises is logged once and dropped for the
rest of the process; a tracker that falls behind drops scalars rather than memory.

**Libraries.** Event files are written with tensorboardX (a small base dependency: the file
format, not the viewer; ``pip install tensorboard`` for that, the ``dev`` extra has it). Note that
importing tensorboardX imports torch where torch is installed; it happens on the worker thread,
in processes that have torch loaded anyway (the trainer; the supervisor, which loads the role
classes to validate their configs). ``wandb`` is imported only when configured (``pip install
'laminar-rl[wandb]'``); ``mode: offline`` needs no account or network, and ``wandb sync``
uploads the run later.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Literal, Protocol

import structlog
from pydantic import Field

from .config import Strict

FLUSH_S = 5.0  # TensorBoard files reach the disk at least this often
MAX_PENDING = 10_000  # log() calls queued before a stuck tracker starts dropping


class WandbConfig(Strict):
    """A W&B run per process that tracks (the trainer; the supervisor in dev mode)."""

    project: str = Field(description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user; unset: your default).")
    name: str | None = Field(
        None,
        description="Run name (unset: the run directory's name); `-trainer` or `-cluster` added.",
    )
    group: str | None = Field(
        None, description="W&B group (unset: the run directory's name): a run's processes."
    )
    tags: list[str] = Field(default_factory=list, description="W&B tags.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="offline: write locally, no account or network (`wandb sync` uploads later); "
        "unset: W&B's default (the WANDB_MODE variable, else online).",
    )
    dir: str | None = Field(
        None, description="Where W&B writes its `wandb/` folder (unset: the run directory)."
    )


class TrackingConfig(Strict):
    """Where the trainer's records and evaluations go besides ``metrics_file``
    (:mod:`laminar.tracking`)."""

    tensorboard: bool | str = Field(
        True,
        description="TensorBoard event files: true: `tensorboard/` beside `metrics_file` (none "
        "without one); a directory; false: off. The trainer writes `<dir>/trainer`, `laminar "
        "run` `<dir>/cluster`.",
    )
    wandb: WandbConfig | None = Field(
        None, description="Weights & Biases (unset: off; needs `pip install 'laminar-rl[wandb]'`)."
    )


# -- where ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrackingPlan:
    """Where a run's trackers write: ``tensorboard`` is the root (``<root>/<job>`` per process),
    ``base`` the run directory (W&B's default dir, names and run-id files)."""

    tensorboard: Path | None
    wandb: WandbConfig | None
    base: Path | None

    @classmethod
    def of(cls, cfg: TrackingConfig, base: str | Path | None) -> TrackingPlan:
        """The plan of ``cfg`` for a run whose directory is ``base`` (the metrics file's)."""
        root: Path | None = None
        if isinstance(cfg.tensorboard, str):
            root = Path(cfg.tensorboard)
        elif cfg.tensorboard and base is not None:
            root = Path(base) / "tensorboard"
        return cls(root, cfg.wandb, Path(base) if base is not None else None)

    @property
    def enabled(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def run_name(self) -> str:
        if self.base is None:
            return "laminar"
        return self.base.resolve().name

    def hints(self) -> list[str]:
        """What ``laminar run`` prints at start: how to look at this run."""
        out = []
        if self.tensorboard is not None:
            command = _tensorboard_command()
            out.append(
                f"TensorBoard: {command or 'pip install tensorboard; tensorboard'} "
                f"--logdir {_short(self.tensorboard)}"
            )
        w = self.wandb
        if w is not None:
            if importlib.util.find_spec("wandb") is None:
                out.append(
                    "W&B is configured but the wandb package is missing "
                    "(pip install 'laminar-rl[wandb]'); the run goes on without it"
                )
            else:
                where = _short(self._wandb_dir() / "wandb")
                mode = w.mode or os.environ.get("WANDB_MODE") or "online"
                what = f"W&B: project {w.project}, group {w.group or self.run_name()}"
                if mode == "offline":
                    what += f", offline in {where} (upload: wandb sync {where}/offline-run-*)"
                elif mode != "disabled":
                    what += " (the trainer logs the run's URL)"
                out.append(what)
        return out

    def _wandb_dir(self) -> Path:
        if self.wandb is not None and self.wandb.dir is not None:
            return Path(self.wandb.dir)
        return self.base if self.base is not None else Path.cwd()


TRAINER_ROLES = ("trainer", "sim_trainer")


def plan_for_run(
    config: Any, roles: Sequence[tuple[str, str, Mapping[str, Any]]], run_dir: Path
) -> TrackingPlan:
    """``laminar run``'s plan: the trainer's (``roles``: each process's role, config section
    and overrides; ``config`` the :class:`~laminar.config.LaminarConfig`), which the cluster's
    scalars share; under ``run_dir`` when no trainer writes a metrics file."""
    from .roles_registry import load_role  # the trainer's model, for its defaults

    for role, section, overrides in roles:
        if role in TRAINER_ROLES:
            model = load_role(role).config_model
            cfg = config.role_config(section, model, dict(overrides))
            metrics = getattr(cfg, "metrics_file", None)
            return TrackingPlan.of(cfg.tracking, Path(metrics).parent if metrics else run_dir)
    return TrackingPlan.of(TrackingConfig(), run_dir)


def _short(path: Path) -> str:
    """A path as a person would type it: through no links, relative to here if below."""
    real = path.resolve()
    try:
        return str(real.relative_to(Path.cwd()))
    except ValueError:
        return str(real)


def _tensorboard_command() -> str | None:
    """``tensorboard`` when it is on PATH, else the one installed beside this Python (a venv
    not activated), else None (not installed: tensorboardX writes the files, not the viewer)."""
    if shutil.which("tensorboard"):
        return "tensorboard"
    beside = Path(sys.executable).parent / "tensorboard"
    return _short(beside) if beside.exists() else None


# -- the interface and its backends -----------------------------------------------------------


class Tracker(Protocol):
    """Scalars at a step. ``log`` may be called from the event loop: it must not block."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> Any: ...


class TensorBoardTracker:
    """TensorBoard event files in ``logdir`` (one TensorBoard run), written with tensorboardX's
    synchronous writer: the caller (:class:`ThreadedTracker`'s worker) is the writing thread, so
    an I/O error reaches it instead of dying in a writer thread of its own."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path, flush_s: float | None = None) -> None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        Path(logdir).mkdir(parents=True, exist_ok=True)
        # the pid in the name: a process restarted within the same second gets its own file
        self.writer = EventsWriter(str(Path(logdir) / "events"), f".{os.getpid()}")
        self.flush_s = FLUSH_S if flush_s is None else flush_s
        self._flushed = time.monotonic()
        self._dirty = False
        self.where = str(logdir)

    def log(self, step: int, scalars: Mapping[str, float], wall_time: float | None = None) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        self.writer.write_event(
            self._event(
                wall_time=time.time() if wall_time is None else wall_time,
                step=step,
                summary=self._summary(value=values),
            )
        )
        self._dirty = True

    def idle(self) -> None:
        """Between writes: flush what was written if the last flush is ``flush_s`` old."""
        if self._dirty and time.monotonic() - self._flushed >= self.flush_s:
            self.writer.flush()
            self._flushed, self._dirty = time.monotonic(), False

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run. ``id_file`` keeps its id, so a restarted process continues the same run."""

    name = "wandb"

    def __init__(
        self,
        cfg: WandbConfig,
        *,
        name: str,
        group: str,
        job_type: str,
        dir: Path,
        id_file: Path | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        import wandb

        dir.mkdir(parents=True, exist_ok=True)
        run_id = None
        if id_file is not None and id_file.is_file():
            run_id = id_file.read_text().strip() or None
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=name,
            group=group,
            job_type=job_type,
            tags=cfg.tags or None,
            mode=cfg.mode,
            dir=str(dir),
            config=dict(config) if config else None,
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",  # the supervisor's cluster run may share a process in tests
            settings=wandb.Settings(console="off", silent=True),
        )
        if id_file is not None and run_id is None:
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(self.run.id)
        online = not (self.run.offline or self.run.disabled)
        self.where = (self.run.url if online else None) or str(self.run.dir)

    def log(self, step: int, scalars: Mapping[str, float], wall_time: float | None = None) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class NullTracker:
    """Tracking off: every call does nothing."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        pass

    def close(self, timeout: float = 0.0) -> bool:
        return True


Opener = tuple[str, Callable[[], Any]]  # (backend name, makes the backend: runs on the worker)
_STOP = object()


class ThreadedTracker:
    """Fans scalars out to backends on a worker thread; never blocks the caller, never raises.

    The backends are made on the worker (imports and ``wandb.init`` included). A backend whose
    construction or write raises is logged once (``log.warning``) and dropped; the others go on.
    """

    def __init__(
        self, openers: Sequence[Opener], log: Any = None, max_pending: int = MAX_PENDING
    ) -> None:
        self.log_ = log if log is not None else structlog.get_logger("laminar.tracking")
        self.max_pending = max_pending
        self.backends: list[Any] = []
        self.failed: dict[str, str] = {}  # backend name -> the error that disabled it
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._dropping = False
        self._closed = False
        self._off = False  # every backend failed: log() is a no-op
        self._thread = threading.Thread(
            target=self._work, args=(list(openers),), name="laminar-tracking", daemon=True
        )
        self._thread.start()

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._closed or self._off or not scalars:
            return
        values = {str(k): float(v) for k, v in scalars.items()}  # a copy: the caller may reuse
        with self._lock:
            if self._pending >= self.max_pending:
                if not self._dropping:
                    self._dropping = True
                    self.log_.warning(
                        "tracking falls behind; dropping scalars", pending=self._pending
                    )
                return
            self._pending += 1
        self._queue.put((int(step), values, time.time()))

    def close(self, timeout: float = 30.0) -> bool:
        """Write what is queued, close the backends; False if that took longer than
        ``timeout`` (the worker is a daemon thread: it never holds the process up)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the worker --

    def _fail(self, name: str, exc: BaseException, doing: str) -> None:
        self.failed[name] = f"{type(exc).__name__}: {exc}"
        self.log_.warning(
            f"{name} tracking failed while {doing}; it is off for the rest of this process",
            error=self.failed[name],
        )

    def _work(self, openers: list[Opener]) -> None:
        for name, open_ in openers:
            try:
                backend = open_()
            except Exception as exc:
                self._fail(name, exc, "starting")
                continue
            self.backends.append(backend)
            self.log_.info(f"tracking to {name}", where=getattr(backend, "where", None))
        self._off = not self.backends
        while True:
            try:
                item = self._queue.get(timeout=FLUSH_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if item is not None:
                with self._lock:
                    self._pending -= 1
                    self._dropping = self._dropping and self._pending > 0
                step, values, wall = item
                self._each("writing", "log", step, values, wall_time=wall)
            self._each("flushing", "idle")
        self._each("closing", "close")
        self.backends = []

    def _each(self, doing: str, method: str, *args: Any, **kwargs: Any) -> None:
        """``method`` of every backend that has it; one that raises is dropped."""
        for backend in list(self.backends):
            call = getattr(backend, method, None)
            if call is None:
                continue
            try:
                call(*args, **kwargs)
            except Exception as exc:
                self.backends.remove(backend)
                self._off = not self.backends
                self._fail(backend.name, exc, doing)


def open_tracker(
    plan: TrackingPlan, job: str, log: Any = None, config: Mapping[str, Any] | None = None
) -> ThreadedTracker | NullTracker:
    """The tracker of process ``job`` (``trainer``, ``cluster``) under ``plan``; ``config`` is
    what W&B records as the run's config."""
    if not plan.enabled:
        return NullTracker()
    openers: list[Opener] = []
    if plan.tensorboard is not None:
        logdir = plan.tensorboard / job
        openers.append(("tensorboard", lambda: TensorBoardTracker(logdir)))
    w = plan.wandb
    if w is not None:
        base = plan.run_name()

        def open_wandb() -> WandbTracker:
            if importlib.util.find_spec("wandb") is None:
                raise RuntimeError("the wandb package is missing: pip install 'laminar-rl[wandb]'")
            return WandbTracker(
                w,
                name=f"{w.name or base}-{job}",
                group=w.group or base,
                job_type=job,
                dir=plan._wandb_dir(),
                id_file=plan.base / f"wandb-{job}.id" if plan.base is not None else None,
                config=config,
            )

        openers.append(("wandb", open_wandb))
    return ThreadedTracker(openers, log)


# -- the trainer's records --------------------------------------------------------------------

# Record keys that are not measurements: the step itself, bookkeeping, absolute timestamps.
NOT_SCALARS = frozenset(
    {"version", "cursor", "time", "eval", "sampled_at", "train_start", "train_end", "published_at"}
)


def record_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics-file line as tags: a version record's numbers as ``train/<key>``, an eval
    line's (``"eval": true``) as ``eval/<key>``. Nested, non-numeric and boolean values and the
    keys in :data:`NOT_SCALARS` are left out (the JSONL keeps them)."""
    prefix = "eval" if record.get("eval") else "train"
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, Real):
            continue
        out[f"{prefix}/{key}"] = float(value)
    return out


class TrainerTracking:
    """The trainers' side (``trainer`` and ``sim_trainer`` share it): each metrics-file line goes
    to the tracker at step = its version, plus ``train/tokens_per_s``, the trained tokens over
    the wall time since the previous version (on the caller's clock)."""

    def __init__(
        self,
        cfg: TrackingConfig,
        metrics_file: str | None,
        log: Any = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        base = Path(metrics_file).parent if metrics_file else None
        self.plan = TrackingPlan.of(cfg, base)
        self.tracker = open_tracker(self.plan, "trainer", log, config)
        self._last: float | None = None

    def record(self, record: Mapping[str, Any], now: float) -> None:
        scalars = record_scalars(record)
        if not record.get("eval"):
            tokens = record.get("tokens")
            if self._last is not None and now > self._last and isinstance(tokens, Real):
                scalars["train/tokens_per_s"] = float(tokens) / (now - self._last)
            self._last = now
        if scalars and "version" in record:
            self.tracker.log(int(record["version"]), scalars)

    def close(self, timeout: float = 5.0) -> None:
        """Within ``timeout``: a stopping role has ``run.shutdown_grace_s`` before SIGKILL."""
        self.tracker.close(timeout)
