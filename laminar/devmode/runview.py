"""The supervisor's eyes on a dev-mode run: sample, record, display (see
:mod:`laminar.devmode.progress`).

:class:`RunView` runs for the life of ``laminar run``. Every ``run.view_interval_s`` it asks the
manager for the membership view (heartbeat stats of every member), appends one sample to
``cluster.jsonl``, copies new manager events (admin API, ``/v1/events?format=json``) into
``events.jsonl``, reads new lines of the trainer's metrics file, and refreshes the display:

* ``live`` (a terminal): a panel redrawn in place, children's output only in ``logs/``;
* ``lines`` (a pipe, CI): one progress line every ``run.progress_interval_s``, plus the
  membership table whenever it changes and any child line that reports an error;
* ``logs``: every child line as well (what ``laminar run`` printed before it had a display).

Each sample also goes to the run's tracker (:mod:`laminar.tracking`) as the TensorBoard run
``cluster`` beside the trainer's (and a W&B run when configured): generated and trained tokens/s,
rollouts by phase, KV-cache use and queue lengths, per rollout as well
(:func:`laminar.tracking.cluster_scalars`). Step = whole seconds since the run first started (its
first ``cluster.jsonl`` sample), so a run continued with ``--resume`` extends its curves instead
of drawing over them. :meth:`RunView.run` opens the tracker; the supervisor closes it with
:meth:`RunView.close_tracking` once the roles are stopped, so stopping them never waits on it.

Failures to reach the manager or its admin API are skipped, not fatal: the run's own processes
matter more than its dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from laminar.devmode.progress import progress_line, render_progress
from laminar.devmode.status import AdminClient, fetch_status, render_status
from laminar.runtime.errors import LaminarError
from laminar.tracking import (
    NullTracker,
    ThreadedTracker,
    TrackingPlan,
    cluster_scalars,
    open_tracker,
)
from laminar.tracking.progress import TrainerLog, cluster_sample, summarize

#: how long :meth:`RunView.close_tracking` waits for the tracker to write what it has and close
TRACKER_CLOSE_S = 5.0


class _ConsoleLog:
    """What the tracker has to say (backends started or failed), on the supervisor's console."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def _say(self, event: str, style: str, **kw: object) -> None:
        extra = "".join(f" {k}={v}" for k, v in kw.items() if v is not None)
        self.console.print(
            Text("supervisor | ", style="bold white") + Text(f"{event}{extra}", style=style)
        )

    def info(self, event: str, **kw: object) -> None:
        self._say(event, "dim", **kw)

    def warning(self, event: str, **kw: object) -> None:
        self._say(event, "bold yellow", **kw)


class RunView:
    def __init__(
        self,
        *,
        run_dir: Path,
        trainer_metrics: Path | None,
        console: Console,
        mode: str,
        interval_s: float,
        progress_interval_s: float,
        title: str,
        tracking: TrackingPlan | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.console = console
        self.mode = mode
        self.interval_s = interval_s
        self.progress_interval_s = progress_interval_s
        self.title = title
        self.trainer = TrainerLog(trainer_metrics) if trainer_metrics else None
        self.samples: list[dict[str, Any]] = []
        self.started = time.time()
        self.admin: AdminClient | None = None
        self.events_seen = 0  # per manager: a resumed run's new manager counts from 1 again
        self.live: Live | None = None
        self._last_line = 0.0
        self._last_shape: Any = None
        self.status: Any = None
        self.tracking = tracking
        self.tracker: ThreadedTracker | NullTracker = NullTracker()
        self._origin: float | None = None  # step 0 of the tracker's cluster scalars

    # -- the loop --

    async def run(
        self,
        manager: str,
        token: bytes,
        cluster: Any,
        stopping: asyncio.Event,
        deadline: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        if self.tracking is not None:
            self.tracker = open_tracker(self.tracking, "cluster", _ConsoleLog(self.console))
        if self.mode == "live":
            self.live = Live(console=self.console, refresh_per_second=2, transient=False)
            self.live.start()
        try:
            while not stopping.is_set():
                await self._tick(manager, token, cluster)
                if deadline is not None and loop.time() >= deadline:
                    break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await stopping.wait()
        finally:
            if self.live is not None:
                self.live.stop()
                self.live = None
            # the tracker stays open: the supervisor stops the roles first, then calls
            # close_tracking (closing here delayed every SIGTERM by the tracker's flush)

    async def close_tracking(self, timeout: float = TRACKER_CLOSE_S) -> None:
        """Write what the tracker has queued and close it, off the event loop, within
        ``timeout`` (a backend still busy then is left to its daemon thread, and said so).
        The supervisor calls it once the roles are stopped; calling it again does nothing."""
        tracker, self.tracker = self.tracker, NullTracker()
        if isinstance(tracker, NullTracker):
            return
        if not await asyncio.to_thread(tracker.close, timeout):
            _ConsoleLog(self.console).warning(
                f"tracking did not finish within {timeout:g} s; the rest of its scalars are lost"
            )

    async def _tick(self, manager: str, token: bytes, cluster: Any) -> None:
        with contextlib.suppress(LaminarError, OSError):
            self.status = await fetch_status(manager, token, cluster, timeout=2.0)
        if self.status is not None:
            sample = cluster_sample(self.status.members)
            self.samples.append(sample)
            if self._origin is None:
                self._origin = self._first_sample_time() or sample["time"]
            self._append("cluster.jsonl", [sample])
            if self.admin is None:
                url = next(
                    (m.endpoints.get("admin") for m in self.status.members if m.role == "manager"),
                    None,
                )
                if url:
                    self.admin = AdminClient(url, token, timeout=2.0)
        if self.admin is not None:
            with contextlib.suppress(LaminarError, OSError, ValueError):
                events = await asyncio.to_thread(
                    self.admin.get, f"/v1/events?format=json&since={self.events_seen}"
                )
                if events:
                    self.events_seen = max(e["seq"] for e in events)
                    self._append("events.jsonl", events)
        if self.trainer is not None:
            self.trainer.poll()
        if self.status is not None and self._origin is not None:
            step = round(self.samples[-1]["time"] - self._origin)
            self.tracker.log(step, cluster_scalars(self.progress()))
        self._show()

    def _first_sample_time(self) -> float | None:
        """The time of a resumed run's first sample, if it has one."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            with (self.run_dir / "cluster.jsonl").open() as f:
                return float(json.loads(f.readline())["time"])
        return None

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        with (self.run_dir / name).open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    # -- display --

    def progress(self) -> Any:
        return summarize(self.trainer, self.samples, self.started, time.time())

    def _show(self) -> None:
        p = self.progress()
        if self.live is not None:
            self.live.update(render_progress(p, self.title))
            return
        if self.status is not None:
            shape = sorted((m.instance, m.state, m.incarnation) for m in self.status.members)
            if shape != self._last_shape:
                self._last_shape = shape
                self.console.print(render_status(self.status))
        now = time.monotonic()
        if now - self._last_line >= self.progress_interval_s:
            self._last_line = now
            self.console.print(progress_line(p), highlight=False)

    def final(self) -> None:
        """The last word: the final membership and progress."""
        if self.status is not None:
            self.console.print(render_status(self.status, title="final membership"))
        self.console.print(progress_line(self.progress()), highlight=False)
