"""Where scalars end up: TensorBoard event files, a W&B run, or nowhere.

A backend is used from one thread only (its lane in :mod:`.worker`), which also makes it:
its constructor may import, touch the disk or the network, and take its time."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from .config import WandbConfig

FLUSH_S = 5.0  # TensorBoard files reach the disk at least this often
#: how long ``wandb.init`` may try before W&B itself gives up (online without a network it
#: would wait 90 s); the worker's own deadline (``worker.OPEN_TIMEOUT_S``) is a little longer
WANDB_INIT_TIMEOUT_S = 50.0


class Tracker(Protocol):
    """Scalars at a step. ``log`` may be called from the event loop: it must not block."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> Any: ...


class TensorBoardTracker:
    """TensorBoard event files in ``logdir`` (one TensorBoard run): the ``tensorboard`` package's
    event protobufs in its TFRecord framing (``RecordWriter``, the writer torch's own
    ``SummaryWriter`` uses), written synchronously: the caller (its lane's thread) is the writing
    thread, so an I/O error reaches it instead of dying in a writer thread of its own.

    Not tensorboardX: importing it imports torch wherever torch is installed, seconds of CPU in
    the supervisor of every ``laminar run`` and in the sim trainer, which have no other use for
    torch; this writer's imports are a fraction of that."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path, flush_s: float | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        Path(logdir).mkdir(parents=True, exist_ok=True)
        # TensorBoard's file name; the pid at the end: a process restarted within the same second
        # gets its own file
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.writer = RecordWriter(open(Path(logdir) / name, "wb"))  # closed in close()
        self.writer.write(
            Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()
        )
        self.flush_s = FLUSH_S if flush_s is None else flush_s
        self._flushed = time.monotonic()
        self._dirty = False
        self.where = str(logdir)

    def log(self, step: int, scalars: Mapping[str, float], wall_time: float | None = None) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        event = self._event(
            wall_time=time.time() if wall_time is None else wall_time,
            step=step,
            summary=self._summary(value=values),
        )
        self.writer.write(event.SerializeToString())
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
            settings=wandb.Settings(console="off", silent=True, init_timeout=WANDB_INIT_TIMEOUT_S),
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
