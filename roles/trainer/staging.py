"""Copying a version out while the next step trains: a fence the optimizer step waits on.

Why this is safe: between two optimizer steps nothing writes the parameters. Forward and backward
only read them (FSDP2 gathers a layer from its shards into separate storage), and the optimizer
step is the one write. So a publish need not hold training for its copy. At a step boundary the
trainer captures *what* to copy (:func:`whole_tensors` or :func:`.sharding.own_rows`: a list of
byte offsets and source tensors, references only), a background thread copies the bytes into the
publisher's buffer, and the next optimizer step first waits for that copy: the :class:`Fence`.

The trainer's stall per publish is then the capture (a walk over the state dict, independent of
the tensors' sizes) plus the part of the copy that outlasts the next forward and backward, which
is nothing unless a step is shorter than a copy. Both are measured: the capture as the publish's
stall, the wait as the next step's ``weights_wait_s``.

On CUDA the copy runs on its own stream, ordered after the step that made the weights (an event
recorded at capture), so the device-to-host traffic overlaps the next step's kernels as well.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from laminar.runtime.clock import get_clock
from laminar.weights.manifest import WeightManifest

from .published import entry_dtype, published_state

#: What a copy does: each source tensor, cast to a dtype, in full, at a byte offset of the version
#: buffer.
CopyPlan = list[tuple[int, torch.Tensor, torch.dtype]]


def whole_tensors(model: torch.nn.Module, manifest: WeightManifest) -> CopyPlan:
    """Every published tensor of ``model`` at its place in ``manifest`` (a replicated model: this
    rank holds them all)."""
    state = dict(published_state(model))
    plan: CopyPlan = []
    for entry in manifest.tensors:
        tensor = state[entry.name].detach()
        dtype = entry_dtype(entry)
        if tensor.numel() * dtype.itemsize != entry.nbytes:
            raise ValueError(f"{entry.name} has changed size since the version was planned")
        if entry.nbytes:
            plan.append((entry.offset, tensor, dtype))
    return plan


@torch.no_grad()
def copy_plan(plan: CopyPlan, view: memoryview) -> int:
    """Copy each source into ``view`` at its offset, cast to its dtype; returns the bytes
    written."""
    if not plan:
        return 0
    flat = torch.frombuffer(view, dtype=torch.uint8)
    written = 0
    for offset, tensor, dtype in plan:
        nbytes = tensor.numel() * dtype.itemsize
        flat[offset : offset + nbytes].view(dtype).copy_(tensor.reshape(-1))
        written += nbytes
    return written


class Fence:
    """Background copies of the weights, one at a time, in the order started; :meth:`wait` is
    what the optimizer step calls first (see the module).

    The copies run on one daemon thread of the fence's own, not an executor's: a copy may end
    in a collective (a barrier, a send to rank 0), which cannot be interrupted, and an
    executor's threads are joined at interpreter exit, so a process whose group hangs would
    hang on its way out too (as :mod:`.rank` explains for the group's work itself)."""

    def __init__(self, name: str = "weights-copy") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._newest: Future[None] | None = None
        self._stream: torch.cuda.Stream | None = None

    def start(self, copy: Callable[[], object], device: torch.device) -> Future[None]:
        """Run ``copy`` after every copy started before; the future is its outcome (the caller
        that publishes owns its error: :meth:`wait` does not raise it). Call this from the
        thread that trains, between steps: on CUDA the copy waits for the work queued so far."""
        made: torch.cuda.Event | None = None
        if device.type == "cuda":
            made = torch.cuda.Event()
            made.record()
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        future: Future[None] = Future()
        self._jobs.put(_Job(copy, made, future))
        self._newest = future
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                self._copy(job.copy, job.made)
            except BaseException as exc:  # the future carries it to the publish
                job.future.set_exception(exc)
            else:
                job.future.set_result(None)

    def _copy(self, copy: Callable[[], object], made: torch.cuda.Event | None) -> None:
        with torch.no_grad():
            if made is None or self._stream is None:
                copy()
                return
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(made)
                copy()
                self._stream.synchronize()

    @property
    def busy(self) -> bool:
        return self._newest is not None and not self._newest.done()

    def wait(self) -> float:
        """Block until every copy started is done; the seconds blocked (0.0 when none ran)."""
        newest = self._newest
        if newest is None or newest.done():
            return 0.0
        clock = get_clock()
        start = clock.time()
        with contextlib.suppress(Exception):  # the publish that started it reports it
            newest.result()
        return clock.time() - start

    def abandon(self) -> None:
        """End the thread after what it is doing, without waiting: the group broke, and a copy
        blocked in one of its collectives ends when that collective fails."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def close(self) -> None:
        """Wait for the copies under way, then end the thread."""
        self.wait()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()  # nothing left to copy: it ends at once
            self._thread = None


@dataclass
class _Job:
    copy: Callable[[], object]
    made: torch.cuda.Event | None
    future: Future[None]
