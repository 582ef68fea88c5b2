"""The tracker a process logs to: :class:`ThreadedTracker` fans scalars out to its backends,
each on a thread of its own (a *lane*), so nothing it does can block or break the caller.

Each lane opens its backend (imports, ``wandb.init``), then writes the rows queued meanwhile
and every row after. One lane per backend is what keeps them apart: ``wandb.init`` online
without a network waits about 90 s, and TensorBoard is written all that time; only W&B's own
rows wait (up to ``max_pending``). A backend that raises, or does not open within
``open_timeout_s``, is logged once and dropped for the rest of the process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

# the module, not its package (whose __init__ imports this one): ``FLUSH_S`` is read when a lane
# starts, so a test may change it
import laminar.tracking.backends as backends

from .backends import NullTracker, TensorBoardTracker, WandbTracker
from .plan import TrackingPlan

MAX_PENDING = 10_000  # rows queued for a backend before a stuck one starts dropping
#: a backend that has not opened by then is dropped (its rows so far with it); generous, as a
#: loaded machine may take many seconds to import TensorBoard's writer or start wandb-core
OPEN_TIMEOUT_S = 60.0

Opener = tuple[str, Callable[[], Any]]  # (backend name, makes the backend: runs on its lane)
Row = tuple[int, dict[str, float], float]  # step, scalars, wall time
_STOP = object()


class _Lane:
    """One backend, with its own queue and thread: opened within a deadline, then fed rows."""

    def __init__(
        self, name: str, open_: Callable[[], Any], owner: ThreadedTracker, max_pending: int,
        open_timeout_s: float,
    ) -> None:  # fmt: skip
        self.name = name
        self.owner = owner
        self.max_pending = max_pending
        self.open_timeout_s = open_timeout_s
        self.backend: Any = None
        self.off = False  # failed: rows for it are no longer queued
        self._open = open_
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._dropping = False
        self._lock = threading.Lock()
        self._abandoned = False  # the open missed its deadline: close what it makes, if ever
        self.thread = threading.Thread(
            target=self._work, name=f"laminar-tracking-{name}", daemon=True
        )

    # -- the caller's side --

    def put(self, row: Row) -> None:
        if self.off:
            return
        with self._lock:
            full = self._pending >= self.max_pending
            warn = full and not self._dropping
            self._dropping = self._dropping or full
            if not full:
                self._pending += 1
        if warn:
            self.owner.log_.warning(
                "tracking falls behind; dropping scalars", backend=self.name, pending=self._pending
            )
        if not full:
            self._queue.put(row)

    def stop(self) -> None:
        self._queue.put(_STOP)

    # -- the lane's thread --

    def _work(self) -> None:
        backend = self._open_in_time()
        if backend is None:
            return
        self.backend = backend
        self.owner.log_.info(f"tracking to {self.name}", where=getattr(backend, "where", None))
        wait = getattr(backend, "flush_s", backends.FLUSH_S)
        while True:
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if item is not None:
                with self._lock:
                    self._pending -= 1
                    self._dropping = self._dropping and self._pending > 0
                step, values, wall = item
                if not self._call("writing", "log", step, values, wall_time=wall):
                    return
            if not self._call("flushing", "idle"):
                return
        self._call("closing", "close")

    def _open_in_time(self) -> Any:
        """The backend, or None (logged) when its constructor raised or missed the deadline.
        The constructor runs on a thread of its own, which is left behind if it hangs; should
        it finish later, what it made is closed there."""
        done = threading.Event()
        made: dict[str, Any] = {}

        def opening() -> None:
            try:
                made["backend"] = self._open()
            except BaseException as exc:  # SystemExit too: said now, not at the deadline
                made["error"] = exc
            with self._lock:
                late = self._abandoned
                done.set()
            if late and "backend" in made:
                with contextlib.suppress(Exception):
                    made["backend"].close()

        threading.Thread(target=opening, name=f"laminar-tracking-{self.name}-open",
                         daemon=True).start()  # fmt: skip
        done.wait(self.open_timeout_s)
        with self._lock:
            if not done.is_set():
                self._abandoned = True
        if self._abandoned:
            self._fail(TimeoutError(f"not open after {self.open_timeout_s:g} s"), "starting")
            return None
        if "error" in made:
            self._fail(made["error"], "starting")
            return None
        return made["backend"]

    def _call(self, doing: str, method: str, *args: Any, **kwargs: Any) -> bool:
        """The backend's ``method`` if it has one; False (and the lane off) if it raised."""
        call = getattr(self.backend, method, None)
        if call is None:
            return True
        try:
            call(*args, **kwargs)
        except Exception as exc:
            self._fail(exc, doing)
            return False
        return True

    def _fail(self, exc: BaseException, doing: str) -> None:
        self.off = True
        error = f"{type(exc).__name__}: {exc}"
        self.owner.failed[self.name] = error
        self.owner.log_.warning(
            f"{self.name} tracking failed while {doing}; it is off for the rest of this process",
            error=error,
        )


class ThreadedTracker:
    """Fans scalars out to backends, each on its own thread; never blocks the caller, never
    raises (a value that is not a number is left out, with one warning per key).

    ``openers`` make the backends, on their lanes (imports and ``wandb.init`` included). A
    backend whose construction or write raises, or that is not open within ``open_timeout_s``,
    is logged once (``log.warning``) and dropped; the others go on.
    """

    def __init__(
        self,
        openers: Sequence[Opener],
        log: Any = None,
        max_pending: int = MAX_PENDING,
        open_timeout_s: float = OPEN_TIMEOUT_S,
    ) -> None:
        self.log_ = log if log is not None else structlog.get_logger("laminar.tracking")
        self.failed: dict[str, str] = {}  # backend name -> the error that disabled it
        self._closed = False
        self._skipped: set[str] = set()  # keys whose value was not a number (warned once)
        self.lanes = [_Lane(name, open_, self, max_pending, open_timeout_s)
                      for name, open_ in openers]  # fmt: skip
        for lane in self.lanes:
            lane.thread.start()

    @property
    def off(self) -> bool:
        """Every backend failed: ``log`` does nothing."""
        return all(lane.off for lane in self.lanes)

    @property
    def backends(self) -> list[Any]:
        """The backends open and writing now."""
        return [lane.backend for lane in self.lanes if lane.backend is not None and not lane.off]

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._closed or self.off or not scalars:
            return
        try:
            row: Row = (int(step), self._numbers(scalars), time.time())
        except Exception as exc:  # a step that is not a number, scalars that are no mapping
            self._skip(f"step {step!r}", exc)
            return
        if not row[1]:
            return
        for lane in self.lanes:  # one dict for all: backends only read it
            lane.put(row)

    def _numbers(self, scalars: Mapping[str, Any]) -> dict[str, float]:
        """A copy (the caller may reuse its dict) of the values that are numbers."""
        out: dict[str, float] = {}
        for key, value in scalars.items():
            try:
                out[str(key)] = float(value)
            except (TypeError, ValueError, OverflowError) as exc:
                self._skip(str(key), exc)
        return out

    def _skip(self, what: str, exc: Exception) -> None:
        if what not in self._skipped:
            self._skipped.add(what)
            self.log_.warning(
                "tracking leaves out a value that is not a number", key=what,
                error=f"{type(exc).__name__}: {exc}"[:200],
            )  # fmt: skip

    def close(self, timeout: float = 30.0) -> bool:
        """Write what is queued, close the backends; False if that took longer than
        ``timeout`` (the lanes are daemon threads: they never hold the process up)."""
        if not self._closed:
            self._closed = True
            for lane in self.lanes:
                lane.stop()
        deadline = time.monotonic() + timeout
        for lane in self.lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
        return not any(lane.thread.is_alive() for lane in self.lanes)


def open_tracker(
    plan: TrackingPlan,
    job: str,
    log: Any = None,
    config: Mapping[str, Any] | None = None,
    open_timeout_s: float = OPEN_TIMEOUT_S,
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
                dir=plan.wandb_dir(),
                id_file=plan.base / f"wandb-{job}.id" if plan.base is not None else None,
                config=config,
            )

        openers.append(("wandb", open_wandb))
    return ThreadedTracker(openers, log, open_timeout_s=open_timeout_s)
