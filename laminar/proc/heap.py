"""Giving the C heap's free pages back to the system, for processes that hold models.

glibc keeps what a process frees in its arenas for the next allocation. A trainer step or an
engine's in-place reload frees gigabytes of short-lived tensors at once (activations, a layer's
old weights), and the process then stays that large until its next allocation of the same kind:
memory that the machine's other processes (the relay, the rollouts, their KV caches) cannot use.
``malloc_trim`` returns it; it costs milliseconds, and only calls that follow such bursts make it.
Elsewhere (musl, macOS) it is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Any


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None)


def release_freed_heap() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``)."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().malloc_trim(0)
