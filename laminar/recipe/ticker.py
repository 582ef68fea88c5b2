"""Progress lines while a blocking call runs, so a log never goes silent for long.

Why a thread: the calls that take long here (a validation check inside SFT, ``laminar eval``)
block the only loop that could print. An agentic task's are the slow ones: each greedy episode
waits on its environment (a sandboxed tool call per step, plus its simulated latency), so an
evaluation of a few hundred episodes would print nothing for a minute or more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Ticker:
    """Says ``"{what} (N s so far)"`` through ``say`` while a :meth:`during` block runs, at
    most ``every_s`` after the last line, whether that line was its own or the caller's (who
    reports it with :meth:`said`)."""

    def __init__(self, say: Callable[[str], object], every_s: float = 10.0) -> None:
        self.say = say
        self.every_s = every_s
        self.said_at = time.monotonic()

    def said(self) -> None:
        """The caller printed a line of its own: the next tick is due ``every_s`` from now."""
        self.said_at = time.monotonic()

    @contextmanager
    def during(self, what: str) -> Iterator[None]:
        began = time.monotonic()
        done = threading.Event()

        def tick() -> None:
            while not done.wait(max(0.0, self.said_at + self.every_s - time.monotonic())):
                self.said_at = time.monotonic()
                self.say(f"{what} ({self.said_at - began:.0f} s so far)")

        thread = threading.Thread(target=tick, name="progress-ticker", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
