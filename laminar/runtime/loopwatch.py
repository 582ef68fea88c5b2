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
rather than name the loop as the culprit. The thread keeps looking while the stall lasts: one
turn of the loop runs every callback that is ready, so one stall can pass from one holder to
another (a starved process that goes on into a blocking call would be reported as idle only; a
connection callback slowed by a loaded machine, read first, would hide the ``time.sleep`` run
right after it). A new holder (another callback or task:
the frame the loop entered, not the line it is at) is said when found, up to
:data:`MAX_HOLDERS` per stall, and the stall's end names the last one said.

Started by ``laminar serve`` once the role is ready (starting an engine may block the loop on
purpose), with ``cluster.loop_stall_s``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Innermost frames said for a stall: enough to show the caller of a blocking call.
STACK_FRAMES = 4
#: Holders said per stall at most: one turn of the loop can run many slow callbacks.
MAX_HOLDERS = 4


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
        stalled: Stall | None = None  # the stall being watched, as last said
        since = 0.0
        said_entry: tuple[str, str] | None = None  # :func:`entry` of the holder said last
        holders = 0
        while not self._stop.wait(self.interval):
            stamp = self._stamp
            age = time.monotonic() - stamp
            if stalled is None and age >= self.threshold_s:
                where, stack, idle, said_entry = self._where()
                stalled, since, holders = Stall(age, False, where, stack, idle), stamp, 1
                self._say(stalled)
            elif stalled is not None and stamp != since:  # the loop turned again
                # From the last stamp before the stall to the first after it: the stall's length
                # to within one interval.
                self._say(Stall(stamp - since, True, stalled.where, stalled.stack, stalled.idle))
                stalled = None
            elif stalled is not None and holders < MAX_HOLDERS:
                # Not over: look again. Code of the role holding the loop now that is not the
                # holder said (another callback or task in the same turn, or code after an idle
                # reading) is said once found, and the end names it.
                where, stack, idle, now = self._where()
                if not idle and where and (stalled.idle or now != said_entry):
                    stalled = Stall(time.monotonic() - since, False, where, stack, False)
                    said_entry, holders = now, holders + 1
                    self._say(stalled)

    def _say(self, stall: Stall) -> None:
        try:
            self.say(stall)
        except Exception:  # a broken reporter must not end the watch
            traceback.print_exc()

    def _where(self) -> tuple[str, list[str], bool, tuple[str, str] | None]:
        """Where the loop's thread is: its innermost frame, the innermost frames, whether they
        are the loop's own, and the frame the loop entered to run the holder (:func:`entry`)."""
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "", [], False, None
        whole = traceback.extract_stack(frame)
        summary = whole[-STACK_FRAMES:]
        stack = [f"{f.filename}:{f.lineno} in {f.name}" for f in summary]
        return (stack[-1] if stack else ""), stack, loop_machinery(summary), entry(whole)


def entry(frames: traceback.StackSummary) -> tuple[str, str] | None:
    """The callback or task the loop is running, as (file, function) of the first frame inside
    the loop's dispatch: after asyncio's innermost ``Handle._run`` (``events.py``) or, under
    uvloop, whose dispatch is all C, after the asyncio and uvloop frames that run the loop
    (``runners.py``, uvloop's ``run`` wrapper). Two readings with the same entry are one
    holder, whatever line it is at."""
    dispatch = None
    for i, f in enumerate(frames):
        path = f.filename.replace("\\", "/")
        if "/uvloop/" in path or (
            "/asyncio/" in path
            and ((path.endswith("/events.py") and f.name == "_run") or path.endswith("/runners.py"))
        ):
            dispatch = i
    if dispatch is None or dispatch + 1 >= len(frames):
        return None
    inner = frames[dispatch + 1]
    return inner.filename, inner.name


def loop_machinery(frames: Sequence[traceback.FrameSummary]) -> bool:
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
