"""Says when a process's event loop stops turning, and which code is holding it.

Why: a role is one event loop, and everything it does for the cluster runs on it: heartbeats,
RPC replies, streams. Code that blocks it (a ``time.sleep`` or a CPU-bound loop in an agent's
environment or a reward hook, a synchronous call into a library) stops all of that at once, and
what the cluster shows is a member that went silent and was marked dead, far from the cause.
Asyncio's debug mode names slow callbacks, but only after they return and at a cost on every
callback; this watch costs one timer callback per ``interval`` on the loop and a thread that
wakes as often.

How: a callback on the loop stamps the time every ``interval``. A daemon thread checks the stamp;
once it is ``threshold_s`` old, the loop is blocked, and the thread reads the loop thread's
current Python stack (``sys._current_frames``: what is running *now*, not what ran last) and says
where it is, once per stall, while the stall goes on, then once more, with its whole length,
when the loop turns again. The thread only reads; it never touches the loop. When the innermost
frames are the loop's own (:func:`loop_machinery`), no Python code of the role holds it: the
process waited for a CPU, or a callback without Python frames ran; the stall says so (``idle``)
rather than name the loop as the culprit, and the thread keeps looking while it lasts: code of
the role found holding the loop later in the same stall is said then (a starved process that
goes on into a blocking call, seen on a loaded machine, was reported as idle only).

Started by ``laminar serve`` once the role is ready (starting an engine may block the loop on
purpose), with ``cluster.loop_stall_s``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

#: Innermost frames said for a stall: enough to show the caller of a blocking call.
STACK_FRAMES = 4


@dataclass(frozen=True)
class Stall:
    """One stall, as the watch says it: ``ended`` False while it goes on (``seconds`` so far)."""

    seconds: float
    ended: bool
    where: str  # "file:line in function" of the innermost frame, "" when it was not seen
    stack: list[str]  # the innermost frames, outermost first
    #: No Python code of the role held the loop: the loop's own frames were innermost. The
    #: process waited for a CPU, or a call without Python frames (a C callback) held the loop.
    idle: bool = False


class LoopWatch:
    """Watches ``loop`` from a thread; ``say`` gets each :class:`Stall` (from that thread)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        threshold_s: float,
        say: Callable[[Stall], None],
        *,
        interval: float | None = None,
    ) -> None:
        if threshold_s <= 0:
            raise ValueError(f"threshold_s must be positive, got {threshold_s}")
        self.loop = loop
        self.threshold_s = threshold_s
        self.interval = interval if interval is not None else threshold_s / 4
        self.say = say
        self._stamp = time.monotonic()
        self._loop_thread: int | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loopwatch", daemon=True)

    def start(self) -> None:
        """Call from the loop's thread (a callback or a coroutine running on ``loop``)."""
        self._loop_thread = threading.get_ident()
        self._tick()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join(timeout=5)

    def _tick(self) -> None:
        self._stamp = time.monotonic()
        if not self._stop.is_set():
            self._timer = self.loop.call_later(self.interval, self._tick)

    def _watch(self) -> None:
        stalled: Stall | None = None  # the stall being watched, as first said
        since = 0.0
        while not self._stop.wait(self.interval):
            stamp = self._stamp
            age = time.monotonic() - stamp
            if stalled is None and age >= self.threshold_s:
                where, stack, idle = self._where()
                stalled, since = Stall(age, False, where, stack, idle), stamp
                self._say(stalled)
            elif stalled is not None and stamp != since:  # the loop turned again
                # From the last stamp before the stall to the first after it: the stall's length
                # to within one interval.
                self._say(Stall(stamp - since, True, stalled.where, stalled.stack, stalled.idle))
                stalled = None
            elif stalled is not None and stalled.idle:
                # Said as idle (the process waiting for a CPU, or a call without Python frames)
                # and not over: look again. Code of the role that holds the loop now, in the
                # same stall (a starved process that then runs a blocking call, as on a loaded
                # machine), is said once found, and the end names it.
                where, stack, idle = self._where()
                if not idle and where:
                    stalled = Stall(time.monotonic() - since, False, where, stack, False)
                    self._say(stalled)

    def _say(self, stall: Stall) -> None:
        try:
            self.say(stall)
        except Exception:  # a broken reporter must not end the watch
            traceback.print_exc()

    def _where(self) -> tuple[str, list[str], bool]:
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "", [], False
        summary = traceback.extract_stack(frame)[-STACK_FRAMES:]
        stack = [f"{f.filename}:{f.lineno} in {f.name}" for f in summary]
        return (stack[-1] if stack else ""), stack, loop_machinery(summary)


def loop_machinery(frames: traceback.StackSummary) -> bool:
    """Whether the innermost frames are the event loop's own: asyncio's loop waiting in its
    selector or running a callback that has no Python frame, or uvloop's loop (all C below
    ``run``). A selector wait called by other code (``multiprocessing``'s ``join``) is not."""
    if not frames:
        return False
    last = frames[-1]
    path = last.filename.replace("\\", "/")
    if last.name == "select" and len(frames) > 1 and frames[-2].name == "_run_once":
        return True
    if "/asyncio/" in path and last.name in ("_run_once", "_run", "run_forever"):
        return True
    in_a_loop = "/asyncio/" in path or "/uvloop/" in path
    return in_a_loop and last.name in ("run", "run_until_complete")
